"""Random number generator states: captured as plain JSON, restored exactly.

torch (CPU and every CUDA device), numpy's global generator and Python's
``random`` are saved with every checkpoint by default, so that a resumed run
draws the same numbers as an uninterrupted one.
"""
from __future__ import annotations

import random

import numpy as np

try:
    import torch
except ImportError:
    torch = None


def capture() -> dict:
    """The current RNG states as JSON-able data."""
    out = {"random": _to_json(random.getstate())}
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch is not None:
        out["torch"] = torch.get_rng_state().numpy().tobytes().hex()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return out


def restore(state: dict) -> None:
    """Sets the RNG states captured by capture(). Missing parts are left alone."""
    if "random" in state:
        random.setstate(_from_json(state["random"]))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if torch is not None and "torch" in state:
        torch.set_rng_state(torch.frombuffer(bytearray.fromhex(state["torch"]), dtype=torch.uint8))
    if torch is not None and state.get("cuda") and torch.cuda.is_available():
        states = [torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8) for h in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def _to_json(x):
    if isinstance(x, tuple):
        return {"t": [_to_json(v) for v in x]}
    return x


def _from_json(x):
    if isinstance(x, dict):
        return tuple(_from_json(v) for v in x["t"])
    return x
