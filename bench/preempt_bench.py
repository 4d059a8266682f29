"""Time from a preemption notice to a safe exit, as a function of checkpoint
size, on this machine's disk (docs/PREEMPTION.md).

For each state size a Checkpointer (every=1000, so no periodic checkpoint
gets in the way unless a scenario starts one) holds one parameter of that
size. A "step" is a sleep of --step-ms (the device's compute). Scenarios:

  idle      the notice arrives with nothing in flight
  busy      a regular checkpoint of the previous step was started just before
            the notice (the usual case with frequent checkpoints): nonstop
            abandons it (Engine::AbandonOlderThan) and writes the emergency one
  busy-keep the same without abandoning: the emergency checkpoint queues
            behind the one in flight (what a plain FIFO engine would do)

Measured per run: notice -> emergency checkpoint committed (safe), and
notice -> Preempted raised with the checkpointer closed (safe exit). Then a
least-squares fit time = a + size / bw over the idle runs gives the largest
checkpoint that fits a 30 s and a 120 s notice (an extrapolation beyond the
largest size measured; say so where quoted).

    .venv/bin/python bench/preempt_bench.py --dir runs/preempt-bench \
        --sizes 16M,64M,256M,1G,2G --repeat 3 --json runs/preempt_bench.json
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time

import torch

import nonstop


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("IB")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


class _NoAbandon:
    """The engine without abandon_older_than: the emergency checkpoint
    queues behind what is in flight."""

    def __init__(self, engine):
        self._e = engine

    def __getattr__(self, name):
        if name == "abandon_older_than":
            raise AttributeError(name)
        return getattr(self._e, name)


def one_run(d: str, nbytes: int, scenario: str, step_s: float, medium: str) -> dict:
    shutil.rmtree(d, ignore_errors=True)
    p = torch.nn.Parameter(torch.ones(nbytes // 4, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=0.0)
    ckpt = nonstop.Checkpointer(d, {"w": p, "optim": opt}, every=1000, rng=False,
                                medium=medium, on_preempt={"signals": []})
    # Two warm-up checkpoints: file created, staging faulted, bandwidth measured.
    for s in range(2):
        time.sleep(step_s)
        ckpt.save(s)
        ckpt.wait()
    if scenario == "busy-keep":
        ckpt.session.engine = _NoAbandon(ckpt.session.engine)
    s = 2
    time.sleep(step_s)
    if scenario.startswith("busy"):
        ckpt.save(s)  # the regular checkpoint of step 2 is in flight ...
        s += 1
        time.sleep(step_s / 2)  # ... and the notice lands in the middle of step 3
    t_notice = time.perf_counter()
    ckpt.preempt("bench")
    # What the notice's line estimated (PreemptWatch.notice's figures).
    w, eng = ckpt._preempt, ckpt.session.engine
    latest = eng.latest()
    _, expected = w.notices.estimate(
        sum(r[3] for r in ckpt.session.registered),
        nonstop._ext.core().persist_bandwidth(eng.stats().get("recent", [])),
        w.cfg["grace_s"], None if latest is None else latest[1])
    time.sleep(step_s / 2)  # the rest of the step
    t_boundary = time.perf_counter()
    try:
        ckpt.step(s)
        raise RuntimeError("no Preempted")
    except nonstop.Preempted as e:
        t_exit = time.perf_counter()
        pre = e
    rec = pre.checkpoint or {}
    del ckpt, p, opt
    gc.collect()
    safe_s = pre.notice_to_safe_s
    return {"bytes": nbytes, "scenario": scenario, "committed": pre.committed,
            "expected_s": expected, "notice_to_safe_s": safe_s,
            "notice_to_exit_s": t_exit - t_notice, "boundary_to_exit_s": t_exit - t_boundary,
            "emergency_persist_s": rec.get("persist_s"), "emergency_write_GBps": rec.get("write_GBps")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="runs/preempt-bench")
    ap.add_argument("--sizes", default="16M,64M,256M,1G,2G")
    ap.add_argument("--scenarios", default="idle,busy,busy-keep")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=50)
    ap.add_argument("--medium", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [parse_size(x) for x in args.sizes.split(",")]
    scenarios = args.scenarios.split(",")
    rows = []
    for nbytes in sizes:
        for rep in range(args.repeat if nbytes < (1 << 30) else max(1, args.repeat - 1)):
            for sc in scenarios:  # interleaved: one of each per round
                r = one_run(args.dir, nbytes, sc, args.step_ms / 1e3, args.medium)
                r["repeat"] = rep
                rows.append(r)
                print(f"  {nbytes / 2**20:8.0f} MiB {sc:9s} rep {rep}: notice->safe "
                      f"{r['notice_to_safe_s']:.3f} s, notice->exit {r['notice_to_exit_s']:.3f} s "
                      f"(expected {r['expected_s'] if r['expected_s'] is None else round(r['expected_s'], 3)})",
                      file=sys.stderr, flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    summary = []
    for nbytes in sizes:
        for sc in scenarios:
            rs = [r for r in rows if r["bytes"] == nbytes and r["scenario"] == sc]
            safe = [r["notice_to_safe_s"] for r in rs]
            ex = [r["notice_to_exit_s"] for r in rs]
            summary.append({"bytes": nbytes, "scenario": sc, "runs": len(rs),
                            "notice_to_safe_s_median": statistics.median(safe),
                            "notice_to_safe_s_min": min(safe), "notice_to_safe_s_max": max(safe),
                            "notice_to_exit_s_median": statistics.median(ex),
                            "expected_s_median": statistics.median(
                                [r["expected_s"] for r in rs if r["expected_s"] is not None] or [0]),
                            "all_committed": all(r["committed"] for r in rs)})
    # notice -> committed = a + bytes / bw over the idle runs (least squares on
    # the medians); the close after it (threads joined, staging unmapped) is
    # added as its median over all runs.
    pts = [(s["bytes"], s["notice_to_safe_s_median"]) for s in summary if s["scenario"] == "idle"]
    close_s = statistics.median(r["notice_to_exit_s"] - r["notice_to_safe_s"] for r in rows)
    fit = None
    if len(pts) >= 2:
        mx = statistics.mean(x for x, _ in pts)
        my = statistics.mean(y for _, y in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        a = my - slope * mx
        bw = 1 / slope if slope > 0 else float("inf")
        fit = {"intercept_s": a, "bandwidth_GBps": bw / 1e9, "close_s": close_s,
               "fits_30s_GiB": max(0.0, (30 - a - close_s) * bw / 2**30),
               "fits_120s_GiB": max(0.0, (120 - a - close_s) * bw / 2**30),
               "extrapolated_beyond_GiB": max(sizes) / 2**30}
    print(f"\nnotice -> safe exit, step {args.step_ms:g} ms, medium {args.medium}, median of "
          f"{args.repeat} (>= 1 GiB: {max(1, args.repeat - 1)})")
    print(f"{'state':>9} | {'scenario':9} | {'expected':>8} | {'->committed':>11} | "
          f"{'->exit':>8} | {'min..max committed':>18}")
    for s in summary:
        print(f"{s['bytes'] / 2**20:6.0f} MiB | {s['scenario']:9} | {s['expected_s_median']:7.2f}s | "
              f"{s['notice_to_safe_s_median']:10.3f}s | {s['notice_to_exit_s_median']:7.3f}s | "
              f"{s['notice_to_safe_s_min']:8.3f}..{s['notice_to_safe_s_max']:.3f}s")
    if fit:
        print(f"\nfit (idle): notice->committed = {fit['intercept_s']:.3f} s + size / "
              f"{fit['bandwidth_GBps']:.2f} GB/s, then close {fit['close_s']:.2f} s -> fits a 30 s notice: {fit['fits_30s_GiB']:.1f} GiB, a 120 s notice: "
              f"{fit['fits_120s_GiB']:.1f} GiB (extrapolated beyond "
              f"{fit['extrapolated_beyond_GiB']:.1f} GiB measured)")
    out = {"command": " ".join(sys.argv), "step_ms": args.step_ms, "medium": args.medium,
           "runs": rows, "summary": summary, "fit": fit}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({"summary": summary, "fit": fit}))


if __name__ == "__main__":
    main()
