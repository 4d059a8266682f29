"""nonstop.export: one checkpoint as a safetensors file.

The data is read through the one verified read path (Reader.read_into, the
C++ restore: every crc chunk read and verified once, in parallel, without
the GIL) a window of tensors (about WINDOW_BYTES) at a time, so memory stays
bounded by the window or the largest tensor; this module writes the
safetensors header (JSON) and the bytes. A progress bar (_progress.py) is
shown for long exports.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from typing import Optional

import numpy as np
import torch

from . import _dcp, _ext, _progress, _read, _state
from ._cli import cli_run
from ._read import check_directory, restore_threads
from .errors import (CheckpointIOError, CheckpointMismatchError, CheckpointNotFoundError,
                     IncompatibleCheckpointError)

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
    patterns = _patterns(include)
    if strip is not None and not isinstance(strip, str):
        raise CheckpointMismatchError(f"strip must be a string prefix, got {strip!r}")
    bar = _progress.Progress("nonstop export", progress)
    path = os.fspath(dir)
    check_directory(path, rank or 0, None, must_exist=True)
    world = _ext.core().Reader(path, rank=rank or 0, verify_data=False).geometry["world_size"]
    if world > 1:
        if rank is not None:
            raise CheckpointMismatchError(
                f"{path} is a {world}-rank job: it is exported consolidated (every rank's "
                f"pieces reassembled); drop rank=")
        return _export_consolidated(path, out, step, patterns, strip, bar)
    rank = 0 if rank is None else rank
    # The planner chooses (the job directory's selection): what load() and
    # restore() read; a step a rollback abandoned is refused as load() does.
    sel = _ext.core().JobDir.open_for_read(path).select(rank, step=step)
    if sel is None:
        raise CheckpointNotFoundError(f"no committed checkpoint in {path}")
    reader, idx = _read.chosen(path, sel, rank)
    info = reader.checkpoints[idx]
    # Tied weights are stored once; the file holds them under every name
    # (the bytes again), so that a strict load_state_dict finds each.
    index = {spec["name"]: ti for ti, spec in enumerate(info["tensors"])}
    named = [(spec["name"], ti) for ti, spec in enumerate(info["tensors"])]
    try:
        doc = _state.loads(info["meta_json"].decode("utf-8"))
        tree = doc.get("state", {})
    except Exception:  # no readable tree: the tensors by their stored names only
        doc, tree = {}, {}
    _read.refuse_replayed(doc, f"step {info['step']} of {path}")
    named += [(path, index[ref]) for path, ref in aliases(tree)
              if ref in index and path not in index]
    entries = []
    for name, ti in _selected(named, patterns, strip, f"step {info['step']} of {path}"):
        spec = info["tensors"][ti]
        entries.append((name, ti, spec, _safetensors_dtype(spec["name"], spec["dtype"])))

    def pieces():
        for window, buf, at in _windows(reader, idx, info, entries):
            for _name, ti, spec, _ in window:
                if spec["nbytes"]:
                    yield memoryview(buf)[at[ti]:at[ti] + spec["nbytes"]]

    meta = {"nonstop.step": str(info["step"]), "nonstop.counter": str(info["counter"]),
            "nonstop.meta": info["meta_json"].decode("utf-8", "replace")}
    return _write(out, [(name, st, spec["shape"], spec["nbytes"])
                        for name, _, spec, st in entries], meta, pieces(), bar, info["step"])


def _patterns(include) -> Optional[list]:
    if include is None:
        return None
    pats = [include] if isinstance(include, str) else include
    if not isinstance(pats, (list, tuple)) or not pats or not all(
            isinstance(p, str) and p for p in pats):
        raise CheckpointMismatchError(
            f"include must be a glob or a list of globs ('model/*'), got {include!r}")
    return list(pats)


def _selected(named, patterns: Optional[list], strip: Optional[str], what: str) -> list:
    """(name, item) of `named` whose name matches a pattern (all without
    patterns), `strip` removed; none matching is refused, as the CLI does."""
    out = [(n, x) for n, x in named
           if patterns is None or any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if patterns is not None and not out:
        raise CheckpointMismatchError(
            f"no tensor of {what} matches include={patterns!r} (globs over the stored names, "
            f"e.g. 'model/*'; `nonstop inspect` lists them)")
    if strip:
        out = [(n[len(strip):] if n.startswith(strip) else n, x) for n, x in out]
    return out


def _safetensors_dtype(name: str, code: int) -> str:
    st = _state.SAFETENSORS_DTYPES.get(code)
    if st is None:
        raise CheckpointMismatchError(
            f"tensor {name!r} has dtype {_state.DTYPE_NAMES[code]}, which safetensors cannot hold")
    return st


def _export_consolidated(path: str, out, step: Optional[int], patterns, strip, bar) -> dict:
    """A multi-rank job's checkpoint committed on every rank, reassembled
    (_dcp.gather/layout, as the DCP export) and written as safetensors."""

    try:
        got, tensors, metas, shared = _dcp.gather(path, step, progress=bar)
    except BaseException:
        bar.close()
        raise
    named = _dcp.named(_dcp.layout(tensors, metas, shared))
    chosen = [(n, t.detach().contiguous()) for n, t in
              _selected(named, patterns, strip, f"step {got} of {path}")]
    entries = [(n, _safetensors_dtype(n, _state.torch_dtype_code(t.dtype)), list(t.shape),
                t.numel() * t.element_size()) for n, t in chosen]
    pieces = (t.reshape(-1).view(torch.uint8).numpy().data for _, t in chosen if t.numel())
    meta = {"nonstop.step": str(got), "nonstop.world_size": str(len(metas))}
    return _write(out, entries, meta, pieces, _progress.Progress("nonstop export", False), got)


def _write(out, entries: list, meta: dict, pieces, bar, step: int) -> dict:
    """The safetensors file `out`: the header of `entries` (name, dtype,
    shape, nbytes) and `meta`, then the bytes `pieces` yields in order."""
    header, offset = {}, 0
    for name, st, shape, nbytes in entries:
        if name in header or name == "__metadata__":
            raise CheckpointMismatchError(f"two tensors would be written as {name!r} "
                                          f"(strip= made their names collide?)")
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = meta
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    out = os.fspath(out)
    parent, name = os.path.split(os.path.abspath(out))
    tmp_name = name + ".tmp"
    # Through the Env seam (_core.Directory): a leftover OUT.tmp (a crash, or
    # a planted link) is removed, never followed (unlink removes a link
    # itself); the temp is created O_EXCL|O_NOFOLLOW relative to the
    # directory fd, fsynced, renamed over OUT (a link there is refused), and
    # the directory fsynced. Any failure removes the temp. File errors are
    # named by the file the user asked for, never OUT.tmp; a damaged source
    # raises its own error.
    def io(fn, *args):
        try:
            return fn(*args)
        except (CheckpointIOError, CheckpointNotFoundError, IncompatibleCheckpointError) as e:
            why = str(e).replace(os.path.join(parent, tmp_name), out).replace(tmp_name, name)
            raise CheckpointIOError(f"cannot export to {out}: {why}") from None

    try:
        d = io(_ext.core().Directory, parent)
        io(d.unlink, tmp_name, True)
        with io(d.create, tmp_name) as f:
            io(f.write, len(blob).to_bytes(8, "little"))
            io(f.write, blob)
            done = 0
            for piece in pieces:
                io(f.write, piece)
                done += len(piece)
                bar(done, offset)
            io(f.commit, name)
    finally:
        bar.close()
    return {"step": step, "tensors": len(entries), "bytes": offset, "path": os.fspath(out)}


def _windows(reader, idx: int, info: dict, entries: list):
    """Yields (entries of one window, its buffer, stored tensor index ->
    offset in the buffer): consecutive entries whose distinct stored
    tensors hold about WINDOW_BYTES (at least one), read in one
    Reader.read_into over their byte range of the data region; a tied
    weight's second name reuses the bytes read once."""
    specs = info["tensors"]
    first = 0
    while first < len(entries):
        last, nbytes, at = first, 0, {}
        lo, hi = None, 0
        while last < len(entries):
            ti, spec = entries[last][1], entries[last][2]
            fresh = spec["nbytes"] and ti not in at
            if fresh and at and nbytes + spec["nbytes"] > WINDOW_BYTES:
                break
            if fresh:
                at[ti] = nbytes
                nbytes += spec["nbytes"]
                off = int(spec.get("data_offset", 0))
                lo = off if lo is None else min(lo, off)
                hi = max(hi, off + spec["nbytes"])
            last += 1
        buf = np.empty(nbytes, dtype=np.uint8)
        if at:
            base = buf.ctypes.data
            dests = [(base + at[i], specs[i]["nbytes"]) if i in at else (0, 0)
                     for i in range(len(specs))]
            reader.read_into(idx, dests, threads=restore_threads(), data_begin=lo, data_end=hi)
        yield entries[first:last], buf, at
        first = last


def aliases(tree) -> list:
    """(path, stored name) for each tensor of a state tree referred to
    under a path other than its stored name: the second name of a tied
    weight ('model/lm_head.weight' -> 'model/tok.weight'). Paths through
    plain string-keyed dicts and lists only (as tensor names are formed)."""
    out: list = []

    def walk(node, path, depth):
        if depth > _state.MAX_DEPTH:
            return
        if isinstance(node, dict):
            ref = node.get("__tensor__")
            if len(node) == 1 and isinstance(ref, str):
                if path != ref:
                    out.append((path, ref))
                return
            if any(not isinstance(k, str) or k.startswith("__") for k in node):
                return  # a tagged value: no tensor names through it
            for k, v in node.items():
                walk(v, f"{path}/{k}" if path else k, depth + 1)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}", depth + 1)

    walk(tree, "", 0)
    return out


def main(argv=None) -> int:
    """`python -m nonstop._export DIR -o OUT`: what `nonstop export` runs
    for a multi-rank directory (the consolidation is Python's)."""
    p = argparse.ArgumentParser(prog="python -m nonstop._export",
                                description="export a nonstop checkpoint as safetensors")
    p.add_argument("dir")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--include", action="append", default=None)
    p.add_argument("--strip", default=None)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    a = p.parse_args(argv)
    return cli_run(lambda: export(a.dir, a.output, a.step, include=a.include, strip=a.strip,
                                  progress=a.progress))


if __name__ == "__main__":
    sys.exit(main())
