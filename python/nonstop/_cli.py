"""The one-line result or error of a `python -m nonstop._...` entry the
command line runs (the exports)."""
from __future__ import annotations

import sys

from .errors import CheckpointMismatchError


def cli_run(call) -> int:
    """An export for a `python -m` entry the CLI runs: its result in one
    line, or its error in one line with the CLI's exit codes (2: the
    arguments, 1: anything else)."""
    try:
        r = call()
    except CheckpointMismatchError as e:
        print(f"nonstop export: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 -- one line, as the CLI does
        print(f"nonstop export: {e}", file=sys.stderr)
        return 1
    print(f"exported step {r['step']}: {r['tensors']} tensors, {r['bytes']} bytes to {r['path']}")
    return 0
