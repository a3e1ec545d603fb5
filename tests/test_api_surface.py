"""The public face: ``opake_core.__all__`` and ``opake_torch.__all__`` are exactly what docs/api.md documents."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest
from public_face import PACKAGES, documented, face

# Names of the face defined in a private module on purpose: the optimizer contract and ``apply_updates`` sit in
# helpers of ``opake_core.optim`` that every optimizer module shares, and that package re-exports them.
DELIBERATE = {"opake_core.optim.Optimizer", "opake_core.optim.apply_updates"}


def _face() -> dict:
    out: dict = {}
    for package in PACKAGES:
        out.update(face(package))
    return out


def test_docs_cover_exactly_the_face():
    exported = _face()
    shown = documented()
    exported_ids = {id(value) for value in exported.values()}
    shown_ids = {id(value) for value in shown.values()}
    undocumented = sorted(path for path, value in exported.items() if id(value) not in shown_ids)
    not_exported = sorted(path for path, value in shown.items() if id(value) not in exported_ids)
    assert not undocumented, f"in __all__ but not in docs/api.md: {undocumented}"
    assert not not_exported, f"in docs/api.md but not in the packages' __all__: {not_exported}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_resolves_and_is_listed(package):
    module = importlib.import_module(package)
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice"
    for name in module.__all__:
        assert getattr(module, name) is not None
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_no_name_of_the_face_comes_from_a_private_module():
    private = {}
    for path, value in _face().items():
        home = getattr(value, "__module__", None) if inspect.isfunction(value) or inspect.isclass(value) else None
        if home and any(part.startswith("_") for part in home.split(".")) and path not in DELIBERATE:
            private[path] = home
    assert not private, f"public names defined in private modules (re-export them deliberately or move them): {private}"


def test_importing_the_packages_loads_no_heavy_dependency():
    script = (
        "import sys, opake_core, opake_torch\n"
        "heavy = {'torch', 'scipy', 'dp_accounting', 'transformers', 'trl'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# Import the adapter as if ``transformers`` were not installed (a finder that refuses it the way Python does when it
# finds nothing): the arguments and configs still load, and a trainer names the extra to install.
WITHOUT_TRANSFORMERS = """
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
import opake_torch
assert opake_torch.TrainingArguments.__name__ == "TrainingArguments"
assert opake_torch.SFTConfig.__name__ == "SFTConfig"
for name in ("DPTrainer", "SFTTrainer", "DPOTrainer"):
    try:
        getattr(opake_torch, name)
    except ImportError as exc:
        print(name, exc)
    else:
        print(name, "imported")
"""


def test_a_trainer_without_transformers_names_the_extra():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["DPTrainer", "SFTTrainer", "DPOTrainer"]
    for line in lines:
        assert "'transformers'" in line and "pip install 'opake[hf]'" in line, line
