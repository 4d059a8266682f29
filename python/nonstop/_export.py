"""nonstop.export: one checkpoint as a safetensors file. A one-rank job's is
exported by C++ (_core.export_safetensors, what `nonstop export` runs: the
planner's choice, read verified a window of WINDOW_BYTES at a time without
the GIL, written through the Env seam); a multi-rank job's is reassembled
here with torch (_dcp) and written by the same C++ writer."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from . import _dcp, _ext, _progress, _state
from ._read import check_directory
from .errors import CheckpointMismatchError

# Bytes of stored tensors read per window (as `nonstop export` in C++ does).
WINDOW_BYTES = 256 << 20


def export(dir: str, out: str, step: Optional[int] = None, rank: Optional[int] = None,
           include=None, strip: Optional[str] = None, format: str = "safetensors",
           progress: Optional[bool] = None) -> dict:
    """nonstop.export (docs/PYTHON.md, "Inspecting and exporting"): checkpoint
    `step` (newest valid when None) of `dir` written to `out` as `nonstop
    export DIR -o OUT` does: format="safetensors" (one file, names kept;
    include= globs over them, fnmatch, none matching is a
    CheckpointMismatchError; strip= a prefix removed; a multi-rank job
    consolidated, _dcp.layout, rank= for a one-rank directory only) or
    format="dcp" (_dcp.export_dcp). progress: a tqdm bar on stderr (None:
    on a terminal for 256 MiB or more; True: always; False: never).
    Returns {'step', 'tensors', 'bytes', 'path'}."""
    if format == "dcp":
        if include is not None or strip is not None or rank is not None:
            raise ValueError(
                "format='dcp' exports every rank and tensor; drop include=/strip=/rank=")
        return _dcp.export_dcp(dir, out, step, progress=progress)
    if format != "safetensors":
        raise ValueError(f"format must be 'safetensors' or 'dcp', got {format!r}")
    pats = [include] if isinstance(include, str) else include
    if include is not None and (not isinstance(pats, (list, tuple)) or not pats or not all(
            isinstance(p, str) and p for p in pats)):
        raise CheckpointMismatchError(
            f"include must be a glob or a list of globs ('model/*'), got {include!r}")
    patterns = list(pats or [])
    what = f"include={patterns!r}"
    if strip is not None and not isinstance(strip, str):
        raise CheckpointMismatchError(f"strip must be a string prefix, got {strip!r}")
    bar = _progress.Progress("nonstop export", progress)
    path, out = os.fspath(dir), os.fspath(out)
    check_directory(path, rank or 0, None, must_exist=True)
    # C++ chooses (the planner: what load() and restore() read; a step a
    # rollback abandoned, or one restore() replays, is refused as load()
    # does), reads and writes; tied weights under every name.
    try:
        got = _ext.core().export_safetensors(path, out, step, rank or 0, patterns, what,
                                             strip or "", WINDOW_BYTES, progress=bar)
        if got["world_size"] > 1:
            if rank is not None:
                raise CheckpointMismatchError(
                    f"{path} is a {got['world_size']}-rank job: it is exported consolidated "
                    f"(every rank's pieces reassembled); drop rank=")
            # Reassembled with torch (_dcp.gather/layout, as the DCP export),
            # written by C++ (_core.write_safetensors: the names checked, through the Env seam).
            step, tensors, metas, shared = _dcp.gather(path, step, progress=bar)
            named = _dcp.named(_dcp.layout(tensors, metas, shared))
            picked = _ext.core().export_names([n for n, _ in named], patterns, what,
                                              strip or "", f"step {step} of {path}")
            chosen = [(n, named[i][1].detach().contiguous()) for n, i in picked]
            got = {"step": step, "tensors": len(chosen), "bytes": _ext.core().write_safetensors(
                out, [(n, _state.torch_dtype_code(t.dtype), list(t.shape), t.data_ptr(),
                       t.numel() * t.element_size()) for n, t in chosen],
                [("nonstop.step", str(step)), ("nonstop.world_size", str(len(metas)))])}
    finally:
        bar.close()
    return {"step": got["step"], "tensors": got["tensors"], "bytes": got["bytes"], "path": out}


def main(argv=None) -> int:
    """`python -m nonstop._export DIR -o OUT`: `nonstop export` of a multi-rank job."""
    p = argparse.ArgumentParser(prog="python -m nonstop._export",
                                description="export a nonstop checkpoint as safetensors")
    p.add_argument("dir")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--include", action="append", default=None)
    p.add_argument("--strip", default=None)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    a = p.parse_args(argv)
    return _dcp.cli_run(lambda: export(a.dir, a.output, a.step, include=a.include,
                                       strip=a.strip, progress=a.progress))


if __name__ == "__main__":
    sys.exit(main())
