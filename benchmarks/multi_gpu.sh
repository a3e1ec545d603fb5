#!/usr/bin/env bash
# The multi-GPU run book (docs/distributed.md): sharded private training on 2, 4 or 8 GPUs of one host with NCCL.
# Each part finishes in under ten minutes; results go to $OUT/<part> (default: gpu_results/multi_gpu/<part>).
#
#   benchmarks/multi_gpu.sh parity      # the distributed tests as they are (torchrun, Gloo, CPU): FSDP2 and DDP
#   benchmarks/multi_gpu.sh nccl-smoke  # the tiny model through DPTrainer and Trainer with fsdp on every GPU (NCCL)
#   benchmarks/multi_gpu.sh table-1b    # Llama-style 1.1B full fine-tune on 2 GPUs: Trainer, DPTrainer, Opacus
#   benchmarks/multi_gpu.sh table-8b    # Llama-3-8B-shaped full fine-tune on 8 GPUs: the same modes
#   benchmarks/multi_gpu.sh dry-run     # no GPU needed: benchmarks/fsdp_e2e.py --dry-run on 2 CPU processes (Gloo)
#
# Every table row is one torchrun of benchmarks/fsdp_e2e.py with one mode (a failing mode, OOM included, stops only
# its own launch); rank 0 appends a JSON row to $OUT/<part>/results.jsonl. Opacus rows need opacus importable: put
# its wheel in .whl/ (pip download --no-deps opacus==1.6.0) and this script installs it into /tmp/opacus; without it
# the rows are skipped with a message. The packages the GPU image lacks (torchopt, optree, dp-accounting, dm-tree)
# must be importable first, as for gpu_tables.sh.
set -euo pipefail
part=${1:?"usage: $0 parity|nccl-smoke|table-1b|table-8b|dry-run"}
out=${OUT:-gpu_results/multi_gpu}/$part
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mode_timeout=${MODE_TIMEOUT:-270}  # seconds per launch: a hung collective ends here, not at NCCL's 30 minutes

gpus() { python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }

need_gpus() {
  local have
  have=$(gpus)
  if (( have < $1 )); then
    echo "$part needs $1 GPUs, this machine has $have: skipped" | tee "$out/skipped.txt"
    exit 0
  fi
}

with_opacus() {
  local wheel
  wheel=$(ls .whl/opacus-*.whl 2>/dev/null | head -n 1 || true)
  if ! python -c "import opacus" 2>/dev/null && [[ -n $wheel ]]; then
    pip install --quiet --no-deps --target /tmp/opacus "$wheel" && export PYTHONPATH="$PYTHONPATH:/tmp/opacus"
  fi
  python -c "import opacus" 2>/dev/null || echo "opacus is not importable: the opacus rows are skipped" >&2
}

# one torchrun per mode, so that each row's peak memory is its own and a failure ends only its launch
table() {
  local world=$1 workload=$2 steps=$3 warmup=$4 mode
  need_gpus "$world"
  with_opacus
  for mode in hf dp opacus; do
    echo "== $workload $mode on $world GPUs" | tee -a "$out/log.txt"
    timeout "$mode_timeout" torchrun --standalone --nproc_per_node "$world" benchmarks/fsdp_e2e.py \
      --workload "$workload" --modes "$mode" --steps "$steps" --warmup "$warmup" --out "$out" \
      >>"$out/log.txt" 2>&1 || echo "$workload $mode: exit $? (see $out/log.txt)" | tee -a "$out/failures.txt"
  done
  cat "$out/results.jsonl" 2>/dev/null || true
}

case $part in
  parity)  # the CPU tests (Gloo) as they are: one process on the union batch against 2 and 4 FSDP2 / DDP ranks
    python -m pytest -q -rf tests/torch/distributed/test_fsdp_trainer.py tests/torch/distributed/test_ddp_trainer.py \
      tests/core/test_sharded_step.py 2>&1 | tee "$out/pytest.txt" ;;
  nccl-smoke)  # every GPU, NCCL: the sharded step runs and each rank holds about 1 / W of the parameters
    need_gpus 2
    timeout "$mode_timeout" torchrun --standalone --nproc_per_node "$(gpus)" benchmarks/fsdp_e2e.py \
      --workload tiny_llama_full_s16_b4 --modes dp hf --steps 2 --warmup 1 --sampling-rate 0.1 --out "$out" \
      2>&1 | tee "$out/log.txt" ;;
  table-1b)
    table 2 llama1b_full_s512_b8_ckpt 10 5 ;;
  table-8b)  # an 8B step takes seconds: fewer steps
    table 8 llama8b_full_s1024_b2_ckpt 6 3 ;;
  dry-run)
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_e2e.py --dry-run --out "$out" \
      2>&1 | tee "$out/log.txt" ;;
  *)
    echo "unknown part: $part" >&2
    exit 2 ;;
esac
