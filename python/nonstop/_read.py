"""Reading a checkpoint of this package's format: which files a job
directory holds (check_directory, readers), its metadata (decode_meta) and
its tensors, read through the C++ restore path straight into their
destinations (read_tensors). The one reading helper for the restore, the
exports, the distributed reshard and the remote tier; below all of them."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from . import _ext, _state
from .errors import CorruptCheckpointError, IncompatibleCheckpointError

FORMAT = "nonstop.torch/1"


def readers(path: str):
    """A verifying Reader of every rank file of `path` (C++ JobDir::RankFiles
    lists them: a missing or empty directory is a CheckpointNotFoundError)."""
    ranks = _ext.core().rank_files(path)
    readers = [_ext.core().Reader(path, rank=r, verify_data=True) for r in ranks]
    world = readers[0].geometry["world_size"]
    if ranks != list(range(world)):
        raise IncompatibleCheckpointError(
            f"{path} holds rank files {ranks} of a job of world size {world}: every rank file "
            f"is needed (copy the ranks' local directories together)")
    return readers


def chosen(path: str, sel, rank: int, reader) -> tuple:
    """(Reader, index) of the planner's choice `sel` (a JobDir selection)
    for `rank` of `path`: `reader` (the rank's slot file) unless it is a kept
    copy (keep/step-N/rank-R.nsck), found again by its counter."""
    where = os.path.dirname(sel.where)
    if where:
        reader = _ext.core().Reader(os.path.join(path, where), rank=rank, verify_data=False)
    idx = next((i for i, c in enumerate(reader.checkpoints)
                if c["committed"] and c["counter"] == sel.counter), None)
    if idx is None:
        raise CorruptCheckpointError(
            f"checkpoint step {sel.step} of rank {rank} in {path} changed while it was read")
    return reader, idx


def check_directory(path: str, rank: int, world_size: Optional[int], must_exist: bool) -> bool:
    """Whether `path` holds this rank's slot file; one-line errors for a
    missing (when must_exist), foreign or other-world-size directory (C++
    JobDir::CheckDirectory)."""
    return _ext.core().check_directory(os.fspath(path), rank, world_size, must_exist)


def decode_meta(info: dict, where: str) -> dict:
    """The checkpoint's metadata, decoded from fixed types only; one-line
    CorruptCheckpointError / IncompatibleCheckpointError naming `where`."""
    try:
        meta = _state.loads(info["meta_json"])
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: step {info['step']}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise IncompatibleCheckpointError(
            f"{where}: step {info['step']} was not written by nonstop's PyTorch front end "
            f"(format {str(meta.get('format'))[:40] if isinstance(meta, dict) else None!r})")
    return meta


def destinations(specs: list, as_numpy: bool, live: Optional[dict]) -> tuple:
    """(name -> tensor, [(data pointer, nbytes)] in table order) for a
    checkpoint's tensors: the live tensor where one fits (_fits_live) and
    no earlier destination shares its memory (tied weights: the second gets
    its own), else a new one; a None spec: (0, 0), verified, not kept. A live
    CUDA tensor's is (pointer, nbytes, device, current stream) (docs/CUDA.md
    "Restore into CUDA tensors")."""
    tensors: dict = {}
    dests = []
    # Live tensors that fit, then those whose memory overlaps an earlier one's dropped.
    fit: dict = {}
    if live is not None:
        ranges = []
        for i, spec in enumerate(specs):
            t = None if spec is None else live.get(spec["name"])
            if t is not None and spec["nbytes"] and _fits_live(t, spec["dtype"], spec["shape"]):
                ranges.append((t.data_ptr(), t.data_ptr() + spec["nbytes"], i, t))
        ranges.sort(key=lambda r: (r[0], r[2]))
        reach = 0
        for begin, end, i, t in ranges:
            if begin >= reach:
                fit[i] = t
            reach = max(reach, end)
    for i, spec in enumerate(specs):
        if spec is None:  # not wanted: verified, not kept
            dests.append((0, 0))
            continue
        code, shape, nbytes = spec["dtype"], spec["shape"], spec["nbytes"]
        t = fit.get(i)
        if t is None and as_numpy:  # bytes where numpy has no such dtype
            np_dtype = _state.NUMPY_DTYPES.get(code)
            t = np.empty(shape, np_dtype) if np_dtype is not None else np.empty(nbytes, np.uint8)
        elif t is None:
            t = torch.empty(shape, dtype=_state.torch_dtype(code))
        tensors[spec["name"]] = t
        if not nbytes:
            dests.append((0, 0))
        elif not as_numpy and t.device.type == "cuda":
            dests.append((t.data_ptr(), nbytes, t.device.index,
                          torch.cuda.current_stream(t.device).cuda_stream))
        else:
            dests.append((t.ctypes.data if as_numpy else t.data_ptr(), nbytes))
    return tensors, dests


def _fits_live(t, code: int, shape: list) -> bool:
    """Whether the C++ restore path can write tensor `code`/`shape` into `t`:
    a plain contiguous tensor of that shape and dtype on the CPU, or on
    CUDA when this build has the CUDA copy engine."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter)
            and (t.device.type == "cpu"
                 or (t.device.type == "cuda" and _ext.core().built_with_cuda()))
            and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and list(t.shape) == list(shape) and _state.torch_dtype_code(t.dtype) == code)


def read_tensors(reader, idx: int, stats: Optional[dict] = None) -> dict:
    """Every tensor of checkpoint `idx` of an opened `_core.Reader` (or a
    JobDir selection), by name, in one verified read (read_into) into new
    tensors; `stats` gets its sizes and time."""
    tensors, dests = destinations(reader.checkpoints[idx]["tensors"], False, None)
    got = reader.read_into(idx, dests)
    if stats is not None:
        stats.update(got)
    return tensors
