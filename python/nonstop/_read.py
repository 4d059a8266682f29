"""Reading a checkpoint of this package's format: which files a job
directory holds (check_directory, readers), its metadata (decode_meta) and
its tensors, read through the C++ restore path straight into their
destinations (read_tensors). The one reading helper for the restore, the
exports, the distributed reshard and the remote tier; below all of them."""
from __future__ import annotations

import os
import re
from typing import Optional

import numpy as np
import torch

from . import _ext, _state
from .errors import (CheckpointMismatchError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompatibleCheckpointError)

FORMAT = "nonstop.torch/1"
RANK_FILE = re.compile(r"^rank-(\d{5})\.nsck$")


def readers(path: str):
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    ranks = sorted(int(m.group(1)) for m in map(RANK_FILE.match, os.listdir(path)) if m)
    if not ranks:
        raise CheckpointNotFoundError(f"no nonstop checkpoint in {path}")
    readers = [_ext.core().Reader(path, rank=r, verify_data=True) for r in ranks]
    world = readers[0].geometry["world_size"]
    if ranks != list(range(world)):
        raise IncompatibleCheckpointError(
            f"{path} holds rank files {ranks} of a job of world size {world}: every rank file "
            f"is needed (copy the ranks' local directories together)")
    return readers


def step_key(meta: dict) -> tuple:
    return int(meta.get("step", -1)), int(meta.get("dist", {}).get("lineage", 0))


def chosen(path: str, sel, rank: int, reader=None) -> tuple:
    """(Reader, index) of the planner's choice `sel` (a JobDir selection)
    for `rank` of `path`: `reader` (the rank's slot file) unless it is a kept
    copy (keep/step-N/rank-R.nsck), found again by its counter."""
    where = os.path.dirname(sel.where)
    if reader is None or where:
        reader = _ext.core().Reader(os.path.join(path, where), rank=rank, verify_data=False)
    idx = next((i for i, c in enumerate(reader.checkpoints)
                if c["committed"] and c["counter"] == sel.counter), None)
    if idx is None:
        raise CorruptCheckpointError(
            f"checkpoint step {sel.step} of rank {rank} in {path} changed while it was read")
    return reader, idx


def refuse_replayed(meta, what: str) -> None:
    """An export of a checkpoint whose parts restore() replays is refused."""
    if isinstance(meta, dict) and "multistep_plan" in meta:  # parts at their own versions
        raise CheckpointMismatchError(
            f"{what} was written by mode='multistep' with replay='torch': its optimizer's "
            f"tensors reach that step only when restore() replays them; restore it and save "
            f"with mode='concurrent' to export")



def check_directory(path: str, rank: int, world_size: Optional[int], must_exist: bool) -> bool:
    """Checks that `path` is a nonstop directory (or may become one).

    Returns True when it holds this rank's slot file. Raises a one-line
    error for a missing (when must_exist), foreign or other-world-size
    directory.
    """
    if not os.path.exists(path):
        if must_exist:
            raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
        return False
    if not os.path.isdir(path):
        raise IncompatibleCheckpointError(f"{path} is a file, not a checkpoint directory")
    names = sorted(os.listdir(path))
    ranks = sorted(int(m.group(1)) for m in map(RANK_FILE.match, names) if m)
    if not ranks:
        # world-W/: rank files of another world size, set aside for resharding;
        # rank-R.nsck.tmp: a slot file being created (a kill left it; the
        # engine deletes it on open)
        others = [n for n in names if not n.startswith(".")
                  and not re.match(r"(world-\d+|agreed-rank-\d{5}\.json|rank-\d{5}\.nsck\.tmp|remote|peer)$", n)]
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise IncompatibleCheckpointError(
                f"{path} is not a nonstop checkpoint directory (it holds {shown}); "
                f"use an empty or new directory")
        if must_exist:
            raise CheckpointNotFoundError(f"no nonstop checkpoint in {path} (directory is empty)")
        return False
    if world_size is not None and ranks[-1] >= world_size:
        raise IncompatibleCheckpointError(
            f"{path} was written by a job of world size {ranks[-1] + 1} or more; this job has "
            f"world size {world_size}: use the same world size or a new directory")
    if rank not in ranks:
        if must_exist:
            raise CheckpointNotFoundError(f"no nonstop checkpoint for rank {rank} in {path}")
        return False
    return True




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


def restore_threads() -> int:
    """Reader threads: NONSTOP_RESTORE_THREADS, else 4."""
    try:
        return max(1, int(os.environ.get("NONSTOP_RESTORE_THREADS", "4")))
    except ValueError:
        return 4


def restore_direct() -> bool:
    """Whether the restore reads what is not in the page cache with
    O_DIRECT through a queue of reads in flight (RestoreOptions::direct):
    on by default (faster cold than buffered reads on the quiet machine,
    docs/BENCHMARKS.md "Restore"); NONSTOP_RESTORE_DIRECT=0 turns it off."""
    return os.environ.get("NONSTOP_RESTORE_DIRECT", "1") != "0"


def destinations(specs: list, as_numpy: bool, live: Optional[dict]) -> tuple:
    """(name -> tensor, [(data pointer, nbytes)] in table order) for a
    checkpoint's tensors: the live tensor where one of the same name, shape
    and dtype is a contiguous tensor whose memory no other destination
    shares (tied weights: the second gets its own), else a new one. A spec
    that is None gets no tensor (destination (0, 0): verified, not kept).
    A live CUDA tensor (in a build with CUDA) is a destination too:
    (pointer, nbytes, device index, current stream), which the C++ restore
    path fills through pinned buffers and host-to-device copies
    (RestoreOptions::dst_devices, docs/CUDA.md "Restore into CUDA tensors")
    instead of a host tensor copied by load_state_dict afterwards."""
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
        if t is None:
            t = new_tensor(code, shape, nbytes, as_numpy)
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


def new_tensor(code: int, shape: list, nbytes: int, as_numpy: bool):
    if as_numpy:
        np_dtype = _state.NUMPY_DTYPES.get(code)
        return np.empty(shape, dtype=np_dtype) if np_dtype is not None else np.empty(
            nbytes, dtype=np.uint8)
    return torch.empty(shape, dtype=_state.torch_dtype(code))


def read_tensors(reader, idx: int, as_numpy: bool = False, live: Optional[dict] = None,
                 stats: Optional[dict] = None, names=None) -> dict:
    """Every tensor of checkpoint `idx` of an opened `_core.Reader` (a slot
    file, a keep copy, an archive, a memory-tier segment, a JobDir
    selection), by name, read through the C++ restore path
    (Reader.read_into: every crc chunk read and verified once, in parallel,
    without the GIL) instead of tensor by tensor. `live` (name -> tensor):
    where one of the same name, shape and dtype is a contiguous CPU tensor,
    the data lands straight in it (check everything before calling: the read
    overwrites it). `names` (a predicate on a tensor's name): only those are
    kept (the others are still verified). `stats`, when given, gets the
    read's sizes and time. The one helper for every Python reader."""
    info = reader.checkpoints[idx]
    specs = info["tensors"]
    if names is not None:
        specs = [s if names(s["name"]) else None for s in specs]
    tensors, dests = destinations(specs, as_numpy, live)
    read_into(reader, idx, dests, stats)
    return tensors


def read_into(reader, idx: int, dests: list, stats: Optional[dict] = None) -> None:
    """Checkpoint `idx` of `reader` into `dests` ([(pointer, nbytes)] in table order)."""
    got = reader.read_into(idx, dests, threads=restore_threads())
    if stats is not None:
        stats.update(got)


