"""TRL's own example scripts (``trl/scripts/`` of the installed ``trl``) with only their ``from trl import`` lines
switched to Opake's module: what a user of those scripts changes."""

from __future__ import annotations

from pathlib import Path

SWITCH = ("from trl import ", "from opake_torch.transformers.trl import ")


def upstream(name: str) -> Path:
    """The installed ``trl/scripts/<name>.py``."""
    import trl

    return Path(trl.__file__).parent / "scripts" / f"{name}.py"


def switched(name: str) -> str:
    """The text of TRL's script ``name`` with every ``from trl import`` line switched to Opake's module."""
    return "".join(
        line.replace(*SWITCH) if line.lstrip().startswith(SWITCH[0]) else line
        for line in upstream(name).read_text().splitlines(keepends=True)
    )
