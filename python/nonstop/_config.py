"""Checkpointer(config=PATH): settings from a JSON file, usually the one
`nonstop tune --out PATH` writes (its format, and how explicit arguments
override it: docs/TUNE.md "nonstop tune")."""
from __future__ import annotations

import json
import os
from typing import Optional

from . import _ext
from .errors import CheckpointMismatchError

# Checkpointer's defaults for the arguments a config file may set.
DEFAULTS = {"every": 10, "mode": "concurrent", "max_in_flight": 2, "writers": None,
            "staging_bytes": None, "chunk_bytes": None, "medium": "auto", "copy_threads": 1,
            "max_overhead": 0.03}


def load(path: str) -> dict:
    """Reads a config file; returns {argument: value} for the keys it sets.
    Raises a one-line CheckpointMismatchError for an unreadable file, a
    wrong type or an unknown key (checked by C++: engine/checkpointer_args.h)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise CheckpointMismatchError(f"config {path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise CheckpointMismatchError(f"config {path}: not JSON ({e})") from None
    return _ext.core().check_config(path, doc, list(DEFAULTS))


def resolve(config: Optional[str], **explicit) -> dict:
    """The settings to use: explicit arguments (those not None), then the
    config file, then DEFAULTS."""
    settings = dict(DEFAULTS)
    if config is not None:
        settings.update(load(config))
    settings.update({k: v for k, v in explicit.items() if v is not None})
    return settings
