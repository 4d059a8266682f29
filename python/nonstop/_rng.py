"""Random number generator states: captured as plain JSON, restored exactly.

torch (CPU and every CUDA device), numpy's global generator and Python's
``random`` are saved with every checkpoint by default, so that a resumed run
draws the same numbers as an uninterrupted one.
"""
from __future__ import annotations

import random

import numpy as np

from .errors import CorruptCheckpointError

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


def prepare(state) -> list:
    """Checks an RNG record written by capture() without touching any
    generator: each part is loaded into a scratch generator of its kind.
    Returns the setters that restore() runs; raises a one-line
    CorruptCheckpointError naming the bad part."""
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"RNG record is a {type(state).__name__}, not a dict")
    setters = []
    part = None
    try:
        if "random" in state:
            part = "random"
            value = _from_json(state["random"])
            random.Random().setstate(value)  # checks version, size and values
            setters.append(lambda: random.setstate(value))
        if "numpy" in state:
            part = "numpy"
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np_state = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
            if kind != "MT19937" or np_state[1].shape != (624,):
                raise ValueError(f"{kind!r} with {np_state[1].size} keys is not MT19937's 624")
            np.random.RandomState().set_state(np_state)
            setters.append(lambda: np.random.set_state(np_state))
        if torch is not None and "torch" in state:
            part = "torch"
            t = _bytes_tensor(state["torch"])
            torch.Generator().set_state(t)
            setters.append(lambda: torch.set_rng_state(t))
        if torch is not None and state.get("cuda") and torch.cuda.is_available():
            part = "cuda"
            if not isinstance(state["cuda"], list):
                raise ValueError("not a list")
            states = [_bytes_tensor(h) for h in state["cuda"]]
            if len(states) == torch.cuda.device_count():
                setters.append(lambda: torch.cuda.set_rng_state_all(states))
    except Exception as e:  # noqa: BLE001 -- any malformed part: one line
        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise CorruptCheckpointError(f"RNG record {part!r} is malformed: {msg}") from None
    return setters


def restore(state) -> None:
    """Sets the RNG states captured by capture(). Missing parts are left
    alone; a malformed record raises before any generator is changed."""
    for setter in prepare(state):
        setter()


def _bytes_tensor(h):
    if not isinstance(h, str) or len(h) > (1 << 20):
        raise ValueError("not a hex string")
    return torch.frombuffer(bytearray.fromhex(h), dtype=torch.uint8)


def _to_json(x):
    if isinstance(x, tuple):
        return {"t": [_to_json(v) for v in x]}
    return x


def _from_json(x):
    if isinstance(x, dict):
        if set(x) != {"t"} or not isinstance(x["t"], list):
            raise ValueError("a tuple must be {'t': [...]}")
        return tuple(_from_json(v) for v in x["t"])
    return x
