"""A/B of reading a checkpoint's metadata document (_state.loads): the
Python checks it replaced (size, UTF-8 decode, a regex scan for the nesting
depth, then json.loads) against C++'s check (check_meta_json: size, UTF-8,
JSON grammar and depth in one pass that builds nothing) then json.loads.
Documents: the state tree of an AdamW-like optimizer over N parameters
(flatten's output, as a checkpoint writes it), N = 100, 10,000, 100,000.
Rounds interleave the arms (ABBA); prints the median per arm and new/old.

    .venv/bin/python bench/meta_loads_ab.py [--rounds 9] [--json bench/meta_loads_ab.json]
"""
import argparse
import json
import re
import statistics
import sys
import time

import torch

from nonstop import _state
from nonstop.errors import CorruptCheckpointError

MAX_META_BYTES, MAX_DEPTH = 256 << 20, 200
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def old_loads(text):  # the Python loads before this change, verbatim in effect
    if isinstance(text, (bytes, bytearray)):
        if len(text) > MAX_META_BYTES:
            raise CorruptCheckpointError("too large")
        text = bytes(text).decode("utf-8")
    if len(text) > MAX_META_BYTES:
        raise CorruptCheckpointError("too large")
    if text.count("[") + text.count("{") > MAX_DEPTH:
        depth = 0
        for ch in _BRACKETS.findall(_STRINGS.sub("", text)):
            if ch in "[{":
                depth += 1
                if depth > MAX_DEPTH:
                    raise CorruptCheckpointError("too deep")
            else:
                depth -= 1
    return json.loads(text)


def document(n: int) -> bytes:
    scalar = torch.zeros(())
    state = {"state": {i: {"step": scalar, "exp_avg": scalar, "exp_avg_sq": scalar}
                       for i in range(n)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                               "weight_decay": 0.01, "amsgrad": False,
                               "params": list(range(n))}]}
    tree = _state.flatten(state, "optim", {})
    return _state.dumps({"format": "nonstop-pytorch", "step": 7, "state": {"optim": tree}}).encode()


def timed(fn, doc, reps):
    t = time.perf_counter()
    for _ in range(reps):
        fn(doc)
    return (time.perf_counter() - t) / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    print(f"{'params':>8} {'bytes':>10} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for n in (100, 10_000, 100_000):
        doc = document(n)
        assert old_loads(doc) == _state.loads(doc)
        reps = max(1, 2_000_000 // len(doc))
        times = {"old": [], "new": []}
        for r in range(a.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for arm in order:
                times[arm].append(timed(old_loads if arm == "old" else _state.loads, doc, reps))
        old, new = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
        rows.append({"params": n, "bytes": len(doc), "old_ms": old, "new_ms": new,
                     "ratio": new / old, "reps": reps, "rounds": a.rounds})
        print(f"{n:>8} {len(doc):>10} {old:>9.3f} {new:>9.3f} {new / old:>8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join([".venv/bin/python"] + sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
