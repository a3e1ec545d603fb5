#!/usr/bin/env bash
# The GPU measurements behind docs/performance.md, docs/memory.md and docs/moe.md, in parts that each finish in
# under ten minutes on one H200. Results go to $OUT/<part> (default: gpu_results/<part>).
#
#   benchmarks/gpu_tables.sh trainer-small   # BERT-base and GPT-2 small: Trainer, DPTrainer, Opacus, fixed-size, graphs
#   benchmarks/gpu_tables.sh trainer-small-tf32  # the same with TF32 matmuls on both sides (a setting, not the default)
#   benchmarks/gpu_tables.sh trainer-lora    # Llama-style 1.1B LoRA at 16 x 512 and 8 x 2048: the same modes
#   benchmarks/gpu_tables.sh scale           # 8B-shaped LoRA at 8 x 4096 and 1.1B full, with checkpointing
#   benchmarks/gpu_tables.sh max-sequence    # the longest sequence of the 8B-shaped LoRA model, private first
#   benchmarks/gpu_tables.sh moe             # Qwen3-MoE-shaped full fine-tune, profiled (expert dispatch share)
#   benchmarks/gpu_tables.sh compile         # torch_compile=True against the eager step: BERT-base, GPT-2, 1.1B LoRA
#   benchmarks/gpu_tables.sh layer-kernels   # one linear call's norms by route and its clipped sum, two forms; the
#                                            # kernels' launch settings swept
#   benchmarks/gpu_tables.sh cuda-tests      # the CUDA tests (pytest -m cuda)
#   BASE=DIR benchmarks/gpu_tables.sh same-draws  # the 1.1B full row on the same Poisson draws, this tree and the
#                                            # one in DIR (its opake_core and opake_torch: git archive REV opake_core
#                                            # opake_torch | tar -x -C DIR)
#   BASE=DIR benchmarks/gpu_tables.sh same-draws-small  # BERT-base and GPT-2 small under TF32, the same way
set -euo pipefail
part=${1:?"usage: $0 trainer-small|trainer-small-tf32|trainer-lora|scale|max-sequence|moe|compile|layer-kernels|cuda-tests|same-draws|same-draws-small"}
out=${OUT:-gpu_results}/$part
mkdir -p "$out"
e2e=(python benchmarks/e2e_trainer.py --steps 20 --warmup 15 --profile-steps 2 --budget-s 520)
case $part in
  trainer-small)
    "${e2e[@]}" --out "$out" --workloads bert_base_s128_b32 gpt2_small_s512_b16 \
      --modes hf dp opacus dp_fixed dp_graphs4 dp_instantiate ;;
  trainer-small-tf32)
    "${e2e[@]}" --out "$out" --workloads bert_base_s128_b32 gpt2_small_s512_b16 --modes hf dp dp_fixed --tf32 ;;
  trainer-lora)
    "${e2e[@]}" --out "$out" --workloads llama1b_lora16_s512_b16 llama1b_lora16_s2048_b8 \
      --modes hf dp opacus dp_fixed ;;
  scale)  # fewer steps: an 8B step takes about 5 s
    python benchmarks/e2e_trainer.py --steps 12 --warmup 8 --profile-steps 1 --budget-s 520 --out "$out" \
      --workloads llama1b_full_s512_b16_ckpt llama8b_lora16_s4096_b8_ckpt --modes hf dp ;;
  max-sequence)  # a mode's budget stops new trials, not one running (a trial at 8192 tokens takes about 90 s)
    python benchmarks/max_sequence.py --workload llama8b_lora16_s4096_b8_ckpt --modes dp_q1 hf --start 7168 \
      --out "$out" --budget-s 200 ;;
  moe)
    "${e2e[@]}" --out "$out" --workloads qwen3moe_full_s512_b8 --modes hf dp ;;
  compile)  # the first steps compile (minutes): the warm-up covers them; first_steps_s records the time
    "${e2e[@]}" --out "$out" --workloads bert_base_s128_b32 gpt2_small_s512_b16 llama1b_lora16_s512_b16 \
      --modes hf dp dp_compile ;;
  layer-kernels)
    python benchmarks/product_norms_bench.py --repeats 10 | tee "$out/norms.jsonl"
    python benchmarks/clipped_sum_bench.py --repeats 10 | tee "$out/sums.jsonl"
    python benchmarks/kernel_tiles.py | tee "$out/tiles.jsonl" ;;
  cuda-tests)
    # the notebooks' test needs nbformat, which GPU images often lack; it has no CUDA test
    python -m pytest -q -rf -m cuda tests --ignore tests/test_notebooks.py 2>&1 | tee "$out/pytest.txt" ;;
  same-draws)  # --privacy-seed (a diagnostic flag) draws the same batches in both runs
    same=(python benchmarks/e2e_trainer.py --steps 10 --warmup 4 --profile-steps 1 --privacy-seed 1
      --workloads llama1b_full_s512_b16_ckpt)
    "${same[@]}" --modes hf dp --out "$out/this"
    PYTHONPATH="${BASE:?set BASE to the other tree}:${PYTHONPATH:-}" "${same[@]}" --modes dp --out "$out/base" ;;
  same-draws-small)
    same=(python benchmarks/e2e_trainer.py --steps 10 --warmup 4 --profile-steps 1 --privacy-seed 1 --tf32
      --workloads bert_base_s128_b32 gpt2_small_s512_b16)
    "${same[@]}" --modes hf dp --out "$out/this"
    PYTHONPATH="${BASE:?set BASE to the other tree}:${PYTHONPATH:-}" "${same[@]}" --modes dp --out "$out/base" ;;
  *)
    echo "unknown part: $part" >&2
    exit 2 ;;
esac
