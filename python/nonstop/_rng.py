"""Random number generator states: captured as plain JSON, restored exactly.

torch (CPU and every CUDA device), numpy's global generator and Python's
``random`` are saved with every checkpoint by default, so that a resumed run
draws the same numbers as an uninterrupted one.
"""
from __future__ import annotations

import json
import random

import numpy as np

from . import _ext
from .errors import CorruptCheckpointError

try:
    import torch
except ImportError:
    torch = None


def capture() -> dict:
    """The current RNG states as JSON-able data."""
    version, mt, gauss = random.getstate()
    out = {"random": {"t": [version, {"t": list(mt)}, gauss]}}  # a tuple as {"t": [...]}
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch is not None:
        out["torch"] = torch.get_rng_state().numpy().tobytes().hex()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return out


def prepare(state) -> list:
    """Checks an RNG record written by capture() without touching any
    generator: its parts' shapes and values in C++ (export.h CheckRngRecord),
    torch's own state in a scratch generator. Returns the setters that
    restore() runs; raises a one-line CorruptCheckpointError naming the bad part."""
    _ext.core().check_rng_record(json.dumps(state))
    setters = []
    if "random" in state:
        version, mt, gauss = state["random"]["t"]
        value = (version, tuple(mt["t"]), gauss)
        setters.append(lambda: random.setstate(value))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np_state = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
        setters.append(lambda: np.random.set_state(np_state))
    if torch is not None and "torch" in state:
        t = _bytes_tensor(state["torch"])
        try:
            torch.Generator().set_state(t)  # torch checks its state's size and contents
        except (RuntimeError, ValueError) as e:
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise CorruptCheckpointError(f"RNG record 'torch' is malformed: {msg}") from None
        setters.append(lambda: torch.set_rng_state(t))
    if torch is not None and state.get("cuda") and torch.cuda.is_available():
        states = [_bytes_tensor(h) for h in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            setters.append(lambda: torch.cuda.set_rng_state_all(states))
    return setters


def restore(state) -> None:
    """Sets the RNG states captured by capture(). Missing parts are left
    alone; a malformed record raises before any generator is changed."""
    for setter in prepare(state):
        setter()


def _bytes_tensor(h: str):
    return torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8)
