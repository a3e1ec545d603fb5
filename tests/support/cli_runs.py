"""Running the ``opake`` command line in a test: its one line of output, that line as JSON, or its refusal."""

from __future__ import annotations

import json

from opake_torch.cli import main


def cli_line(capsys, *argv: str) -> str:
    """The one line ``opake <argv>`` prints, which must exit 0."""
    assert main(list(argv)) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return out[0]


def cli_json(capsys, *argv: str) -> dict:
    """The JSON object of ``opake <argv>`` (``--json`` is passed by the caller)."""
    return json.loads(cli_line(capsys, *argv))


def cli_refused(capsys, *argv: str) -> str:
    """The error output of a refused command: exit status 2 (from ``main`` or from ``argparse``), no traceback."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert "error:" in err and "Traceback" not in err, err
    return err
