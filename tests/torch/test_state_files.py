"""State files round-trip every state the library builds, bit for bit, and refuse anything else."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import pickle
import struct
import types

import optree
import pytest
import torch
import torchopt

from opake_core import mf, optim, random
from opake_core.clipping import adaptive
from opake_core.errors import CheckpointError, InputTypeError
from opake_core.step import dp_ftrl, dp_sgd
from opake_core.tree import Noised, PerGroup, per_group
from opake_torch.transformers._parsing import OPTIMIZERS
from opake_torch.transformers.optimizer import build_optimizer

pytest.importorskip("safetensors")  # the adapter's hf extra

from safetensors.torch import save_file

from opake_torch import state_files
from opake_torch.state_files import load_tree, read_json, save_tree, sha256, write_json


def _params(rows: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(rows, 2, generator=gen), "b": torch.randn(2, generator=gen)}


def _optimizer(name: str, *, weight_decay: float = 0.0, schedule: str = "constant", warmup: int = 0):
    args = types.SimpleNamespace(
        optim=name,
        learning_rate=1e-2,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=weight_decay,
        optim_args={},
        warmup_steps=warmup,
        lr_scheduler=schedule,
        lr_scheduler_kwargs={},
    )
    return build_optimizer(args, 10)


def _updated_state(opt, params):
    gen = torch.Generator().manual_seed(1)
    grads = Noised({k: torch.randn(v.shape, generator=gen) for k, v in params.items()}, 1.0, 0.1)
    return opt.update(grads, opt.init(params), params=params)[1]


def _assert_same(a, b, where="tree"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif type(a) in (list, tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, tuple) or (dataclasses.is_dataclass(a) and not isinstance(a, PerGroup | random.Key)):
        names = a._fields if isinstance(a, tuple) else [f.name for f in dataclasses.fields(a)]
        for n in names:
            _assert_same(getattr(a, n), getattr(b, n), f"{where}.{n}")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), where
    else:
        assert a == b, where


def _round_trip(tmp_path, tree, template=None):
    path = tmp_path / "state.safetensors"
    digest = save_tree(path, tree)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() == sha256(path)
    back = load_tree(path, template=template, expected_sha256=digest)
    _assert_same(tree, back)
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]  # no temporary file left behind
    return back


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_trainer_optimizer_state_round_trips(tmp_path, name):
    params = _params()
    for weight_decay, schedule, warmup in ((0.0, "constant", 0), (0.1, "linear", 2), (0.1, "cosine", 0)):
        opt = _optimizer(name, weight_decay=weight_decay, schedule=schedule, warmup=warmup)
        state = _updated_state(opt, params)
        assert all(bool(t.ne(0).any()) for t in optree.tree_leaves(state) if t.numel())  # updated moments and counts
        _round_trip(tmp_path, state, template=opt.init(params))


def _loss(p, x, y):
    return ((x @ p["w"] + p["b"] - y) ** 2).sum()


def _batch():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)


@pytest.mark.parametrize("clipping_norm", [1.0, adaptive(1.0)], ids=["fixed", "adaptive"])
def test_dp_sgd_state_round_trips(tmp_path, clipping_norm):
    params, opt = _params(), optim.adam(1e-2)
    step_fn, fresh = dp_sgd(
        _loss,
        optimizer=opt,
        clipping_norm=clipping_norm,
        noise_multiplier=1.0,
        expected_batch_size=4,
        key=random.key(1),
    )
    _, opt_state, dp_state, _ = step_fn(params, opt.init(params), fresh, _batch())
    assert dp_state.step == 1
    _round_trip(
        tmp_path,
        {"step_state": dp_state, "opt_state": opt_state},
        template={"step_state": fresh, "opt_state": opt.init(params)},
    )


@pytest.mark.parametrize("clipping_norm", [1.0, "per_group"])
def test_dp_ftrl_state_round_trips(tmp_path, clipping_norm):
    params, opt = _params(), optim.momentum(1e-2)
    bound = per_group(params, {"w": 1.0}, fallback=0.5) if clipping_norm == "per_group" else clipping_norm
    step_fn, fresh = dp_ftrl(
        _loss,
        params=params,
        optimizer=opt,
        strategy=mf.band_mf(bands=2),
        n_steps=4,
        clipping_norm=bound,
        noise_multiplier=1.0,
        expected_batch_size=4,
        key=random.key(1),
    )
    _, _, dp_state, _ = step_fn(params, opt.init(params), fresh, _batch())
    assert dp_state.noise.step == 1 and dp_state.noise.buffers and dp_state.noise.sensitivity is not None
    back = _round_trip(tmp_path, dp_state, template=fresh)
    assert isinstance(back.noise.sensitivity, PerGroup if clipping_norm == "per_group" else float)


def test_builtin_leaves_round_trip_exactly(tmp_path):
    tree = {
        "version": 3,
        "big": 2**70,
        "floats": [0.1, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308],
        "flags": (True, False, None),
        "text": "ü\n\"'",
        "dtypes": [torch.bfloat16, torch.float8_e4m3fn, torch.complex64, torch.bool, torch.uint64],
        "key": random.key(7),
        "rng": torch.get_rng_state(),
        "views": [torch.arange(6.0)[1:3], torch.arange(6.0)[::2], torch.ones(2, 3).t()],
        "empty": {},
    }
    back = _round_trip(tmp_path, tree)
    assert back["rng"].dtype == torch.uint8 and back["views"][2].is_contiguous()


def test_shared_storage_is_saved_as_separate_tensors(tmp_path):
    base = torch.arange(4.0)
    back = _round_trip(tmp_path, [base, base, base[2:]])
    back[0][0] = 10.0
    assert back[1][0] == 0.0


def test_unknown_types_are_refused_at_save(tmp_path):
    params = _params()
    with pytest.raises(InputTypeError, match="ScaleByAdamState"):
        save_tree(tmp_path / "x.safetensors", torchopt.transform.scale_by_adam().init(params))
    with pytest.raises(InputTypeError, match="non-str keys"):
        save_tree(tmp_path / "x.safetensors", {1: torch.zeros(1)})
    with pytest.raises(InputTypeError, match=r"tree\['a'\]\[0\]"):
        save_tree(tmp_path / "x.safetensors", {"a": [object()]})
    assert list(tmp_path.iterdir()) == []


def _refused(path, *, match=None, **kwargs) -> str:
    with pytest.raises(CheckpointError, match=match) as info:  # CheckpointError or a subclass, nothing else
        load_tree(path, **kwargs)
    assert pathlib.Path(path).name in str(info.value)
    return str(info.value)


def test_template_mismatch_names_the_first_difference(tmp_path):
    params = _params()
    adam = _optimizer("adam")
    path = tmp_path / "opt.safetensors"
    save_tree(path, _updated_state(adam, params))
    _refused(path, template=_optimizer("sgd").init(params), match="tree has 3 items in the file, 2 expected")
    _refused(path, template=_optimizer("momentum").init(params), match=r"tree\[0\] is AdamState in the file, tuple")
    _refused(path, template=adam.init(_params(rows=4)), match=r"tree\[0\]\.mu\['w'\] is torch.float32 \[3, 2\]")
    _refused(path, template=adam.init({"w": params["w"]}), match=r"unexpected keys \['b'\]")
    _refused(path, template=adam.init({k: v.double() for k, v in params.items()}), match="float64")
    common = {"optimizer": adam, "noise_multiplier": 1.0, "expected_batch_size": 4, "key": random.key(0)}
    _, fixed = dp_sgd(_loss, clipping_norm=1.0, **common)
    _, adaptive_state = dp_sgd(_loss, clipping_norm=adaptive(), **common)
    save_tree(path, fixed)
    _refused(
        path, template=adaptive_state, match=r"tree\.clip is FixedClipState in the file, AdaptiveClipState expected"
    )


class _Touch:
    """Unpickling this calls ``Path.touch(marker)``: the code a crafted checkpoint would run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_a_pickle_payload_is_refused_without_running(tmp_path):
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Touch(control)))  # the payload is real: unpickling it runs code
    assert control.exists()
    marker = tmp_path / "marker"
    for name, dump in (("plain.pkl", pickle.dump), ("torch.pt", torch.save)):
        path = tmp_path / name
        with open(path, "wb") as handle:
            dump({"state": _Touch(marker)}, handle)
        _refused(path, match="not a readable safetensors file")
        _refused(path, expected_sha256=sha256(path))
        with pytest.raises(CheckpointError, match=name):
            read_json(path)
    assert not marker.exists()


def _crafted(path, tree_json: str, tensors=None, fmt="tree/1"):
    tensors = {"0": torch.zeros(2)} if tensors is None else tensors
    save_file(tensors, str(path), metadata={"opake.format": fmt, "opake.tree": tree_json})
    return path


@pytest.mark.parametrize("tag", ["os.system", "builtins.eval", "posix.system", "subprocess.Popen", "Tensor"])
def test_tags_off_the_allow_list_are_refused(tmp_path, tag):
    marker = tmp_path / "marker"
    payload = {"command": f"touch {marker}"}
    path = _crafted(tmp_path / "evil.safetensors", json.dumps(["tuple", [["tensor", "0"], [tag, payload]]]))
    _refused(path, match=f"unknown type tag '{tag}'")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        ("42", "must be a \\[tag, payload\\] pair"),
        ('{"tensor": "0"}', "must be a \\[tag, payload\\] pair"),
        ('["tensor", "0", 1]', "pair"),
        ("not json", "not valid JSON"),
        ('["float", NaN]', "not valid JSON"),
        ('["list", [["tensor", "0"], ["tensor", "1"]]]', "'1' is not in the file"),
        ('["list", [["tensor", "0"], ["tensor", "0"]]]', "referenced twice"),
        ('["none", null]', r"tensors \['0'\] that its tree does not reference"),
        ('["tuple", [["tensor", "0"], ["int", "3"]]]', "invalid 'int' node"),
        ('["tuple", [["tensor", "0"], ["int", true]]]', "invalid 'int' node"),
        ('["tuple", [["tensor", "0"], ["float", 1.5]]]', "invalid 'float' node"),
        ('["tuple", [["tensor", "0"], ["float", "one"]]]', "invalid 'float' node"),
        ('["tuple", [["tensor", "0"], ["dtype", "os"]]]', "invalid 'dtype' node"),
        ('["tuple", [["tensor", "0"], ["key", {"opake_key": "zz"}]]]', "invalid 'key' node"),
        ('["tuple", [["tensor", "0"], ["dict", [["a"]]]]]', "invalid 'dict' node"),
        ('["tuple", [["tensor", "0"], ["dict", [[1, ["none", null]]]]]]', "invalid 'dict' node"),
        ('["tuple", [["tensor", "0"], ["dict", [["a", ["none", null]], ["a", ["none", null]]]]]]', "key repeats"),
        ('["opake.LearningRateState", {"count": ["tensor", "0"], "extra": ["none", null]}]', "its fields are"),
        ('["opake.LearningRateState", [["tensor", "0"]]]', "invalid 'opake.LearningRateState'"),
        (
            '["tuple", [["tensor", "0"], ["opake.PerGroup", {"groups": ["tuple", []], "values": ["int", 1]}]]]',
            "PerGroup",
        ),
        ("[" * 100_000, "not valid JSON"),
        ('["list", [' * 450 + '["tensor", "0"]' + "]]" * 450, "nested too deeply"),
    ],
)
def test_invalid_tree_metadata_is_refused(tmp_path, tree, match):
    _refused(_crafted(tmp_path / "bad.safetensors", tree), match=match)


def test_files_without_tree_metadata_are_refused(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    _refused(tmp_path / "model.safetensors", match="not written by save_tree")
    _refused(
        _crafted(tmp_path / "future.safetensors", '["tensor", "0"]', fmt="tree/2"), match="not written by save_tree"
    )
    header = json.dumps({"__metadata__": [1, 2], "0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "list.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    _refused(tmp_path / "list.safetensors", match="not a readable safetensors file")


def _saved(tmp_path) -> tuple[pathlib.Path, bytes, int, str]:
    path = tmp_path / "state.safetensors"
    digest = save_tree(path, _updated_state(_optimizer("adamw", weight_decay=0.1), _params()))
    data = path.read_bytes()
    return path, data, 8 + struct.unpack("<Q", data[:8])[0], digest


def test_truncated_and_flipped_files_are_refused(tmp_path):
    path, data, header_end, digest = _saved(tmp_path)
    for cut in (0, 1, 7, 8, 20, header_end // 2, header_end - 1, header_end, header_end + 3, len(data) - 1):
        path.write_bytes(data[:cut])
        _refused(path)
    for position in (0, 3, 7, 8, 9, header_end // 3, header_end // 2, header_end - 2, header_end - 1):
        flipped = bytearray(data)
        flipped[position] ^= 0xFF
        path.write_bytes(bytes(flipped))
        _refused(path)
    flipped = bytearray(data)
    flipped[header_end + 5] ^= 0xFF  # tensor bytes: only the checksum notices
    path.write_bytes(bytes(flipped))
    load_tree(path)
    _refused(path, expected_sha256=digest, match=f"SHA-256 .* expected {digest}")


def test_missing_and_empty_files_are_refused(tmp_path):
    _refused(tmp_path / "absent.safetensors", match="missing")
    _refused(tmp_path, match="missing")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    _refused(tmp_path / "empty.safetensors", match="not a readable safetensors file")
    (tmp_path / "noise.safetensors").write_bytes(
        torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)).numpy().tobytes()
    )
    _refused(tmp_path / "noise.safetensors")


def test_json_round_trip_and_checksum(tmp_path):
    record = {"epsilon": 1.25, "steps": 10, "history": [0.1, None, True], "name": "ü"}
    path = tmp_path / "accountant.json"
    digest = write_json(path, record)
    assert digest == sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert read_json(path, expected_sha256=digest) == record
    with pytest.raises(InputTypeError, match="strict JSON"):
        write_json(path, {"epsilon": math.nan})
    with pytest.raises(InputTypeError, match="strict JSON"):
        write_json(path, {"key": random.key(0)})
    assert read_json(path) == record and [p.name for p in tmp_path.iterdir()] == ["accountant.json"]


def _json_refused(path, match=None, **kwargs):
    with pytest.raises(CheckpointError, match=match) as info:
        read_json(path, **kwargs)
    assert path.name in str(info.value)


def test_json_corruption_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    digest = write_json(path, {"a": [1, 2, 3], "b": "text"})
    data = path.read_bytes()
    _json_refused(path, expected_sha256="0" * 64, match="SHA-256")
    for cut in (0, 1, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        _json_refused(path, match="not valid JSON")
        _json_refused(path, expected_sha256=digest, match="SHA-256")
    for text in (b'{"a": NaN}', b'{"a": Infinity}', b"\xff\xfe{}", b"{" * 100_000):
        path.write_bytes(text)
        _json_refused(path)
    _json_refused(tmp_path / "absent.json", match="missing")
    path.write_bytes(data)
    monkeypatch.setattr(state_files, "MAX_JSON_BYTES", 8)
    _json_refused(path, match="too large")


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_json(path, {"old": 1})

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(state_files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"new": 2})
    monkeypatch.undo()
    assert read_json(path) == {"old": 1} and [p.name for p in tmp_path.iterdir()] == ["state.json"]
