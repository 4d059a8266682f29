"""nonstop's benchmark suite: the whole comparison matrix on this machine,
in one command, with JSON, CSV, PNG plots and docs/BENCHMARKS.md updated.

    .venv/bin/python bench/suite.py --quick      # < 5 minutes
    .venv/bin/python bench/suite.py              # the full matrix, < 30 minutes

Stages (each prints progress with its budget and an upper bound on the
suite's end; `--only a,b` runs some of them):
  tune      nonstop tune on the bench directory (inputs of the verify stage)
  storage   nonstop bench storage at several sizes: time to persist vs size
            (PCcheck Fig. 11), torch.save + fsync of the same bytes next to it
  overhead  nonstop bench overhead, the synthetic loop: none, sync, single,
            gpm (direct write and stall), concurrent N = 1..4, at each
            interval (PCcheck Fig. 8 and Fig. 12); one `--repeat 1` run per
            group and round, groups interleaved, rounds combined here
  verify    bench overhead with tune's recommendation (N*, p, b, M, f*):
            is the measured overhead within the target q?
  torch     real PyTorch training of the ~10M GPT (and ~100M in the full
            run): torch.save, DCP async_save, torchsnapshot async_take,
            nonstop concurrent, layerwise and multistep, interleaved rounds
            (bench/suite_torch.py, bench/suite_rounds.py)
  simulate  nonstop simulate on the bundled GCP spot trace, fed with the
            measured rows (PCcheck Fig. 9)
  report    CSV, plots (bench/suite_plots.py) and docs/BENCHMARKS.md

Each stage has a time budget (PLANS[...]["budget"]): it starts no round or
run that it predicts, from the ones it already ran, to end after the budget,
and records what it cut; the tables say how many rounds, steps and
checkpoints each number is built from. The first round of the storage,
overhead and verify stages always runs; the PyTorch runs stop at the budget
even inside the first round (a 100M run can take minutes).

Everything follows DESIGN.md "Measuring on a noisy machine": schemes are
interleaved and repeated, medians with their spread are reported, and the
`none` baseline runs at the start and end of each round (its drift is
printed next to the ratios).
"""
from __future__ import annotations

import argparse
import csv
import json
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

# What each run measures, and the time budget of each stage (seconds). A stage
# starts no piece of work (a round, a run) that it predicts, from the pieces it
# already ran, to end after its budget; what was cut is printed and recorded
# ("stopped"), so the tables say how many rounds each number is built from.
# Budgets sum to < 5 minutes (quick) and < 30 minutes (full) with margin for
# the set-up of each stage; rounds past the first run only if they fit.
PLANS = {
    "quick": {
        "state": 64 * MiB, "step_ms": 50, "q_verify": 0.05,
        "storage_sizes": [16 * MiB, 64 * MiB, 256 * MiB], "storage_rounds": 2,
        # (intervals, steps per run, N values of concurrent); rounds below
        "overhead_groups": [([1, 5], 20, [1, 2, 4]), ([25], 50, [1, 2, 4])],
        "overhead_rounds": 2,
        "verify_steps": 60, "verify_rounds": 2,
        # (model, intervals, steps per run at least, none steps, rounds,
        #  batch x seq override, budget share, multistep parts (0: default))
        "torch": [("10m", [1, 4], 2, 2, 2, None, 1.0, 0)],
        "tune_quick": True,
        "budget": {"tune": 15, "storage": 25, "overhead": 75, "verify": 25, "torch": 95,
                   "simulate": 10, "report": 15},
    },
    "full": {
        "state": 128 * MiB, "step_ms": 50, "q_verify": 0.03,
        "storage_sizes": [16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB], "storage_rounds": 3,
        "overhead_groups": [([1, 2, 5, 10], 30, [1, 2, 3, 4]), ([25, 50], 100, [1, 2, 3, 4]),
                            ([100], 200, [1, 2, 3, 4])],
        "overhead_rounds": 2,
        "verify_steps": 0, "verify_rounds": 2,   # 0: max(60, 3 f*)
        # The ~100M model: batch 4 x seq 32 keeps a step short (6-9 s
        # measured at load 10-16; the checkpointed state, 1.17 GB of fp32
        # weights and AdamW moments, does not depend on the batch); intervals
        # 1 and 4 are measured, longer ones only through the simulator.
        # multistep on 100M with K = 3 parts (its default 7 needs a warm-up
        # window of K + interval steps per run, ~1.5 min here).
        "torch": [("10m", [1, 5, 10], 5, 5, 2, None, 0.4, 0),
                  ("100m", [1, 4], 2, 2, 2, (4, 32), 0.6, 3)],
        "tune_quick": False,
        "budget": {"tune": 45, "storage": 100, "overhead": 420, "verify": 100, "torch": 840,
                   "simulate": 20, "report": 30},
    },
}

T0 = time.time()
STAGE = {"name": "", "t0": T0, "budget": 0.0, "left_after": 0.0}


def say(msg: str) -> None:
    st = STAGE
    eta = ""
    if st["name"]:
        used = time.time() - st["t0"]
        eta = (f" [{st['name']} {used:.0f}/{st['budget']:.0f} s, suite ends in <= "
               f"{max(0.0, st['budget'] - used) + st['left_after']:.0f} s]")
    print(f"[{time.time() - T0:6.0f}s]{eta} {msg}", flush=True)


def stage_deadline() -> float:
    return STAGE["t0"] + STAGE["budget"]


def fits(predicted_s: float) -> bool:
    """Whether a piece of work predicted to take this long ends within the
    stage's budget."""
    return time.time() + predicted_s <= stage_deadline()


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
    say(f"storage: sizes {[s // MiB for s in sizes]} MiB, up to {rounds} interleaved rounds")
    per = {s: {"write_s": [], "write_GBps": [], "read_GBps": [], "torch_save_s": []}
           for s in sizes}
    info, took, stopped = {}, [], ""
    for r in range(rounds):
        if r and not fits(max(took)):
            stopped = f"time budget: {r} of {rounds} rounds"
            say(f"  {stopped}")
            break
        t0 = time.time()
        for s in sizes:
            j = run_json([args.cli, "bench", "storage", "--dir", args.dir, "--size", str(s),
                          "--repeat", "1", "--json"], "nonstop bench storage")
            per[s]["write_GBps"].append(j["write_GBps"])
            per[s]["read_GBps"].append(j["read_GBps"])
            per[s]["write_s"].append(s / j["write_GBps"] / 1e9)
            per[s]["torch_save_s"].append(torch_save_seconds(s, os.path.join(args.dir, "ts.pt")))
            info = {k: j[k] for k in ("medium", "writers", "chunk_bytes", "copy_engine")}
        took.append(time.time() - t0)
        say(f"  round {r + 1}/{rounds} done ({took[-1]:.0f} s)")
    rows = []
    for s in sizes:
        w, ws = median_spread(per[s]["write_s"])
        ts, tss = median_spread(per[s]["torch_save_s"])
        rows.append({"bytes": s, "nonstop_persist_s": w, "nonstop_persist_spread_s": ws,
                     "write_GBps": statistics.median(per[s]["write_GBps"]),
                     "read_GBps": statistics.median(per[s]["read_GBps"]),
                     "torch_save_fsync_s": ts, "torch_save_fsync_spread_s": tss,
                     "rounds": len(per[s]["write_s"])})
    out["storage"] = {"rows": rows, "engine": info, "stopped": stopped}


def combine_rounds(results: list) -> list:
    """Rows of several one-round `bench overhead` runs of the same group:
    per (scheme, interval, N) the median over rounds of each round's ratio to
    its own `none`, and the spread (max - min) of those ratios."""
    by = {}
    for j in results:
        for r in j["rows"]:
            if r["scheme"] != "none":
                by.setdefault((r["scheme"], r["interval"], r["max_in_flight"]), []).append(r)
    rows = []
    for (scheme, interval, n), rs in by.items():
        rel = [r["relative"] for r in rs]
        rows.append({"scheme": scheme, "interval": interval, "max_in_flight": n,
                     "relative": statistics.median(rel), "relative_spread": max(rel) - min(rel),
                     "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
                     "stall_ms_mean": statistics.median(r["stall_ms_mean"] for r in rs),
                     "rounds": len(rs)})
    return rows


def overhead_rounds(args, plan, jobs: list, rounds: int, what: str) -> tuple:
    """Runs `bench overhead --repeat 1` for each job (a list of CLI
    arguments) in turn, round after round (job 1, job 2, ..., job 1, ...),
    while the next one is predicted to fit the stage's budget. Returns
    ([results per job], stopped)."""
    res = [[] for _ in jobs]
    took = [[] for _ in jobs]
    total = rounds * len(jobs)
    for k in range(total):
        r, i = divmod(k, len(jobs))
        guess = statistics.median(took[i]) if took[i] else (
            statistics.median(t for ts in took for t in ts) if k else 0.0)
        if r and not fits(guess):  # the first round of every group always runs
            stopped = (f"time budget: stopped before round {r + 1} of group {i + 1} "
                       f"({k} of {total} runs of `bench overhead` done)")
            say(f"  {stopped}")
            return res, stopped
        t0 = time.time()
        j = run_json([args.cli, "bench", "overhead", "--dir", args.dir, "--json", "--state",
                      str(plan["state"]), "--step-ms", str(plan["step_ms"]), "--repeat", "1",
                      *jobs[i]], what)
        res[i].append(j)
        took[i].append(time.time() - t0)
        left = sum((statistics.median(took[x]) if took[x] else took[i][-1])
                   for x in [(k2 % len(jobs)) for k2 in range(k + 1, total)])
        say(f"  [{k + 1}/{total}] round {r + 1}/{rounds} {' '.join(jobs[i])}: "
            f"{took[i][-1]:.0f} s, none drift {j['none_drift_max'] * 100:.1f} % "
            f"(rest <= {left:.0f} s)")
    return res, ""


def stage_overhead(args, plan, out: dict) -> None:
    groups = plan["overhead_groups"]
    say(f"overhead: state {plan['state'] // MiB} MiB, step {plan['step_ms']} ms, up to "
        f"{plan['overhead_rounds']} rounds of " + "; ".join(
            f"intervals {iv} x {st} steps, N {ns}" for iv, st, ns in groups))
    jobs = [["--interval", ",".join(map(str, iv)), "--steps", str(st), "--max-in-flight",
             ",".join(map(str, ns))] for iv, st, ns in groups]
    res, stopped = overhead_rounds(args, plan, jobs, plan["overhead_rounds"],
                                   "nonstop bench overhead")
    rows, drifts, out_groups = [], [], []
    for (intervals, steps, ns), results in zip(groups, res):
        if not results:
            continue
        g_drift = [d for j in results for d in j["none_drift"]]
        for r in combine_rounds(results):
            r["steps"] = steps
            r["none_drift_max"] = max(abs(d) for d in g_drift)
            rows.append(r)
        drifts.extend(g_drift)
        out_groups.append({"intervals": intervals, "steps": steps, "repeat": len(results),
                           "max_in_flight": ns,
                           "none_steps_per_s": statistics.median(
                               j["rows"][0]["steps_per_s"] for j in results),
                           "none_drift": g_drift, "medium": results[0]["medium"]})
    none_sps = statistics.median(g["none_steps_per_s"] for g in out_groups)
    out["overhead"] = {"rows": rows, "groups": out_groups, "none_steps_per_s": none_sps,
                       "none_drift_max": max(abs(d) for d in drifts) if drifts else 0.0,
                       "state_bytes": plan["state"], "step_ms": plan["step_ms"],
                       "medium": out_groups[0]["medium"] if out_groups else "",
                       "stopped": stopped}


def stage_verify(args, plan, out: dict) -> None:
    t = out.get("tune")
    if t is None:
        say("verify: skipped (no tune result)")
        return
    q = plan["q_verify"]
    f = t["interval"]
    shorter = max(1, f // 4)
    steps = plan["verify_steps"] or max(60, 3 * f)
    rounds = plan["verify_rounds"]
    say(f"verify: tune's config (N*={t['max_in_flight']}, p={t['writers']}, "
        f"b={t['chunk_bytes'] // 1024} KiB, M={t['staging_bytes'] // MiB} MiB) at f*={f} and "
        f"f*/4={shorter}, {steps} steps, up to {rounds} rounds")
    job = ["--interval", f"{shorter},{f}", "--steps", str(steps), "--schemes", "concurrent",
           "--max-in-flight", str(t["max_in_flight"]), "--writers", str(t["writers"]),
           "--chunk", str(t["chunk_bytes"]), "--staging", str(t["staging_bytes"])]
    (results,), stopped = overhead_rounds(args, plan, [job], rounds,
                                          "nonstop bench overhead (verify)")
    rows = []
    for r in combine_rounds(results):
        ovh = 1 - r["relative"]
        stall_ovh = r["stall_ms_mean"] / 1e3 / (r["interval"] / (r["steps_per_s"] or 1))
        rows.append({"interval": r["interval"], "relative": r["relative"],
                     "relative_spread": r["relative_spread"], "overhead": ovh,
                     "stall_ms_mean": r["stall_ms_mean"], "stall_overhead": stall_ovh,
                     "within_q": ovh <= q, "f_star": f, "rounds": r["rounds"]})
        say(f"  f={r['interval']}: throughput overhead {ovh * 100:.2f} % (spread "
            f"{r['relative_spread'] * 100:.1f} %), stall {stall_ovh * 100:.2f} %, q = {q * 100:.0f} %")
    out["verify"] = {"q": q, "rows": rows, "steps": steps, "rounds": len(results),
                     "none_drift": [d for j in results for d in j["none_drift"]],
                     "stopped": stopped,
                     "config": {k: t[k] for k in ("max_in_flight", "writers", "chunk_bytes",
                                                  "chunks", "staging_bytes", "interval")}}


def stage_torch(args, plan, out: dict) -> None:
    res = out.setdefault("torch", {})
    start = time.time()
    for model, intervals, steps, none_steps, rounds, shape, share, parts in plan["torch"]:
        # This model's share of what is left of the stage's budget.
        left = stage_deadline() - time.time()
        shares_left = sum(x[6] for x in plan["torch"][[x[0] for x in plan["torch"]].index(model):])
        budget = max(30.0, left * share / shares_left)
        say(f"torch {model}: intervals {intervals}, >= {steps} steps and >= 1 checkpoint per run, "
            f"up to {rounds} rounds, budget {budget:.0f} s (torch threads 1)")
        path = os.path.join(args.out, f"torch-{model}.json")
        cmd = [sys.executable, os.path.join(HERE, "suite_torch.py"), "--model", model,
               "--intervals", *map(str, intervals), "--steps", str(steps), "--none-steps",
               str(none_steps), "--min-ckpts", "1", "--rounds", str(rounds), "--budget-s",
               f"{budget:.0f}", "--dir", os.path.join(args.dir, "torch"), "--json", path,
               # The same budget counted from now: torch's import and the model's
               # set-up count too; a few seconds kept for writing the JSON.
               "--deadline", f"{time.time() + budget - 3:.1f}"]
        if shape:
            cmd += ["--batch", str(shape[0]), "--seq", str(shape[1])]
        if parts:
            cmd += ["--parts", str(parts)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            say(line.rstrip())
        if proc.wait() != 0:
            sys.exit(f"bench/suite.py: {' '.join(cmd)} failed")
        with open(path) as f:
            res[model] = json.load(f)
    say(f"torch: {time.time() - start:.0f} s")


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
    out["total_seconds"] = time.time() - T0


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
    # With --reuse the earlier run's load averages stay (its stages' numbers stay too).
    out["machine"] = dict(out.get("machine", {}), cores=os.cpu_count(),
                          platform=platform.platform(), python=platform.python_version(),
                          cli=args.cli, dir=args.dir, plan=args.tag)
    try:
        import torch
        out["machine"]["torch"] = torch.__version__
    except ImportError:
        pass
    if not args.reuse or "load_start" not in out["machine"]:
        out["machine"]["load_start"] = os.getloadavg()
    budget = plan["budget"]
    say(f"nonstop benchmark suite ({args.tag}): stages {','.join(only)}; CLI {args.cli}; "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; budget "
        f"{sum(budget[s] for s in only):.0f} s")
    fns = {"tune": stage_tune, "storage": stage_storage, "overhead": stage_overhead,
           "verify": stage_verify, "torch": stage_torch, "simulate": stage_simulate,
           "report": stage_report}
    secs = out.setdefault("seconds", {})
    loads = out.setdefault("load", {})
    for i, st in enumerate(stages):
        if st not in only:
            continue
        STAGE.update(name=st, t0=time.time(), budget=budget[st],
                     left_after=sum(budget[x] for x in stages[i + 1:] if x in only))
        if st == "report":
            out["total_seconds"] = time.time() - T0
            if not args.reuse or "load_end" not in out["machine"]:
                out["machine"]["load_end"] = os.getloadavg()
            with open(results_path, "w") as f:
                json.dump(out, f, indent=1, default=str)
        fns[st](args, plan, out)
        secs[st] = time.time() - STAGE["t0"]
        loads[st] = os.getloadavg()[0]
        with open(results_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    STAGE["name"] = ""
    out["total_seconds"] = time.time() - T0
    with open(results_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    say("seconds per stage (budget; 1-min load average at its end): " + ", ".join(
        f"{st} {secs[st]:.0f} ({budget[st]}; {loads[st]:.1f})" for st in stages if st in only
        and st in secs))
    shutil.rmtree(args.dir, ignore_errors=True)
    say(f"done in {time.time() - T0:.0f} s; results in {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
