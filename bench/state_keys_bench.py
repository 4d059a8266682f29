"""Checkpointing a state with many top-level keys (issue 24): the cost must
grow linearly with the number of keys.

For each key count n the state is {"k00000": tensor(4 floats), ...} (n
top-level keys, one small tensor each). Measured: open (Checkpointer(...),
which walks the state once to size the staging pool), register + save (the
first save(): the state walked, the engine's registration, the checkpoint
committed), and save (a later save(), walked again, committed; the median of
--repeat).

    .venv/bin/python bench/state_keys_bench.py --dir runs/keys-bench \
        --keys 1000,4000,16000 --json bench/state_keys_bench.json
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import time

import torch

import nonstop


def one(path: str, n: int, repeat: int) -> dict:
    shutil.rmtree(path, ignore_errors=True)
    state = {f"k{i:05d}": torch.full((4,), float(i)) for i in range(n)}
    t0 = time.perf_counter()
    ck = nonstop.Checkpointer(path, state=state, every=1, tier="disk")
    t1 = time.perf_counter()
    ck.save(0).wait()
    t2 = time.perf_counter()
    saves = []
    for s in range(1, repeat + 1):
        t = time.perf_counter()
        ck.save(s).wait()
        saves.append(time.perf_counter() - t)
    ck.close()
    shutil.rmtree(path, ignore_errors=True)
    return {"keys": n, "open_s": t1 - t0, "register_save_s": t2 - t1,
            "save_s": statistics.median(saves), "saves": saves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="runs/keys-bench")
    ap.add_argument("--keys", default="1000,4000,16000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="bench/state_keys_bench.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [one(a.dir, int(k), a.repeat) for k in a.keys.split(",")]
    print(f"{'keys':>7} {'open s':>8} {'register+save s':>16} {'save s':>8} {'save us/key':>12}")
    for r in rows:
        print(f"{r['keys']:>7} {r['open_s']:>8.3f} {r['register_save_s']:>16.3f} "
              f"{r['save_s']:>8.3f} {1e6 * r['save_s'] / r['keys']:>12.1f}")
    out = {"command": "bench/state_keys_bench.py --keys " + a.keys + f" --repeat {a.repeat}",
           "machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "nonstop": nonstop.__version__, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
