"""State <-> (named tensors, JSON): how a state dict becomes a checkpoint
(docs/PYTHON.md "How state is stored"). Tensors are stored by name; the
rest is one JSON document referring to them, nothing pickled. Finite floats
are written with ``repr`` (bitwise); ``nan``/``inf`` by their bits, tuples,
dicts with non-string keys, dtypes, devices and numpy values as one-key
``{"__tag__": ...}`` objects (the tags: C++ CheckStateTree, export.h).
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

# From C++'s fixed lists (never a name looked up in torch or numpy): the dtype
# names by code of the on-disk format (include/nonstop/types.h), and the only
# torch dtypes and device types a state tree may name (export.h StateTreeDtypes).
DTYPE_NAMES, TORCH_DTYPE_NAMES, DEVICE_TYPES = (
    _ext.core().state_tree_names() if _ext.ERROR is None else ((), (), ()))
_TORCH_DTYPES = ({n: getattr(torch, n) for n in TORCH_DTYPE_NAMES
                  if isinstance(getattr(torch, n, None), torch.dtype)}
                 if torch is not None else {})
DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_NAMES)}
# numpy dtype (for nonstop.load without torch); None where numpy has none.
NUMPY_DTYPES = {c: getattr(np, "bool_" if n == "bool" else n, None)
                for c, n in enumerate(DTYPE_NAMES)}

_RESERVED = "__"


def torch_dtype_code(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise TypeError(f"nonstop cannot checkpoint tensors of dtype {name}") from None


def torch_dtype(code: int):
    """torch.dtype of a dtype code of the on-disk format (a fixed table)."""
    dt = torch_dtype_by_name(DTYPE_NAMES[code]) if isinstance(code, int) and 0 <= code < len(
        DTYPE_NAMES) else None
    if dt is None:
        raise CorruptCheckpointError(f"unknown tensor dtype code {code!r}")
    return dt


def index(out: dict) -> dict:
    """The tensors of `out` by memory (_tensor_key), which flatten keeps up to date."""
    return {_tensor_key(t): n for n, t in out.items() if is_tensor(t) and t.numel() > 0}


def is_tensor(x) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def flatten(obj, prefix: str, out: dict, where: str = "state", seen: Optional[dict] = None):
    """Returns the JSON-able form of `obj`, adding its tensors to `out` by
    the path of keys joined by '/' under `prefix`. The same tensor seen twice
    (same memory, dtype and shape: tied weights) is stored once and referenced
    twice. `seen`: index(out), one for several calls into one `out` (O(n^2) else)."""
    seen = index(out) if seen is None else seen
    if isinstance(obj, np.generic):  # before float: np.float64 is a float
        return {"__npscalar__": [obj.dtype.str, flatten(obj.item(), prefix, out, where, seen)]}
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
        return {"__tuple__": [flatten(v, f"{prefix}/{i}", out, f"{where}[{i}]", seen)
                              for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, f"{prefix}/{i}", out, f"{where}[{i}]", seen)
                for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith(_RESERVED) for k in obj):
            return {k: flatten(v, f"{prefix}/{k}", out, f"{where}[{k!r}]", seen)
                    for k, v in obj.items()}
        return {"__dict__": [[flatten(k, f"{prefix}/key{i}", out, where, seen),
                              flatten(v, f"{prefix}/{k}", out, f"{where}[{k!r}]", seen)]
                             for i, (k, v) in enumerate(obj.items())]}
    raise TypeError(f"cannot checkpoint {where}: {type(obj).__name__} is neither a tensor "
                    f"nor JSON data; give it state_dict()/load_state_dict()")


def _tensor_key(t):
    # A DTensor's (FSDP2's) data_ptr() is 0: key it by its local shard's memory.
    local = getattr(t, "_local_tensor", None)
    ptr = t.data_ptr() if local is None else local.data_ptr() if local.numel() else id(t)
    return (ptr, t.dtype, tuple(t.shape), t.stride(), str(t.device))


def _add_tensor(t, name: str, out: dict, seen: dict) -> str:
    # Tied weights: the same memory under a second name is stored once.
    key = _tensor_key(t) if is_tensor(t) and t.numel() > 0 else None
    if key in seen:
        return seen[key]
    base, n = name, 1
    while name in out:
        n += 1
        name = f"{base}#{n}"
    out[name] = t
    if key is not None:
        seen[key] = name
    return name


# How deeply a state tree nests (as C++ kMaxMetaDepth bounds the metadata
# document: jobdir/records.h).
MAX_DEPTH = 200


def torch_dtype_by_name(name):
    """torch.dtype for a name written by flatten; None for any other name."""
    return _TORCH_DTYPES.get(name) if isinstance(name, str) else None


def unflatten(tree, tensors: dict, as_numpy: bool = False):
    """The inverse of flatten: rebuilds the state with tensors from `tensors`,
    after C++ checks the tree (export.h CheckStateTree): anything malformed
    (an unknown tag, dtype or device, a dangling tensor reference, a broken
    float) raises a one-line CorruptCheckpointError naming where it is."""
    _ext.core().check_state_tree(dumps(tree), list(tensors))
    try:
        return rebuild(tree, tensors, as_numpy)
    except (TypeError, ValueError, OverflowError) as e:  # a numpy scalar out of its range
        raise CorruptCheckpointError(f"malformed checkpoint metadata: {e}") from None


def rebuild(tree, tensors: dict, as_numpy: bool = False):
    """unflatten without C++'s check: for a tree C++ checked already
    (check_saved_state, once for restore()'s every key)."""
    if isinstance(tree, list):
        return [rebuild(v, tensors, as_numpy) for v in tree]
    if not isinstance(tree, dict):
        return tree
    tag, val = next(iter(tree.items())) if len(tree) == 1 else (None, None)
    if tag in ("__tensor__", "__ndarray__"):
        t = tensors[val]
        return t.numpy() if tag == "__ndarray__" and not isinstance(t, np.ndarray) else t
    if tag == "__float__":
        return struct.unpack("<d", bytes.fromhex(val))[0]
    if tag == "__tuple__":
        return tuple(rebuild(v, tensors, as_numpy) for v in val)
    if tag == "__dict__":
        return {rebuild(k, tensors, as_numpy): rebuild(v, tensors, as_numpy)
                for k, v in val}
    if tag == "__npscalar__":
        return np.dtype(val[0]).type(rebuild(val[1], tensors, as_numpy))
    if tag == "__dtype__":
        dt = torch_dtype_by_name(val)
        if dt is None and torch is not None:
            raise CorruptCheckpointError(f"malformed checkpoint metadata: dtype {val!r} is not "
                                         f"one of this torch's tensor dtypes")
        return dt if dt is not None and not as_numpy else val
    if tag == "__device__":
        return torch.device(val) if torch is not None and not as_numpy else val
    return {k: rebuild(v, tensors, as_numpy) for k, v in tree.items()}


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
