"""nonstop.export: one checkpoint as a safetensors file.

The data is read through the one verified read path (Reader.read_into, the
C++ restore: every crc chunk read and verified once, in parallel, without
the GIL) a window of tensors (about WINDOW_BYTES) at a time, so memory stays
bounded by the window or the largest tensor; this module writes the
safetensors header (JSON) and the bytes. A progress bar (_progress.py) is
shown for long exports.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from . import _progress, _state
from ._checkpointer import _core, _restore_threads, check_directory
from .errors import (CheckpointIOError, CheckpointMismatchError, CheckpointNotFoundError,
                     CorruptCheckpointError, IncompatibleCheckpointError)

# Bytes of stored tensors read per window (as `nonstop export` in C++ does).
WINDOW_BYTES = 256 << 20


def export(dir: str, out: str, step: Optional[int] = None, rank: int = 0,
           include: Optional[str] = None, progress: Optional[bool] = None) -> dict:
    """Writes checkpoint `step` (newest valid when None) of `rank` in `dir`
    to the safetensors file `out`. Tensor names are kept ('model/fc.weight');
    with include='model', only tensors under 'model/' are written, with that
    prefix removed, so the file loads into the model directly. The
    checkpoint's step and JSON metadata go into the safetensors metadata.
    progress: a tqdm bar on stderr (None: on a terminal, for 256 MiB or
    more; True: always; False: never; _progress.py).
    Returns {'step', 'tensors', 'bytes', 'path'}."""
    bar = _progress.Progress("nonstop export", progress)
    path = os.fspath(dir)
    check_directory(path, rank, None, must_exist=True)
    # The planner chooses (the job directory's selection): what load() and
    # restore() read; a step a rollback abandoned is refused as load() does.
    chosen = _core().JobDir.open_for_read(path).select(rank, step=step)
    if chosen is None:
        raise CheckpointNotFoundError(f"no committed checkpoint in {path}")
    reader = _core().Reader(os.path.join(path, os.path.dirname(chosen.where)), rank=rank,
                            verify_data=False)
    ckpts = reader.checkpoints
    found = [i for i, c in enumerate(ckpts) if c["committed"] and c["counter"] == chosen.counter]
    if not found:
        raise CorruptCheckpointError(
            f"checkpoint step {chosen.step} in {path} changed while it was exported")
    idx = found[0]
    info = ckpts[idx]
    # Tied weights are stored once; the file holds them under every name
    # (the bytes again), so that a strict load_state_dict finds each.
    index = {spec["name"]: ti for ti, spec in enumerate(info["tensors"])}
    named = [(spec["name"], ti) for ti, spec in enumerate(info["tensors"])]
    try:
        tree = _state.loads(info["meta_json"].decode("utf-8")).get("state", {})
    except Exception:  # no readable tree: the tensors by their stored names only
        tree = {}
    named += [(path, index[ref]) for path, ref in aliases(tree)
              if ref in index and path not in index]
    entries = []
    for name, ti in named:
        spec = info["tensors"][ti]
        if include is not None:
            if not name.startswith(include + "/"):
                continue
            name = name[len(include) + 1:]
        st = _state.SAFETENSORS_DTYPES.get(spec["dtype"])
        if st is None:
            raise CheckpointMismatchError(
                f"tensor {spec['name']!r} has dtype {_state.DTYPE_NAMES[spec['dtype']]}, "
                f"which safetensors cannot hold")
        entries.append((name, ti, spec, st))
    header, offset = {}, 0
    for name, _, spec, st in entries:
        header[name] = {"dtype": st, "shape": spec["shape"],
                        "data_offsets": [offset, offset + spec["nbytes"]]}
        offset += spec["nbytes"]
    header["__metadata__"] = {"nonstop.step": str(info["step"]),
                              "nonstop.counter": str(info["counter"]),
                              "nonstop.meta": info["meta_json"].decode("utf-8", "replace")}
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
        d = io(_core().Directory, parent)
        io(d.unlink, tmp_name, True)
        with io(d.create, tmp_name) as f:
            io(f.write, len(blob).to_bytes(8, "little"))
            io(f.write, blob)
            done = 0
            for window, buf, at in _windows(reader, idx, info, entries):
                for _name, ti, spec, _ in window:
                    if spec["nbytes"]:
                        io(f.write, memoryview(buf)[at[ti]:at[ti] + spec["nbytes"]])
                        done += spec["nbytes"]
                bar(done, offset)
            io(f.commit, name)
    finally:
        bar.close()
    return {"step": info["step"], "tensors": len(entries), "bytes": offset, "path": os.fspath(out)}


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
            if hasattr(reader, "read_into"):
                reader.read_into(idx, dests, threads=_restore_threads(), data_begin=lo,
                                 data_end=hi)
            else:  # tests/python/fake_core.py's Reader has only read_tensor
                for i, (ptr, n) in enumerate(dests):
                    if n:
                        reader.read_tensor(idx, i, ptr, n)
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
