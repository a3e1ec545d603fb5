"""`opake --version`: the installed distribution's version, with a fallback for an uninstalled checkout."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import opake_torch
from opake_torch.cli import main


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"opake {opake_torch.__version__}"


def test_version_is_the_installed_distributions_or_the_checkouts():
    try:
        expected = importlib.metadata.version("opake")
    except importlib.metadata.PackageNotFoundError:  # a checkout on the path: pyproject.toml's version
        expected = None
    assert opake_torch.__version__ == (expected or opake_torch._version())
    assert opake_torch.__version__ and opake_torch.__version__ != "0+unknown"


def test_version_without_distribution_metadata_falls_back(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    pyproject = Path(opake_torch.__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():  # a checkout: the version it declares
        assert opake_torch._version() == tomllib.loads(pyproject.read_text())["project"]["version"]
    else:
        assert opake_torch._version() == "0+unknown"


def _console_script() -> str | None:
    """The ``opake`` script of this interpreter's environment (next to it), else the one on ``PATH``."""
    beside = Path(sys.executable).with_name("opake")
    return str(beside) if beside.is_file() else shutil.which("opake")


@pytest.mark.skipif(_console_script() is None, reason="the opake console script is not installed")
def test_console_script_version():
    done = subprocess.run([_console_script(), "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"opake {opake_torch.__version__}"


def test_module_version_in_a_fresh_interpreter():
    code = "import opake_torch; print(opake_torch.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == opake_torch.__version__
