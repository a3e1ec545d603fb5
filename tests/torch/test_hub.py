"""What an upload may contain, checked on the file list (there is no network in tests)."""

from __future__ import annotations

from opake_torch.hub import publishable_files, strip_private_state

LAYOUT = [
    "config.json",
    "model.safetensors",
    "accountant.json",
    "tokenizer.json",
    "runs/log.jsonl",
    "runs/events.out.tfevents.1",
    "checkpoint-10/model.safetensors",
    "checkpoint-10/dp_state.json",
    "dp_state.json",
    "dp_state.safetensors",
    "dp_optimizer.safetensors",
    "dp_state.pt",
    "rng_state_0.pth",
    "trainer_state.json",
    "training_args.json",
    ".checkpoint-20.partial-ab12/model.safetensors",
    "_private_notes.txt",
    "nested/runs_like_name.txt",
]


def _make(tmp_path):
    for name in LAYOUT:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    return tmp_path


def test_publishable_files_leave_out_runs_keys_and_checkpoints(tmp_path):
    files = publishable_files(_make(tmp_path))
    assert files == [
        "accountant.json",
        "config.json",
        "model.safetensors",
        "nested/runs_like_name.txt",
        "tokenizer.json",
    ]


def test_strip_private_state_removes_exactly_the_rest(tmp_path):
    folder = _make(tmp_path)
    removed = strip_private_state(folder)
    assert sorted(removed) == sorted(set(LAYOUT) - set(publishable_files(folder)))
    remaining = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert remaining == publishable_files(folder)
    assert not (folder / "runs").exists() and not (folder / "checkpoint-10").exists()
