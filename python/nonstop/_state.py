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
from typing import Optional

import numpy as np

from . import _ext
from .errors import CorruptCheckpointError

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
# numpy dtype (for nonstop.load without torch); None where numpy has none.
NUMPY_DTYPES = {
    0: np.uint8, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.int64, 5: np.float16,
    6: None, 7: np.float32, 8: np.float64, 9: np.bool_, 10: np.complex64,
    11: np.complex128, 12: np.uint16, 13: np.uint32, 14: np.uint64, 15: None, 16: None,
}

_RESERVED = "__"


def torch_dtype_code(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise TypeError(f"nonstop cannot checkpoint tensors of dtype {name}") from None


def torch_dtype(code: int):
    """torch.dtype of a dtype code of the on-disk format (a fixed table)."""
    name = DTYPE_NAMES.get(code) if isinstance(code, int) else None
    dt = torch_dtype_by_name(name)
    if dt is None:
        raise CorruptCheckpointError(f"unknown tensor dtype code {code!r}")
    return dt


def is_tensor(x) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def flatten(obj, prefix: str, out: dict, where: str = "state", seen: Optional[dict] = None):
    """Returns the JSON-able form of `obj`, adding its tensors to `out`.

    Tensor names are the path of keys joined by '/', under `prefix`. The same
    tensor (same storage, offset, dtype and shape) seen twice, as tied
    weights are, is stored once and referenced twice.

    seen: the tensors of `out` by memory, which flatten keeps up to date.
    Calls that add to one `out` one key at a time pass one dict (empty at
    first, with `out`) so that each call does not index `out` again: a
    state of n top-level keys is walked in O(n), not O(n^2). None: built
    from `out` here.
    """
    if seen is None:
        seen = {_tensor_key(t): n for n, t in out.items() if is_tensor(t) and t.numel() > 0}
    return _flatten(obj, prefix, out, where, seen)


def flatten_state(state: dict, out: dict, stateful, state_dict_of) -> dict:
    """{key: flatten(state_dict_of(obj) if stateful(obj) else obj, key, out)}
    for every top-level key of a Checkpointer's state, in one pass (one
    `seen` index for all keys)."""
    seen: dict = {_tensor_key(t): n for n, t in out.items() if is_tensor(t) and t.numel() > 0}
    return {key: flatten(state_dict_of(obj) if stateful(obj) else obj, key, out,
                         f"state[{key!r}]", seen)
            for key, obj in state.items()}


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
        name = str(obj).replace("torch.", "")
        if name not in _TORCH_DTYPES:
            raise TypeError(f"cannot checkpoint {where}: dtype {name} is not one nonstop can "
                            f"restore ({', '.join(sorted(_TORCH_DTYPES))})")
        return {"__dtype__": name}
    if torch is not None and isinstance(obj, torch.device):
        if obj.type not in DEVICE_TYPES:
            raise TypeError(f"cannot checkpoint {where}: device type {obj.type} is not one of "
                            f"{', '.join(DEVICE_TYPES)}")
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


# The only dtypes and devices a checkpoint's metadata may name: decoded from
# these fixed lists, never by looking a name up in torch or numpy.
TORCH_DTYPE_NAMES = frozenset((
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4"))
_TORCH_DTYPES = ({n: getattr(torch, n) for n in TORCH_DTYPE_NAMES
                  if isinstance(getattr(torch, n, None), torch.dtype)}
                 if torch is not None else {})
DEVICE_TYPES = ("cpu", "cuda", "meta", "mps", "xpu", "hpu", "mtia", "privateuseone")
_NUMPY_SCALARS = {np.dtype(t).str: np.dtype(t).type for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128)}
# How deeply a state tree nests (as C++ kMaxMetaDepth bounds the metadata
# document: jobdir/records.h).
MAX_DEPTH = 200


class _Bad(Exception):
    """A malformed value in a checkpoint's state tree (becomes a
    CorruptCheckpointError naming where it is)."""


def torch_dtype_by_name(name):
    """torch.dtype for a name written by flatten; None for any other name."""
    return _TORCH_DTYPES.get(name) if isinstance(name, str) else None


def _device(val):
    if not isinstance(val, str) or len(val) > 32:
        raise _Bad(f"device {val!r} is not a device name")
    kind, sep, index = val.partition(":")
    if kind not in DEVICE_TYPES or (sep and not (index.isdigit() and len(index) <= 5)):
        raise _Bad(f"device {val!r} is not one of {', '.join(DEVICE_TYPES)} (with an index)")
    return val


def unflatten(tree, tensors: dict, as_numpy: bool = False):
    """The inverse of flatten: rebuilds the state with tensors from `tensors`.

    Every tag is decoded from a fixed list; anything malformed (an unknown
    dtype or device, a dangling tensor reference, a broken float) raises a
    one-line CorruptCheckpointError."""
    try:
        return _unflatten(tree, tensors, as_numpy, "state", 0)
    except _Bad as e:
        raise CorruptCheckpointError(f"malformed checkpoint metadata: {e}") from None


def _unflatten(tree, tensors: dict, as_numpy: bool, where: str, depth: int):
    if depth > MAX_DEPTH:
        raise _Bad(f"{where} nests deeper than {MAX_DEPTH} levels")
    d = depth + 1
    if isinstance(tree, list):
        return [_unflatten(v, tensors, as_numpy, f"{where}[{i}]", d) for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        (tag, val), = tree.items()
        if tag in ("__tensor__", "__ndarray__"):
            if not isinstance(val, str) or val not in tensors:
                raise _Bad(f"{where} refers to tensor {str(val)[:80]!r}, which the checkpoint "
                           f"does not hold")
            t = tensors[val]
            if tag == "__ndarray__" and not isinstance(t, np.ndarray):
                return t.numpy()
            return t
        if tag == "__float__":
            if not isinstance(val, str) or len(val) != 16:
                raise _Bad(f"{where}: {str(val)[:40]!r} is not a float's 8 bytes in hex")
            try:
                return struct.unpack("<d", bytes.fromhex(val))[0]
            except ValueError:
                raise _Bad(f"{where}: {val!r} is not a float's 8 bytes in hex") from None
        if tag == "__tuple__":
            if not isinstance(val, list):
                raise _Bad(f"{where}: a tuple must be a list")
            return tuple(_unflatten(v, tensors, as_numpy, f"{where}[{i}]", d)
                         for i, v in enumerate(val))
        if tag == "__dict__":
            if not isinstance(val, list) or not all(isinstance(kv, list) and len(kv) == 2
                                                    for kv in val):
                raise _Bad(f"{where}: a dict must be a list of [key, value] pairs")
            out = {}
            for i, (k, v) in enumerate(val):
                key = _unflatten(k, tensors, as_numpy, f"{where}.key{i}", d)
                try:
                    hash(key)
                except TypeError:
                    raise _Bad(f"{where}: key {i} is of unhashable type "
                               f"{type(key).__name__}") from None
                out[key] = _unflatten(v, tensors, as_numpy, f"{where}[{key!r}]", d)
            return out
        if tag == "__npscalar__":
            if not (isinstance(val, list) and len(val) == 2 and val[0] in _NUMPY_SCALARS
                    and isinstance(val[1], (bool, int, float, dict))):
                raise _Bad(f"{where}: numpy scalar {str(val)[:60]!r} is not of a numeric "
                           f"dtype")
            value = _unflatten(val[1], tensors, as_numpy, where, d)
            try:
                return _NUMPY_SCALARS[val[0]](value)
            except (TypeError, ValueError, OverflowError):
                raise _Bad(f"{where}: {value!r} is not a {val[0]} numpy scalar") from None
        if tag == "__dtype__":
            dt = torch_dtype_by_name(val)
            if dt is None and not (torch is None and isinstance(val, str)
                                   and val in TORCH_DTYPE_NAMES):
                raise _Bad(f"{where}: dtype {str(val)[:40]!r} is not one of torch's tensor "
                           f"dtypes")
            return dt if dt is not None and not as_numpy else val
        if tag == "__device__":
            val = _device(val)
            return torch.device(val) if torch is not None and not as_numpy else val
        if tag.startswith(_RESERVED) and tag.endswith(_RESERVED):
            raise _Bad(f"{where}: unknown tag {tag[:40]!r}")
    return {k: _unflatten(v, tensors, as_numpy, f"{where}[{k!r}]", d) for k, v in tree.items()}


def dumps(tree) -> str:
    # allow_nan=False: non-finite floats are tagged by flatten, so a bare one
    # here is a bug, not data.
    return json.dumps(tree, allow_nan=False, separators=(",", ":"))


def loads(text):
    """Parses a metadata document (str or UTF-8 bytes) that C++ checked first
    (check_meta_json: size, UTF-8, JSON, nesting depth). Raises
    CorruptCheckpointError (one line) on anything else."""
    _ext.core().check_meta_json(text)
    return json.loads(text)
