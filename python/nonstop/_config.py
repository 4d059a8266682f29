"""Checkpointer(config=PATH): settings from a file, usually the one that
`nonstop tune --out PATH` writes (docs/TUNE.md).

The file is JSON. Its keys are Checkpointer's own argument names:

    {"format": "nonstop.config/1", "every": 75, "max_in_flight": 3, "writers": 4,
     "chunk_bytes": 1048576, "staging_bytes": 268435456, "medium": "auto",
     "tune": {... what tune measured ...}}

The output of `nonstop tune --json` is accepted too (its `interval` is
`every`). Arguments given to Checkpointer explicitly override the file; the
file overrides the defaults.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from .errors import CheckpointMismatchError

FORMAT = "nonstop.config/1"

# Checkpointer's defaults for the arguments a config file may set.
DEFAULTS = {"every": 10, "mode": "concurrent", "max_in_flight": 2, "writers": None,
            "staging_bytes": None, "chunk_bytes": None, "medium": "auto", "copy_threads": 1,
            "max_overhead": 0.03}

_INT_KEYS = ("max_in_flight", "writers", "staging_bytes", "chunk_bytes", "copy_threads")
# Keys a file may carry that are records, not settings.
_RECORD_KEYS = {"format", "tune", "inputs", "measured", "notes"}


def load(path: str) -> dict:
    """Reads a config file; returns {argument: value} for the keys it sets.
    Raises a one-line CheckpointMismatchError for an unreadable file, a
    wrong type or an unknown key."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise CheckpointMismatchError(f"config {path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise CheckpointMismatchError(f"config {path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointMismatchError(f"config {path}: expected a JSON object")
    fmt = doc.get("format")
    if fmt is not None and fmt != FORMAT:
        raise CheckpointMismatchError(f"config {path}: format {fmt!r} is not {FORMAT!r}")
    tune_json = fmt is None and "interval" in doc and "max_in_flight" in doc
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _RECORD_KEYS:
            continue
        if tune_json:
            if key == "interval":
                key = "every"
            elif key not in DEFAULTS:
                continue  # `nonstop tune --json` also prints what it measured
        if key not in DEFAULTS:
            raise CheckpointMismatchError(
                f"config {path}: unknown setting {key!r}; known: {', '.join(DEFAULTS)}")
        out[key] = _check(path, key, value)
    return out


def _check(path: str, key: str, value: Any) -> Any:
    def bad(expected: str):
        return CheckpointMismatchError(f"config {path}: {key} must be {expected}, got {value!r}")

    if value is None:
        return None
    if key == "every":
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                               and value >= 1):
            return value
        raise bad('a positive integer or "auto"')
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad("a non-negative integer")
        return value
    if key in ("mode", "medium"):
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if key == "max_overhead":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise bad("a fraction in (0, 1), e.g. 0.03")
        return float(value)
    return value


def resolve(config: Optional[str], **explicit) -> dict:
    """The settings to use: explicit arguments (those not None), then the
    config file, then DEFAULTS."""
    settings = dict(DEFAULTS)
    if config is not None:
        settings.update(load(config))
    settings.update({k: v for k, v in explicit.items() if v is not None})
    return settings
