"""State <-> (named tensors, JSON): how a state dict becomes a checkpoint.

A state tree (dicts, lists, tuples, tensors and plain values) is split into
a list of named tensors, which the engine stores as raw bytes, and a JSON
document that records the tree with each tensor replaced by a reference to
its name. Nothing is pickled. Every plain value round-trips exactly:

- ``None``, ``bool``, ``str`` and ``int`` (any size) are JSON values;
- finite floats are written with ``repr`` (Python's ``json`` does), which
  round-trips bitwise; ``nan``, ``inf``, ``-inf`` are tagged with their bits;
- tuples, dicts with non-string keys, ``torch.dtype``, ``torch.device``,
  numpy arrays and numpy scalars are tagged objects (``{"__tuple__": ...}``).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import torch
except ImportError:  # nonstop.load and export work without torch
    torch = None

# DType numbers of include/nonstop/types.h (part of the on-disk format).
DTYPE_CODES = {
    "uint8": 0, "int8": 1, "int16": 2, "int32": 3, "int64": 4, "float16": 5,
    "bfloat16": 6, "float32": 7, "float64": 8, "bool": 9, "complex64": 10,
    "complex128": 11, "uint16": 12, "uint32": 13, "uint64": 14,
    "float8_e4m3fn": 15, "float8_e5m2": 16,
}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
# Safetensors spellings, by code.
SAFETENSORS_DTYPES = {
    0: "U8", 1: "I8", 2: "I16", 3: "I32", 4: "I64", 5: "F16", 6: "BF16", 7: "F32",
    8: "F64", 9: "BOOL", 10: "C64", 12: "U16", 13: "U32", 14: "U64",
    15: "F8_E4M3", 16: "F8_E5M2",
}
# numpy dtype (for nonstop.load without torch); None where numpy has none.
NUMPY_DTYPES = {
    0: np.uint8, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.int64, 5: np.float16,
    6: None, 7: np.float32, 8: np.float64, 9: np.bool_, 10: np.complex64,
    11: np.complex128, 12: np.uint16, 13: np.uint32, 14: np.uint64, 15: None, 16: None,
}
ITEMSIZE = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 2, 7: 4, 8: 8, 9: 1, 10: 8, 11: 16,
            12: 2, 13: 4, 14: 8, 15: 1, 16: 1}

_RESERVED = "__"


def torch_dtype_code(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise TypeError(f"nonstop cannot checkpoint tensors of dtype {name}") from None


def torch_dtype(code: int):
    return getattr(torch, DTYPE_NAMES[code])


def is_tensor(x) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


@dataclass
class Flat:
    """One state tree, split: the tensors by name, and the JSON-able tree."""
    tensors: dict = field(default_factory=dict)  # name -> torch.Tensor, in order
    tree: Any = None


def flatten(obj, prefix: str, out: dict, where: str = "state"):
    """Returns the JSON-able form of `obj`, adding its tensors to `out`.

    Tensor names are the path of keys joined by '/', under `prefix`. The same
    tensor (same storage, offset, dtype and shape) seen twice, as tied
    weights are, is stored once and referenced twice.
    """
    seen = {_tensor_key(t): n for n, t in out.items() if is_tensor(t) and t.numel() > 0}
    return _flatten(obj, prefix, out, where, seen)


def _flatten(obj, prefix: str, out: dict, where: str, seen: dict):
    if isinstance(obj, np.generic):  # before float: np.float64 is a float
        return {"__npscalar__": [obj.dtype.str, _flatten(obj.item(), prefix, out, where, seen)]}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)  # IntEnum and friends become plain ints
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        # nan, inf, -inf: by their bits (a NaN's sign and payload included).
        return {"__float__": struct.pack("<d", obj).hex()}
    if is_tensor(obj):
        return {"__tensor__": _add_tensor(obj, prefix, out, seen)}
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return {"__ndarray__": _add_tensor(torch.from_numpy(arr) if torch is not None else arr,
                                           prefix, out, seen)}
    if torch is not None and isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).replace("torch.", "")}
    if torch is not None and isinstance(obj, torch.device):
        return {"__device__": str(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, f"{prefix}/{i}", out, f"{where}[{i}]", seen)
                              for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{prefix}/{i}", out, f"{where}[{i}]", seen)
                for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith(_RESERVED) for k in obj):
            return {k: _flatten(v, f"{prefix}/{k}", out, f"{where}[{k!r}]", seen)
                    for k, v in obj.items()}
        return {"__dict__": [[_flatten(k, f"{prefix}/key{i}", out, where, seen),
                              _flatten(v, f"{prefix}/{k}", out, f"{where}[{k!r}]", seen)]
                             for i, (k, v) in enumerate(obj.items())]}
    raise TypeError(f"cannot checkpoint {where}: {type(obj).__name__} is neither a tensor "
                    f"nor JSON data; give it state_dict()/load_state_dict()")


def _tensor_key(t):
    # A DTensor's (FSDP2's) data_ptr() is 0: key it by its local shard's memory.
    local = getattr(t, "_local_tensor", None)
    ptr = t.data_ptr() if local is None else local.data_ptr() if local.numel() else id(t)
    return (ptr, t.dtype, tuple(t.shape), t.stride(), str(t.device))


def _add_tensor(t, name: str, out: dict, seen: dict) -> str:
    shareable = is_tensor(t) and t.numel() > 0
    if shareable:
        # Tied weights: the same memory under a second name is stored once.
        key = _tensor_key(t)
        if key in seen:
            return seen[key]
    base, n = name, 1
    while name in out:
        n += 1
        name = f"{base}#{n}"
    out[name] = t
    if shareable:
        seen[key] = name
    return name


def unflatten(tree, tensors: dict, as_numpy: bool = False):
    """The inverse of flatten: rebuilds the state with tensors from `tensors`."""
    if isinstance(tree, list):
        return [unflatten(v, tensors, as_numpy) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        (tag, val), = tree.items()
        if tag == "__tensor__":
            return tensors[val]
        if tag == "__ndarray__":
            t = tensors[val]
            return t if isinstance(t, np.ndarray) else t.numpy()
        if tag == "__float__":
            return struct.unpack("<d", bytes.fromhex(val))[0]
        if tag == "__tuple__":
            return tuple(unflatten(v, tensors, as_numpy) for v in val)
        if tag == "__dict__":
            return {unflatten(k, tensors, as_numpy): unflatten(v, tensors, as_numpy)
                    for k, v in val}
        if tag == "__npscalar__":
            return np.dtype(val[0]).type(unflatten(val[1], tensors, as_numpy))
        if tag == "__dtype__":
            return getattr(torch, val) if torch is not None and not as_numpy else val
        if tag == "__device__":
            return torch.device(val) if torch is not None and not as_numpy else val
    return {k: unflatten(v, tensors, as_numpy) for k, v in tree.items()}


def dumps(tree) -> str:
    # allow_nan=False: non-finite floats are tagged by flatten, so a bare one
    # here is a bug, not data.
    return json.dumps(tree, allow_nan=False, separators=(",", ":"))


def loads(text: str):
    return json.loads(text)
