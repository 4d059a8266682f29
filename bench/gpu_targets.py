"""Issue 25's targets ("What it must show") from one `bench/gpu_run.sh` call:
each target with its figure and PASS / FAIL / MISSING (not measured in this
call: the phase did not run, the time budget cut the run, the scheme was
refused). Prints a table and writes JSON.

    python3 bench/gpu_targets.py --out $OUT [--wall-s 512] [--json $OUT/gpu_targets.json]

Reads, under --out: test-gpu.log (the test phase), gpu_overhead_125m.json
(small) and gpu_overhead_1.4b.json (big); for a CPU check of the plumbing
(gpu_run.sh --cpu) the same names with the tiny model. Imports only the
standard library.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

# (id, what, where the figure comes from) -- the limits are issue 25's.
WALL_LIMIT_S = 540


def load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def row(bench, scheme: str):
    """The summary row of `scheme` ("kind/every") in a gpu_overhead JSON."""
    for r in (bench or {}).get("rows") or []:
        if r.get("scheme") == scheme:
            return r
    return None


def none_step(bench):
    r = row(bench, "none")
    return r["step_s"] if r else None


def check(tid: str, what: str, figure, ok, note: str = "") -> dict:
    """ok: True / False, or None when the figure is missing."""
    status = "MISSING" if ok is None else ("PASS" if ok else "FAIL")
    return {"id": tid, "target": what, "figure": figure, "status": status, "note": note}


def overhead(bench, scheme: str, limit: float, tid: str, what: str) -> dict:
    r = row(bench, scheme)
    if bench is None:
        return check(tid, what, None, None, "phase not run")
    if r is None:
        return check(tid, what, None, None, f"no {scheme} row (time budget or not planned)")
    if "error" in r:
        return check(tid, what, r["error"], False, f"{scheme} crashed")
    v = r["throughput_overhead"]
    note = (f"{r['step_s'] * 1e3:.1f} ms/step vs none {none_step(bench) * 1e3:.1f} ms, "
            f"{r.get('runs', 0)} run(s), none drift {r.get('none_drift', 0) * 100:.1f} %")
    if r.get("disk_every") is not None:
        note += f", disk_every {r['disk_every']}"
    return check(tid, what, f"{v * 100:+.2f} %", v <= limit, note)


def stall(bench, scheme: str, limit_s: float, tid: str, what: str) -> dict:
    r = row(bench, scheme)
    if r is None or bench is None:
        return check(tid, what, None, None, "phase not run" if bench is None else
                     f"no {scheme} row")
    if "error" in r:
        return check(tid, what, r["error"], False, f"{scheme} crashed")
    v = r["stall_per_ckpt_s"]
    return check(tid, what, f"{v * 1e3:.1f} ms", v <= limit_s,
                 f"{r.get('ckpts_measured', 0)} checkpoints")


def auto_mode(bench, tid: str, what: str) -> dict:
    """mode="auto" at every 10 against the concurrent row it can pick
    (both tiered): its step time no more than 1 % above."""
    if bench is None:
        return check(tid, what, None, None, "phase not run")
    a, c = row(bench, "nonstop-auto/10"), row(bench, "nonstop-tiered/10")
    if a is None or c is None:
        return check(tid, what, None, None, "no nonstop-auto/10 or nonstop-tiered/10 row")
    if "error" in a:
        return check(tid, what, a["error"], False, "nonstop-auto crashed")
    ratio = a["step_s"] / c["step_s"]
    runs = [r for r in bench.get("runs") or [] if r.get("scheme") == "nonstop-auto/10"]
    m = (runs[-1].get("mode_auto") or {}) if runs else {}
    note = f"ran {m.get('active', '?')}: {m.get('reason', 'no figures')}"
    return check(tid, what, f"{(ratio - 1) * 100:+.2f} %", ratio <= 1.01, note)


def tests(log_path: str) -> list:
    what = "tests/gpu passes, multistep on CUDA resumes bitwise after SIGKILL"
    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return [check("tests", what, None, None, "no test-gpu.log (test phase not run)")]
    fails = [ln for ln in text.splitlines() if ln.startswith("FAIL")]
    exits = [int(m) for m in re.findall(r"^== [^\n]*: exit (-?\d+)", text, re.M)]
    resumed = re.search(r"^PASS GPU training resume \(multistep\)", text, re.M)
    ctest = re.search(r"(\d+)% tests passed, (\d+) tests failed out of (\d+)", text)
    figure = (f"ctest {ctest.group(3)} run, {ctest.group(2)} failed; " if ctest else "") + \
        f"{len(re.findall(r'^PASS', text, re.M))} PASS, {len(fails)} FAIL lines"
    ok = bool(exits) and all(e == 0 for e in exits) and not fails and bool(resumed)
    note = "; ".join(fails[:3]) if fails else ("" if resumed else
                                                "no multistep resume PASS line")
    if exits and any(e != 0 for e in exits):
        note = (note + "; " if note else "") + f"exit statuses {exits}"
    return [check("tests", what, figure, ok, note)]


def evaluate(out: str, small_name: str, big_name: str, wall_s) -> list:
    small = load(os.path.join(out, f"gpu_overhead_{small_name}.json"))
    big = load(os.path.join(out, f"gpu_overhead_{big_name}.json"))
    res = tests(os.path.join(out, "test-gpu.log"))
    res.append(overhead(big, "nonstop-tiered/10", 0.01, "big-10",
                        "1.38B (16.5 GB), every 10: throughput overhead <= 1 %"))
    res.append(stall(big, "nonstop-tiered/10", 0.020, "big-10-stall",
                     "1.38B, every 10: stall <= 20 ms per checkpoint"))
    res.append(overhead(big, "nonstop-tiered/50", 0.005, "big-50",
                        "1.38B, every 50: throughput overhead <= 0.5 %"))
    res.append(overhead(small, "nonstop-tiered/10", 0.01, "small-10",
                        "111M, every 10: throughput overhead <= 1 %"))
    res.append(overhead(small, "nonstop-tiered/1", 0.10, "small-1",
                        "111M, every step: throughput overhead <= 10 %"))
    res.append(auto_mode(small, "small-auto-10", "111M, every 10: mode='auto' step time "
                         "<= 1.01x concurrent's (it picks the faster mode)"))
    # Multistep (GoCkpt) without a device snapshot vs the concurrent mode's
    # stall when the whole device-to-host copy is visible (nonstop-direct).
    what = "multistep on 1.38B: stall <= 0.2x the concurrent host-copy stall"
    ms, direct = None, None
    for e in (50, 10):
        ms, direct = row(big, f"nonstop-multistep/{e}"), row(big, f"nonstop-direct/{e}")
        if ms is not None and direct is not None:
            break
    if big is None or ms is None or direct is None:
        why = (big or {}).get("refused", {}).get("nonstop-multistep")
        res.append(check("big-multistep", what, why, False if why else None,
                         "multistep refused" if why else "phase not run" if big is None else
                         "no nonstop-multistep and nonstop-direct rows at one interval"))
    elif "error" in ms or "error" in direct:
        res.append(check("big-multistep", what, ms.get("error") or direct.get("error"), False,
                         "crashed"))
    else:
        ratio = ms["stall_per_ckpt_s"] / max(direct["stall_per_ckpt_s"], 1e-9)
        res.append(check("big-multistep", what, f"{ratio:.3f}x", ratio <= 0.2,
                         f"{ms['scheme']} {ms['stall_per_ckpt_s'] * 1e3:.1f} ms vs "
                         f"{direct['scheme']} {direct['stall_per_ckpt_s'] * 1e3:.1f} ms"))
    # Restore: nonstop vs DCP load, cold (the big model's when it ran, else the small's).
    what = "restore into CUDA >= 1.2x DCP load, cold"
    rs = [(n, (b or {}).get("restore")) for n, b in ((big_name, big), (small_name, small))]
    rs = [(n, r) for n, r in rs if r and r.get("nonstop_vs_dcp")]
    if not rs:
        res.append(check("restore", what, None, None, "no restore measured"))
    for n, r in rs:
        cold = all(r.get("cold") or [False])
        res.append(check(f"restore-{n}", what, f"{r['nonstop_vs_dcp']:.2f}x",
                         r["nonstop_vs_dcp"] >= 1.2 and cold,
                         f"{n}: nonstop {r['nonstop_GBps']:.2f} GB/s, DCP {r['dcp_GBps']:.2f} "
                         f"GB/s, page cache dropped: {cold}"))
    what = "restore from the memory tier >= 10 GB/s"
    mems = [(n, ((b or {}).get("restore") or {}).get("memory"))
            for n, b in ((big_name, big), (small_name, small))]
    mems = [(n, m) for n, m in mems if m]
    if not mems:
        res.append(check("restore-memory", what, None, None, "not measured"))
    for n, m in mems:
        if m.get("error") or not m.get("GBps"):
            res.append(check(f"restore-memory-{n}", what, m.get("error"), False, n))
            continue
        from_memory = all(x == "memory" for x in m.get("from") or [None])
        res.append(check(f"restore-memory-{n}", what, f"{m['GBps']:.2f} GB/s",
                         m["GBps"] >= 10 and from_memory,
                         f"{n}: restored from {sorted(set(map(str, m.get('from') or [])))}"))
    # DCP async rows, thread and process mode: present, or their crash recorded.
    for kind, mode in (("dcp", "thread"), ("dcp-process", "process")):
        what = f"DCP async_save ({mode} mode) rows present, or their crash recorded"
        got = [r for b in (small, big) for r in ((b or {}).get("rows") or [])
               if r.get("scheme", "").startswith(kind + "/")]
        if not got:
            res.append(check(f"{kind}-rows", what, None, None, "no row"))
            continue
        shown = ", ".join(f"{r['scheme']} " + (f"crashed: {r['error'][:80]}" if "error" in r
                                               else f"{r['throughput_overhead'] * 100:+.1f} %")
                          for r in got)
        res.append(check(f"{kind}-rows", what, shown, True))
    what = f"test small big in one call <= {WALL_LIMIT_S} s"
    res.append(check("wall", what, None if wall_s is None else f"{wall_s:.0f} s",
                     None if wall_s is None else wall_s <= WALL_LIMIT_S))
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="gpu_run.sh's $OUT")
    p.add_argument("--small", default="125m", help="model name of the small phase's JSON")
    p.add_argument("--big", default="1.4b", help="model name of the big phase's JSON")
    p.add_argument("--wall-s", type=float, default=None, help="the whole call's seconds")
    p.add_argument("--json", default=None, help="default: OUT/gpu_targets.json")
    args = p.parse_args()
    res = evaluate(args.out, args.small, args.big, args.wall_s)
    w = max(len(r["target"]) for r in res)
    print(f"\nissue 25 targets ({args.out})")
    print(f"{'target':<{w}}  {'status':<7}  figure / note")
    print("-" * (w + 40))
    for r in res:
        fig = "-" if r["figure"] is None else str(r["figure"])
        print(f"{r['target']:<{w}}  {r['status']:<7}  {fig}" + (f"  ({r['note']})" if r["note"]
                                                               else ""))
    counts = {s: sum(r["status"] == s for r in res) for s in ("PASS", "FAIL", "MISSING")}
    print(f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['MISSING']} MISSING")
    path = args.json or os.path.join(args.out, "gpu_targets.json")
    with open(path, "w") as f:
        json.dump({"targets": res, "counts": counts, "wall_s": args.wall_s}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
