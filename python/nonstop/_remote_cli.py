"""`nonstop ls|verify|inspect|export URL`: the command line on a remote tier
(docs/TIERS.md, "The command line on a remote URL").

The `nonstop` executable has no network code: given a URL (`s3://...`, any
scheme but file://) it replaces itself with

    PY -m nonstop._remote_cli {ls,verify,inspect,export} URL [options]

with NONSTOP_CLI set to its own path. This module lists the remote prefix
through the same transport and C++ tier as the remote tier (_remote.py,
nonstop._core.RemoteTier); the step is chosen by the planner
(RemoteTier.candidates: C++ RemoteCandidates); verify and export download the chosen step's parts
into a temporary directory through RemoteTier.fetch_all (size and every
part crc32 checked against the manifest while writing), then run the same `nonstop verify|export` on that
directory, so every chunk crc32c is checked by the same code and the output
is the same as for a local directory. The temporary directory is removed at
the end. inspect and ls list the remote steps without downloading them (ls
in the columns of a local `nonstop ls`; a plain directory used as a remote,
step-N directories and no slot file, is listed this way too).

Client options (endpoint, credentials, region) come from the environment
variable NONSTOP_REMOTE_OPTIONS, a JSON object with the keys of
`remote_options` (kept out of argv, where other users could read them).

Exit codes as the executable's: 0 ok, 1 damaged (a part or checkpoint fails
its checks), 2 usage (no such step, store unreachable, bad options).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from . import _ext
from . import _remote
from .errors import CheckpointError, CorruptCheckpointError

EXIT_DAMAGED, EXIT_USAGE = 1, 2


class _Fail(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _options() -> dict:
    raw = os.environ.get("NONSTOP_REMOTE_OPTIONS", "")
    if not raw:
        return {}
    try:
        opts = json.loads(raw)
    except ValueError:
        raise _Fail("NONSTOP_REMOTE_OPTIONS is not JSON", EXIT_USAGE) from None
    if not isinstance(opts, dict):
        raise _Fail("NONSTOP_REMOTE_OPTIONS must be a JSON object", EXIT_USAGE)
    return opts


def _cli() -> str:
    cli = os.environ.get("NONSTOP_CLI") or shutil.which("nonstop")
    if not cli:
        raise _Fail("cannot find the nonstop executable (set NONSTOP_CLI)", EXIT_USAGE)
    return cli


def _run(cmd: list) -> int:
    sys.stdout.flush()
    return subprocess.call(cmd)


def verify(store, step) -> int:
    """The newest committed step (or --step): every rank's part downloaded
    and checked, then `nonstop verify` on them. No fallback: a damaged step
    is reported as damaged."""
    s, marker = _ext.core().RemoteTier(store).candidates(step)[0]  # the planner's (C++)
    tmp = _remote.temp_dir()
    try:
        d = _ext.core().RemoteTier(store).fetch_all(s, tmp)  # damaged: main says so, exit 1
        print(f"{store.url}/{_ext.core().remote_layout.step_dir(s)}: committed, {marker['world_size']} "
              f"rank(s) downloaded, every part crc32 matches its manifest", flush=True)
        return _run([_cli(), "verify", d, "--step", str(s)])
    finally:
        _remote.remove_temp_dir(tmp)


def export(store, step, out: str, fmt: str, include=None, strip=None) -> int:
    """The newest committed step that downloads intact (or --step), every
    rank's part, exported as a local directory's (safetensors: one-rank
    checkpoints; dcp: every rank reassembled). Which step, and the fallback
    past a damaged one: C++ (RemoteTier.export)."""
    args = ["-o", out, "--format", fmt]
    for glob in include or ():  # the same filter as a local export's
        args += ["--include", glob]
    if strip:
        args.append(f"--strip={strip}")
    tmp = _remote.temp_dir()
    try:
        return _ext.core().RemoteTier(store).export(
            step, tmp, lambda s, d: _run([_cli(), "export", d, "--step", str(s)] + args))
    finally:
        _remote.remove_temp_dir(tmp)


def inspect(store, as_json: bool) -> int:
    """The remote steps: committed or not, ranks, objects and bytes (nothing
    is downloaded but the small COMMITTED markers; rows and text: C++)."""
    rows, text = _ext.core().RemoteTier(store).inspect()
    if as_json:
        print(json.dumps({"url": store.url, "format": _ext.core().remote_layout.FORMAT,
                          "steps": rows}, indent=1))
    else:
        print(text, end="")
    return 0


def ls(url: str, options: dict, rank: int, as_json: bool) -> int:
    """`nonstop ls URL`: one row per remote step, newest first."""
    rows = _remote.list_steps(url, options, rank)
    if as_json:
        # the columns of a local `nonstop ls --json` (tools/manage_cmds.cc), and "time"
        print(json.dumps([dict({k: r[k] for k in ("step", "counter", "where", "path", "state",
                                                  "reason", "time", "bytes", "metrics",
                                                  "tiers", "job")},
                               commit_unix_ns=int(r["time"] * 1e9) if r["time"] else 0)
                          for r in rows], indent=2))
        return 0
    print(_ext.core().remote_ls_text(rows, rank, url), end="")  # C++: a local ls's columns
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="nonstop", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("ls")
    lp.add_argument("url")
    lp.add_argument("--rank", type=int, default=0)
    lp.add_argument("--json", action="store_true")
    v = sub.add_parser("verify")
    v.add_argument("url")
    v.add_argument("--step", type=int)
    i = sub.add_parser("inspect")
    i.add_argument("url")
    i.add_argument("--json", action="store_true")
    e = sub.add_parser("export")
    e.add_argument("url")
    e.add_argument("--step", type=int)
    e.add_argument("-o", "--output", required=True)
    e.add_argument("--format", default="safetensors", choices=("safetensors", "dcp"))
    e.add_argument("--include", action="append", default=None,
                   help="export only tensors whose name matches this glob (repeatable)")
    e.add_argument("--strip", default=None, help="remove this prefix from the exported names")
    a = p.parse_args(argv)
    try:
        if a.cmd == "ls":
            return ls(a.url, _options(), a.rank, a.json)
        store = _remote.open_store(a.url, _options())
        if a.cmd == "verify":
            return verify(store, a.step)
        if a.cmd == "export":
            if (a.include or a.strip) and a.format == "dcp":
                raise _Fail("--include/--strip are for a safetensors export; --format dcp "
                            "exports every tensor", EXIT_USAGE)
            return export(store, a.step, a.output, a.format, a.include, a.strip)
        return inspect(store, a.json)
    except _Fail as f:
        print(f"nonstop {a.cmd}: {f}", file=sys.stderr)
        return f.code
    except CorruptCheckpointError as err:
        print(f"nonstop {a.cmd}: {err}", file=sys.stderr)
        return EXIT_DAMAGED
    except (CheckpointError, OSError) as err:
        print(f"nonstop {a.cmd}: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
