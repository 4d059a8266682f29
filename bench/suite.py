"""nonstop's benchmark suite: the whole comparison matrix on this machine,
in one command, with JSON, CSV, PNG plots and docs/BENCHMARKS.md updated.

    .venv/bin/python bench/suite.py --quick      # < 5 minutes
    .venv/bin/python bench/suite.py              # the full matrix, < 30 minutes

Stages (each prints progress; `--only a,b` runs some of them):
  tune      nonstop tune on the bench directory (inputs of the verify stage)
  storage   nonstop bench storage at several sizes: time to persist vs size
            (PCcheck Fig. 11), torch.save + fsync of the same bytes next to it
  overhead  nonstop bench overhead, the synthetic loop: none, sync, single,
            gpm (direct write and stall), concurrent N = 1..4, at each
            interval (PCcheck Fig. 8 and Fig. 12)
  verify    bench overhead with tune's recommendation (N*, p, b, M, f*):
            is the measured overhead within the target q?
  torch     real PyTorch training of the ~10M GPT (and ~100M in the full
            run): torch.save, DCP async_save, torchsnapshot async_take,
            nonstop concurrent (+ layerwise / multistep when the front end
            accepts those modes), interleaved rounds (bench/suite_torch.py)
  simulate  nonstop simulate on the bundled GCP spot trace, fed with the
            measured rows (PCcheck Fig. 9)
  report    CSV, plots (bench/suite_plots.py) and docs/BENCHMARKS.md

Everything follows DESIGN.md "Measuring on a noisy machine": schemes are
interleaved and repeated, medians with their spread are reported, and the
`none` baseline runs at the start and end of each round (its drift is
printed next to the ratios).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRACE = os.path.join(ROOT, "tests", "data", "gcp_a100_spot_trace.csv")
MiB = 1 << 20

# What each run measures. The quick plan keeps the whole suite under 5 minutes
# on the 2-core development machine; the full one under 30.
PLANS = {
    "quick": {
        "state": 64 * MiB, "step_ms": 50, "q_verify": 0.05,
        "storage_sizes": [16 * MiB, 64 * MiB, 256 * MiB], "storage_rounds": 2,
        "overhead_groups": [([1, 5], 24, 2), ([25], 50, 2)],
        "torch": [("10m", [1, 4], 4, 2, None)],
        "tune_quick": True,
    },
    "full": {
        "state": 128 * MiB, "step_ms": 50, "q_verify": 0.03,
        "storage_sizes": [16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB], "storage_rounds": 3,
        "overhead_groups": [([1, 2, 5, 10], 40, 2), ([25, 50], 100, 2), ([100], 200, 2)],
        # (model, intervals, steps per run at least, rounds, batch x seq override)
        # Longer intervals of the real loops are covered by the simulator from
        # the measured stall and persist times (a 10M step is ~0.5 s here).
        "torch": [("10m", [1, 5], 6, 2, None), ("100m", [5], 8, 1, (4, 64))],
        "tune_quick": False,
    },
}

T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.0f}s] {msg}", flush=True)


def find_cli(given: str | None) -> str:
    for c in ([given] if given else []) + [os.path.join(os.path.dirname(sys.executable),
                                                         "nonstop"),
                                            shutil.which("nonstop") or "",
                                            os.path.join(ROOT, "build", "tools", "nonstop")]:
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("bench/suite.py: no `nonstop` CLI found; run `make build` or pass --cli")


def run_json(cmd: list, what: str) -> dict:
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"bench/suite.py: {what} failed ({' '.join(cmd)}):\n{out.stderr.strip()}")
    res = json.loads(out.stdout)
    res["_seconds"] = time.time() - t0
    return res


def median_spread(xs: list) -> tuple:
    return statistics.median(xs), (max(xs) - min(xs)) if xs else 0.0


# -------------------------------------------------------------------- stages

def stage_tune(args, plan, out: dict) -> None:
    say(f"tune: state {plan['state'] // MiB} MiB, step {plan['step_ms']} ms, "
        f"q = {plan['q_verify']}")
    cmd = [args.cli, "tune", "--dir", args.dir, "--state-bytes", str(plan["state"]),
           "--step-ms", str(plan["step_ms"]), "--max-overhead", str(plan["q_verify"]),
           "--json", "--out", os.path.join(args.out, "tuned-config.json")]
    if plan["tune_quick"]:
        cmd.append("--quick")
    out["tune"] = run_json(cmd, "nonstop tune")
    t = out["tune"]
    say(f"  N*={t['max_in_flight']} p={t['writers']} b={t['chunk_bytes'] // 1024} KiB "
        f"c={t['chunks']} T_w={t['tw_s']:.3f} s f*={t['interval']} ({t['_seconds']:.0f} s)")


def torch_save_seconds(nbytes: int, path: str) -> float:
    """torch.save of one uint8 tensor of nbytes to `path`, then fsync."""
    import torch
    t = torch.ones(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"t": t}, f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def stage_storage(args, plan, out: dict) -> None:
    sizes, rounds = plan["storage_sizes"], plan["storage_rounds"]
    say(f"storage: sizes {[s // MiB for s in sizes]} MiB, {rounds} interleaved rounds")
    per = {s: {"write_s": [], "write_GBps": [], "read_GBps": [], "torch_save_s": []}
           for s in sizes}
    info = {}
    for r in range(rounds):
        for s in sizes:
            j = run_json([args.cli, "bench", "storage", "--dir", args.dir, "--size", str(s),
                          "--repeat", "1", "--json"], "nonstop bench storage")
            per[s]["write_GBps"].append(j["write_GBps"])
            per[s]["read_GBps"].append(j["read_GBps"])
            per[s]["write_s"].append(s / j["write_GBps"] / 1e9)
            per[s]["torch_save_s"].append(torch_save_seconds(s, os.path.join(args.dir, "ts.pt")))
            info = {k: j[k] for k in ("medium", "writers", "chunk_bytes", "copy_engine")}
        say(f"  round {r + 1}/{rounds} done")
    rows = []
    for s in sizes:
        w, ws = median_spread(per[s]["write_s"])
        ts, tss = median_spread(per[s]["torch_save_s"])
        rows.append({"bytes": s, "nonstop_persist_s": w, "nonstop_persist_spread_s": ws,
                     "write_GBps": statistics.median(per[s]["write_GBps"]),
                     "read_GBps": statistics.median(per[s]["read_GBps"]),
                     "torch_save_fsync_s": ts, "torch_save_fsync_spread_s": tss,
                     "rounds": rounds})
    out["storage"] = {"rows": rows, "engine": info}


def stage_overhead(args, plan, out: dict) -> None:
    rows, drifts, groups = [], [], []
    for intervals, steps, repeat in plan["overhead_groups"]:
        say(f"overhead: intervals {intervals}, {steps} steps per run, {repeat} rounds, "
            f"state {plan['state'] // MiB} MiB, step {plan['step_ms']} ms")
        j = run_json([args.cli, "bench", "overhead", "--dir", args.dir, "--json",
                      "--state", str(plan["state"]), "--step-ms", str(plan["step_ms"]),
                      "--interval", ",".join(map(str, intervals)), "--steps", str(steps),
                      "--repeat", str(repeat)], "nonstop bench overhead")
        say(f"  done in {j['_seconds']:.0f} s; none drift max {j['none_drift_max'] * 100:.1f} %")
        for r in j["rows"]:
            if r["scheme"] == "none":
                continue
            r["steps"] = steps
            r["none_drift_max"] = j["none_drift_max"]
            rows.append(r)
        drifts.extend(j["none_drift"])
        groups.append({"intervals": intervals, "steps": steps, "repeat": repeat,
                       "none_steps_per_s": j["rows"][0]["steps_per_s"],
                       "none_drift": j["none_drift"], "medium": j["medium"]})
    none_sps = statistics.median(g["none_steps_per_s"] for g in groups)
    out["overhead"] = {"rows": rows, "groups": groups, "none_steps_per_s": none_sps,
                       "none_drift_max": max(abs(d) for d in drifts) if drifts else 0.0,
                       "state_bytes": plan["state"], "step_ms": plan["step_ms"],
                       "medium": groups[0]["medium"] if groups else ""}


def stage_verify(args, plan, out: dict) -> None:
    t = out.get("tune")
    if t is None:
        say("verify: skipped (no tune result)")
        return
    q = plan["q_verify"]
    f = t["interval"]
    shorter = max(1, f // 4)
    steps = max(60, 3 * f)
    say(f"verify: tune's config (N*={t['max_in_flight']}, p={t['writers']}, "
        f"b={t['chunk_bytes'] // 1024} KiB, M={t['staging_bytes'] // MiB} MiB) at f*={f} and "
        f"f*/4={shorter}, {steps} steps, 2 rounds")
    j = run_json([args.cli, "bench", "overhead", "--dir", args.dir, "--json", "--state",
                  str(plan["state"]), "--step-ms", str(plan["step_ms"]), "--interval",
                  f"{shorter},{f}", "--steps", str(steps), "--repeat", "2", "--schemes",
                  "concurrent", "--max-in-flight", str(t["max_in_flight"]), "--writers",
                  str(t["writers"]), "--chunk", str(t["chunk_bytes"]), "--staging",
                  str(t["staging_bytes"])], "nonstop bench overhead (verify)")
    rows = []
    for r in j["rows"]:
        if r["scheme"] == "none":
            continue
        ovh = 1 - r["relative"]
        stall_ovh = r["stall_ms_mean"] / 1e3 / (r["interval"] / (r["steps_per_s"] or 1))
        rows.append({"interval": r["interval"], "relative": r["relative"],
                     "relative_spread": r["relative_spread"], "overhead": ovh,
                     "stall_ms_mean": r["stall_ms_mean"], "stall_overhead": stall_ovh,
                     "within_q": ovh <= q, "f_star": f})
        say(f"  f={r['interval']}: throughput overhead {ovh * 100:.2f} % (spread "
            f"{r['relative_spread'] * 100:.1f} %), stall {stall_ovh * 100:.2f} %, q = {q * 100:.0f} %")
    out["verify"] = {"q": q, "rows": rows, "none_drift": j["none_drift"], "steps": steps,
                     "config": {k: t[k] for k in ("max_in_flight", "writers", "chunk_bytes",
                                                  "chunks", "staging_bytes", "interval")}}


def stage_torch(args, plan, out: dict) -> None:
    res = out.setdefault("torch", {})
    for model, intervals, steps, rounds, shape in plan["torch"]:
        say(f"torch {model}: intervals {intervals}, >= {steps} steps per run, {rounds} rounds "
            f"(torch threads 1)")
        path = os.path.join(args.out, f"torch-{model}.json")
        cmd = [sys.executable, os.path.join(HERE, "suite_torch.py"), "--model", model,
               "--intervals", *map(str, intervals), "--steps", str(steps), "--rounds",
               str(rounds), "--dir", os.path.join(args.dir, "torch"), "--json", path]
        if shape:
            cmd += ["--batch", str(shape[0]), "--seq", str(shape[1])]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            say(line.rstrip())
        if proc.wait() != 0:
            sys.exit(f"bench/suite.py: {' '.join(cmd)} failed")
        with open(path) as f:
            res[model] = json.load(f)


SIM_KIND = {"none": "none", "torch.save": "sync", "dcp": "single", "torchsnapshot": "single",
            "nonstop": "concurrent", "nonstop-layerwise": "layerwise",
            "nonstop-multistep": "multistep", "sync": "sync", "single": "single", "gpm": "sync",
            "concurrent": "concurrent"}


def stage_simulate(args, plan, out: dict) -> None:
    sims = {}
    restart_s = 1.0
    if "storage" in out:
        # Reloading the synthetic state at the measured read bandwidth.
        bw = statistics.median(r["read_GBps"] for r in out["storage"]["rows"])
        restart_s = plan["state"] / (bw * 1e9)
    if "overhead" in out:
        ov = out["overhead"]
        rows = [{"scheme": "none", "interval": 0, "max_in_flight": 0,
                 "steps_per_s": ov["none_steps_per_s"], "stall_ms_mean": 0.0}]
        for r in ov["rows"]:
            name = r["scheme"] if r["scheme"] != "concurrent" else f"concurrent-n{r['max_in_flight']}"
            rows.append(dict(r, scheme=name))
        # gpm is a sync scheme to the simulator; name it so (kinds come from names).
        for r in rows:
            if r["scheme"] == "gpm":
                r["scheme"] = "sync-gpm"
        path = os.path.join(args.out, "sim-input-synthetic.json")
        with open(path, "w") as f:
            json.dump({"rows": rows}, f)
        say(f"simulate: synthetic loop rows on {os.path.basename(TRACE)} (R = {restart_s:.2f} s)")
        sims["synthetic"] = run_json([args.cli, "simulate", "--trace", TRACE, "--schemes", path,
                                      "--restart-s", f"{restart_s:.4f}", "--json"],
                                     "nonstop simulate")
    for model, res in out.get("torch", {}).items():
        # One description per scheme: its stall per checkpoint and persist time
        # at the longest measured interval (the least queueing), so the
        # simulator can sweep every interval.
        best = {}
        for r in res["rows"]:
            if r["scheme"] == "none":
                continue
            if r["scheme"] not in best or r["interval"] > best[r["scheme"]]["interval"]:
                best[r["scheme"]] = r
        nbytes = max((r.get("ckpt_bytes", 0) for r in res["rows"]), default=0)
        r_model = restart_s
        if nbytes and "storage" in out:
            bw = statistics.median(x["read_GBps"] for x in out["storage"]["rows"])
            r_model = nbytes / (bw * 1e9)
        schemes = [{"name": "ideal"}, {"name": "none"}]
        base_persist = best.get("nonstop", {}).get("persist_s")
        for name, r in best.items():
            kind = SIM_KIND.get(name, "concurrent")
            persist = r.get("persist_s")
            if persist is None and kind == "multistep" and base_persist is not None:
                # Its engine reports no per-checkpoint persist time: model it as
                # SIMULATE.md does, concurrent's plus K = 4 steps of version lag.
                persist = base_persist + 4 * res["none_step_s"]
            desc = {"name": name.replace(".", "-"), "kind": kind,
                    "stall_s": r["stall_per_ckpt_s"],
                    "persist_s": max(persist if persist is not None else 0.0,
                                     r["stall_per_ckpt_s"]),
                    "max_in_flight": int(r.get("max_in_flight", 1)) if kind not in (
                        "sync", "single") else 1}
            if kind == "sync":
                desc["stall_s"] = desc["persist_s"]
            schemes.append(desc)
        doc = {"defaults": {"step_s": res["none_step_s"], "restart_s": r_model},
               "schemes": schemes}
        path = os.path.join(args.out, f"sim-input-torch-{model}.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        say(f"simulate: torch {model} schemes on the trace (R = {r_model:.2f} s)")
        sims[f"torch-{model}"] = run_json([args.cli, "simulate", "--trace", TRACE, "--schemes",
                                           path, "--json"], "nonstop simulate")
    for k, s in sims.items():
        nb = s.get("nonstop_best") or {}
        say(f"  {k}: nonstop best {nb.get('scheme')} f={nb.get('interval')} = "
            f"{nb.get('ratio_to_ideal_best', float('nan')):.3f} x ideal")
    out["simulate"] = sims


# -------------------------------------------------------------------- report

def write_csv(path: str, rows: list) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (list, dict))))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def stage_report(args, plan, out: dict) -> None:
    say(f"report: CSV in {args.out}, plots in {args.img}, {args.docs}")
    if "storage" in out:
        write_csv(os.path.join(args.out, "storage.csv"), out["storage"]["rows"])
    if "overhead" in out:
        write_csv(os.path.join(args.out, "overhead.csv"), out["overhead"]["rows"])
    if "verify" in out:
        write_csv(os.path.join(args.out, "verify.csv"), out["verify"]["rows"])
    for model, res in out.get("torch", {}).items():
        write_csv(os.path.join(args.out, f"torch-{model}.csv"), res["rows"])
    for k, s in out.get("simulate", {}).items():
        write_csv(os.path.join(args.out, f"simulate-{k}.csv"), s["rows"])
    sys.path.insert(0, HERE)
    import suite_docs
    import suite_plots
    os.makedirs(args.img, exist_ok=True)
    figs = suite_plots.render(out, args.img, args.tag)
    if args.docs:
        suite_docs.update(args.docs, out, figs, args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the < 5 minute plan")
    p.add_argument("--only", default="", help="comma list of stages (default: all)")
    p.add_argument("--cli", default=None, help="the nonstop executable")
    p.add_argument("--dir", default=os.path.join(ROOT, "runs", "suite", "work"),
                   help="scratch directory on the file system to measure")
    p.add_argument("--out", default=None, help="JSON/CSV directory (default docs/results/<tag>)")
    p.add_argument("--img", default=os.path.join(ROOT, "docs", "img"))
    p.add_argument("--docs", default=os.path.join(ROOT, "docs", "BENCHMARKS.md"),
                   help="markdown file to update ('' = none)")
    p.add_argument("--reuse", action="store_true",
                   help="start from the saved results.json, rerunning only --only stages")
    args = p.parse_args()
    args.tag = "quick" if args.quick else "full"
    args.out = args.out or os.path.join(ROOT, "docs", "results", args.tag)
    args.cli = find_cli(args.cli)
    plan = PLANS[args.tag]
    stages = ["tune", "storage", "overhead", "verify", "torch", "simulate", "report"]
    only = [s for s in args.only.split(",") if s] or stages
    bad = [s for s in only if s not in stages]
    if bad:
        sys.exit(f"bench/suite.py: unknown stage(s) {bad}; use {','.join(stages)}")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.dir, exist_ok=True)
    results_path = os.path.join(args.out, "results.json")
    out: dict = {}
    if args.reuse and os.path.exists(results_path):
        with open(results_path) as f:
            out = json.load(f)
    out["machine"] = {"cores": os.cpu_count(), "platform": platform.platform(),
                      "python": platform.python_version(), "cli": args.cli,
                      "dir": args.dir, "plan": args.tag}
    try:
        import torch
        out["machine"]["torch"] = torch.__version__
    except ImportError:
        pass
    say(f"nonstop benchmark suite ({args.tag}): stages {','.join(only)}; CLI {args.cli}")
    fns = {"tune": stage_tune, "storage": stage_storage, "overhead": stage_overhead,
           "verify": stage_verify, "torch": stage_torch, "simulate": stage_simulate}
    for st in stages[:-1]:
        if st in only:
            fns[st](args, plan, out)
            out.setdefault("seconds", {})[st] = time.time() - T0
            with open(results_path, "w") as f:
                json.dump(out, f, indent=1, default=str)
    out["total_seconds"] = time.time() - T0
    with open(results_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    if "report" in only:
        stage_report(args, plan, out)
    shutil.rmtree(args.dir, ignore_errors=True)
    say(f"done in {time.time() - T0:.0f} s; results in {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
