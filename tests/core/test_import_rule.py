"""The core never imports the adapter, Hugging Face libraries or torch.distributed."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import opake_core

BLOCKED = ["opake_torch", "transformers", "trl", "peft", "torch.distributed"]

SCRIPT = """
import importlib, sys
blocked = {blocked!r}

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError("blocked import: " + name)
        return None

# Third-party dependencies may use torch.distributed themselves (torchopt imports torch.distributed.rpc):
# load them first, then forget and block those modules, so that only our own imports are checked.
import torch, torchopt, optree, numpy, scipy, dp_accounting
for name in list(sys.modules):
    if any(name == b or name.startswith(b + ".") for b in blocked):
        del sys.modules[name]
sys.meta_path.insert(0, Blocker())
for module in {modules!r}:
    importlib.import_module(module)
print("ok")
"""


def test_core_imports_with_adapter_and_distributed_blocked():
    # every module at every depth (walk_packages recurses only when given the package prefix), private ones too:
    # a private module imported by nothing public would otherwise escape the rule
    modules = sorted(info.name for info in pkgutil.walk_packages(opake_core.__path__, prefix="opake_core."))
    assert {"opake_core.clipping.grad", "opake_core.mf.blt", "opake_core.mf._base"} <= set(modules)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=BLOCKED, modules=modules)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
