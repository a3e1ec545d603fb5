"""Patches are explicit and scoped: process-level patches are applied for a scope and undone, counted when nested;
training one model leaves every other model of the process unpatched; ``opake_torch.patches`` never imports the
trainer layer (the former import loop through ``patches.families`` and ``transformers.loss``)."""

from __future__ import annotations

import ast
import importlib
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from opake_torch.patches import RuntimePatch, applied_patches, apply_runtime_patches
from opake_torch.patches.runtime import module_attribute

ROOT = Path(__file__).resolve().parents[2]


def _wrapped(original):
    def replacement(*args):
        return ("patched", original(*args))

    return replacement


@pytest.fixture
def target(monkeypatch):
    """A module ``opake_test_target`` with a function ``f``, importable by name for the test's duration."""
    module = types.ModuleType("opake_test_target")
    module.f = lambda x: x
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_apply_and_undo_restore_the_original(target):
    original = target.f
    patch = module_attribute("opake_test_target", "f", _wrapped)
    assert "opake_test_target.f" not in applied_patches()
    handle = apply_runtime_patches([patch])
    assert target.f is not original and target.f(2) == ("patched", 2)
    assert "opake_test_target.f" in applied_patches() and handle.names == ("opake_test_target.f",)
    handle.undo()
    assert target.f is original and "opake_test_target.f" not in applied_patches()
    handle.undo()  # a second undo does nothing
    assert target.f is original


def test_applications_are_counted_and_never_wrap_twice(target):
    original = target.f
    patch = module_attribute("opake_test_target", "f", _wrapped)
    with apply_runtime_patches([patch]):
        patched = target.f
        with apply_runtime_patches([patch]):
            assert target.f is patched  # idempotent: one wrapper
        assert target.f is patched  # the outer scope still holds it
    assert target.f is original


def test_an_error_in_the_scope_undoes_the_patches(target):
    original = target.f
    with (
        pytest.raises(RuntimeError, match="inside"),
        apply_runtime_patches([module_attribute("opake_test_target", "f", _wrapped)]),
    ):
        raise RuntimeError("inside")
    assert target.f is original and "opake_test_target.f" not in applied_patches()


def test_a_failing_patch_undoes_the_ones_applied_before_it(target):
    original = target.f

    def broken(original):
        raise ValueError("cannot wrap")

    patches = [module_attribute("opake_test_target", "f", _wrapped), RuntimePatch("broken", lambda: 1, print, broken)]
    with pytest.raises(ValueError, match="cannot wrap"):
        apply_runtime_patches(patches)
    assert target.f is original and not {"opake_test_target.f", "broken"} & set(applied_patches())


def test_nothing_to_replace_is_skipped(target):
    with apply_runtime_patches([module_attribute("opake_test_target", "missing", _wrapped)]) as handle:
        assert handle.names == () and "opake_test_target.missing" not in applied_patches()
    assert not hasattr(target, "missing")


def test_a_later_replacement_is_left_in_place(target, caplog):
    with caplog.at_level(logging.WARNING, logger="opake_torch.patches.runtime"):
        with apply_runtime_patches([module_attribute("opake_test_target", "f", _wrapped)]):
            target.f = theirs = lambda x: -x
        assert target.f is theirs  # not overwritten by our original
    assert "replaced again" in caplog.text and "opake_test_target.f" not in applied_patches()


# --- training one model leaves the others unpatched ------------------------------------------------------------------

WATCHED = (
    "transformers.masking_utils",
    "transformers.modeling_utils",
    "transformers.integrations.hub_kernels",
    "transformers.models.llama.modeling_llama",
)


def _functions() -> dict[str, object]:
    """Every function and class of the watched transformers modules, and the registered attention functions."""
    found = {}
    for name in WATCHED:
        module = importlib.import_module(name)
        found.update({f"{name}.{k}": v for k, v in vars(module).items() if callable(v)})
    mapping = importlib.import_module("transformers.modeling_utils").AttentionInterface._global_mapping
    found.update({f"AttentionInterface[{k!r}]": v for k, v in mapping.items()})
    return found


def _changed(before: dict[str, object]) -> list[str]:
    after = _functions()
    return sorted(k for k in before.keys() | after.keys() if before.get(k) is not after.get(k))


def _scenario() -> dict:
    """Run in a fresh interpreter: a second Llama made before and one made after train() calls of a first one."""
    import torch
    from tiny_hf import token_data
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=48, max_position_embeddings=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        model.config._attn_implementation = "sdpa"  # the attention function the vmap patch replaces
        return model.eval()

    ids = torch.tensor([[3, 5, 7, 11, 13, 17], [19, 23, 29, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])

    def outputs(model):
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=mask).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = model(input_ids=ids, attention_mask=mask).logits
        return plain, autocast

    fresh = _functions()  # before Opake is imported
    before = llama()
    expected = outputs(before)

    from transformers import TrainerCallback

    from opake_torch.patches import applied_patches, performance
    from opake_torch.transformers import DPTrainer, TrainingArguments

    facts = {"changed_by_import": _changed(fresh), "applied_after_import": list(applied_patches())}

    class Watch(TrainerCallback):
        def __init__(self, fail: bool) -> None:
            self.fail, self.seen = fail, []

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.append(list(applied_patches()))
            self.cudnn = torch.backends.cuda.cudnn_sdp_enabled()
            if self.fail:
                raise RuntimeError("stop here")

    def train(name: str, *, fail: bool = False, **extra) -> dict:
        model = llama().train()
        args = TrainingArguments(
            str(Path(os.environ["OPAKE_TEST_DIR"]) / name), per_device_train_batch_size=6, max_steps=2,
            privacy_noise_multiplier=1.0, clipping_norm=0.1, disable_tqdm=True, save_strategy="no",
            report_to="none", use_cpu=True, privacy_noise_seed=0, bf16=True, **extra,
        )  # fmt: skip
        watch = Watch(fail)
        trainer = DPTrainer(model, args, train_dataset=token_data(24), callbacks=[watch])
        error = None
        try:
            trainer.train()
        except RuntimeError as exc:
            error = str(exc)
        after = llama()
        return {
            "error": error,
            "during": watch.seen[0],
            "cudnn_attention_during": watch.cudnn,
            "cudnn_attention_after": torch.backends.cuda.cudnn_sdp_enabled(),
            "applied_after": list(applied_patches()),
            "changed": _changed(fresh),
            "trained_model_patches": list(applied_patches(model)),
            "other_model_patches": list(applied_patches(before)) + list(applied_patches(after)),
            "before_same": all(torch.equal(a, b) for a, b in zip(outputs(before), expected, strict=True)),
            "after_same": all(torch.equal(a, b) for a, b in zip(outputs(after), expected, strict=True)),
        }

    facts["plain"] = train("plain")
    facts["failing"] = train("failing", fail=True)
    performance.available = lambda: True  # the kernels forced on: on CPU they run their torch references
    facts["kernels"] = train("kernels", use_performance_kernels=True)
    return facts


@pytest.mark.slow
def test_training_one_model_leaves_other_models_unpatched(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "support"), str(ROOT)])}
    env["OPAKE_TEST_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["changed_by_import"] == [] and facts["applied_after_import"] == []
    vmap = ["transformers.masking_utils.is_tracing", "transformers.modeling_utils.AttentionInterface['sdpa']"]
    rope = "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"
    for run in ("plain", "failing", "kernels"):
        seen = facts[run]
        assert seen["error"] == ("stop here" if run == "failing" else None), run
        assert set(vmap) <= set(seen["during"]), run  # applied while training
        assert (rope in seen["during"]) == (run == "kernels"), run
        assert "torch.backends.cuda.enable_cudnn_sdp" in seen["during"], run  # SDPA's cuDNN backend off, and back
        assert seen["cudnn_attention_during"] is False and seen["cudnn_attention_after"] is True, run
        assert seen["applied_after"] == [], run  # and undone after, also when train() raised
        assert seen["changed"] == [], run  # the family's and transformers' functions are the originals
        assert seen["other_model_patches"] == [], run
        assert seen["before_same"] and seen["after_same"], run  # bitwise the outputs of a fresh process
    assert {"activation", "rms_norm"} <= set(facts["kernels"]["trained_model_patches"])  # its own, per instance


# --- the import loop -------------------------------------------------------------------------------------------------


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(module imported, at module level)`` for every import statement of the file, at any depth."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
    return found


def test_patches_never_import_the_trainer_layer():
    files = sorted((ROOT / "opake_torch" / "patches").rglob("*.py"))
    assert len(files) > 10
    for path in files:
        for module, _ in _imports(path):
            assert not module.startswith("opake_torch.transformers"), f"{path.name} imports {module}"


def test_loss_and_model_setup_import_opake_at_module_level_only():
    for name in ("loss.py", "model_setup.py"):
        inner = [m for m, top in _imports(ROOT / "opake_torch" / "transformers" / name) if not top]
        assert not [m for m in inner if m.startswith("opake_")], f"{name}: function-level imports {inner}"


if __name__ == "__main__":
    print(json.dumps(_scenario()))
