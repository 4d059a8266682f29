"""`nonstop ls|verify|inspect|export URL`: the command line on a remote tier,
run by the `nonstop` executable (no network code) as `PY -m
nonstop._remote_cli CMD URL ...` with the arguments it parsed and checked
(tools/remote_cli.h RemoteCall); docs/TIERS.md "The command line on a
remote URL" (the options in NONSTOP_REMOTE_OPTIONS, why, the exit codes).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from . import _ext
from . import _remote
from .errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError

EXIT_DAMAGED, EXIT_USAGE = 1, 2
_LS_KEYS = ("step", "counter", "where", "path", "state", "reason", "time", "bytes", "metrics",
            "tiers", "job")


def _options() -> dict:
    try:
        opts = json.loads(os.environ.get("NONSTOP_REMOTE_OPTIONS") or "{}")
    except ValueError:
        raise CheckpointMismatchError("NONSTOP_REMOTE_OPTIONS is not JSON") from None
    if not isinstance(opts, dict):
        raise CheckpointMismatchError("NONSTOP_REMOTE_OPTIONS must be a JSON object")
    return opts


def _run(*args) -> int:
    """`nonstop ARGS...` (this executable, on a downloaded directory)."""
    cli = os.environ.get("NONSTOP_CLI") or shutil.which("nonstop")
    if not cli:
        raise CheckpointMismatchError("cannot find the nonstop executable (set NONSTOP_CLI)")
    sys.stdout.flush()
    return subprocess.call([cli, *args])


def main(argv=None) -> int:
    # CMD URL STEP RANK JSON EXPORT-ARGS...: as the executable parsed and
    # checked them (tools/remote_cli.h RemoteCall); "" for one not given.
    cmd, url, step, rank, as_json, *args = sys.argv[1:] if argv is None else argv
    step = int(step) if step else None
    try:
        store = _remote.open_store(url, _options())
        tier = _ext.core().RemoteTier(store)
        if cmd == "ls":  # nonstop.list()'s rows
            rows = tier.rows(int(rank))
            if as_json:  # the keys of a local `nonstop ls --json` (tools/manage_cmds.cc), and time
                print(json.dumps([dict({k: r[k] for k in _LS_KEYS}, commit_unix_ns=int(
                    r["time"] * 1e9) if r["time"] else 0) for r in rows], indent=2))
            else:  # C++: a local ls's columns
                print(_ext.core().remote_ls_text(rows, int(rank), url), end="")
            return 0
        if cmd == "verify":
            # The newest committed step (or --step): every rank's part
            # downloaded and checked, then `nonstop verify` on them. No
            # fallback: a damaged step is reported as damaged.
            s, marker = tier.candidates(step)[0]  # the planner's (C++)
            with _remote.temp_dir() as tmp:
                d = tier.fetch_all(s, tmp)  # damaged: exit 1 below
                print(f"{store.url}/{_ext.core().remote_layout.step_dir(s)}: committed, "
                      f"{marker['world_size']} rank(s) downloaded, every part crc32 matches "
                      f"its manifest", flush=True)
                return _run("verify", d, "--step", str(s))
        if cmd == "export":
            # The newest committed step that downloads intact (or --step),
            # every rank's part, exported as a local directory's with `args`
            # (-o, --format, --include, --strip). Which step, and the
            # fallback past a damaged one: C++ (RemoteTier.export).
            with _remote.temp_dir() as tmp:
                return tier.export(step, tmp,
                                   lambda s, d: _run("export", d, "--step", str(s), *args))
        rows, text = tier.inspect()  # nothing is downloaded but markers
        print(json.dumps({"url": store.url, "format": _ext.core().remote_layout.FORMAT,
                          "steps": rows}, indent=1) + "\n" if as_json else text, end="")
        return 0
    except CorruptCheckpointError as err:
        print(f"nonstop {cmd}: {err}", file=sys.stderr)
        return EXIT_DAMAGED
    except (CheckpointError, OSError) as err:
        print(f"nonstop {cmd}: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
