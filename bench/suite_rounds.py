"""The measurement loop shared by the PyTorch benchmarks (bench/suite_torch.py,
bench/torch_overhead.py, bench/gpu_overhead.py): checkpointing schemes run
interleaved over one continuing training run, in rounds, each round
bracketed by runs without checkpoints; medians, spreads and the drift of the
`none` baseline come out of summarize().

Imports only the standard library, torch and nonstop (gpu_overhead.py runs
it on a GPU machine with just `PYTHONPATH=build-gpu/pkg`).

Schemes (Saver kinds):
  none                no checkpoints
  torch.save          torch.save of the state dicts to one file (+ fsync
                      unless fsync=False): the call blocks (sync)
  dcp                 torch.distributed.checkpoint.async_save; the previous
                      save's future is awaited before the next (DCP's docs)
  dcp-process         the same with the async_save arguments in
                      DCP_ASYNC_KWARGS["dcp-process"] (gpu_overhead.py: process
                      mode, pinned staging)
  torchsnapshot       torchsnapshot.Snapshot.async_take; likewise
  nonstop             nonstop.Checkpointer, mode concurrent (PCcheck)
  nonstop-layerwise   mode="layerwise" (LightCheck)
  nonstop-multistep   mode="multistep" (GoCkpt)
  nonstop-fullstaging concurrent with a staging pool as large as the state
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import time
import warnings

import torch

import nonstop

NONSTOP_MODES = {"nonstop": "concurrent", "nonstop-layerwise": "layerwise",
                 "nonstop-multistep": "multistep", "nonstop-fullstaging": "concurrent"}
# Extra dcp.async_save arguments per DCP kind (set by the caller).
DCP_ASYNC_KWARGS: dict = {}


def cpu_s() -> float:
    """CPU seconds of this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _dcp_future(x):
    # torch >= 2.9 may return an AsyncSaveResponse (staging + upload futures).
    return getattr(x, "upload_completion", x)


def _state_dicts(state: dict, keys=None) -> dict:
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()
            if keys is None or k in keys}


class Saver:
    """One checkpointing scheme over one state ({"model": m, "optim": o, ...},
    objects with state_dict()) for one run."""

    def __init__(self, kind: str, state: dict, root: str, every: int,
                 nonstop_opts: dict | None = None, fsync: bool = True):
        self.kind, self.every, self.root, self.state, self.fsync = kind, every, root, state, fsync
        self.pending = None            # (start time, future/pending)
        self.persist: list = []
        self.ckpt = None
        self.n = 0
        if kind in NONSTOP_MODES:
            kw = dict(nonstop_opts or {})
            if NONSTOP_MODES[kind] != "concurrent":
                kw["mode"] = NONSTOP_MODES[kind]
            self.ckpt = nonstop.Checkpointer(os.path.join(root, "ckpt"), state, every=every, **kw)
        elif kind not in ("none", "torch.save", "dcp", "dcp-process", "torchsnapshot"):
            raise ValueError(f"unknown scheme {kind!r}")

    def stall_total(self) -> float:
        return self.ckpt.stats()["visible_stall_s"] if self.ckpt is not None else 0.0

    def abandon(self) -> None:
        """After a failure mid-run: lets go of what the scheme holds (its
        engine, pinned staging, threads) without raising again."""
        if self.ckpt is not None:
            try:
                self.ckpt.close()
            except Exception:  # noqa: BLE001 -- the failure itself is what the caller reports
                pass
            self.ckpt = None

    def poll(self) -> None:
        """Notes when an asynchronous save has become durable."""
        if self.pending is not None and self.pending[1].done():
            self.persist.append(time.perf_counter() - self.pending[0])
            self.pending = None

    def finish_pending(self) -> None:
        if self.pending is None:
            return
        t0, fut = self.pending
        if self.kind in ("dcp", "dcp-process"):
            fut.result()
        else:
            fut.wait()
        self.persist.append(time.perf_counter() - t0)
        self.pending = None

    def after_step(self, step: int, force: bool = False) -> float:
        """Checkpoints if due ((step + 1) % every == 0, or `force`); returns
        the stall it caused outside nonstop's own counter (nonstop's visible
        stall, save() plus the optimizer pre-hook's wait, is read from its
        stats)."""
        if self.ckpt is not None:
            started = self.ckpt.step(step)
            # A forced (warm-up) checkpoint; multistep's windows are driven by
            # step() alone.
            if force and started is None and self.kind != "nonstop-multistep":
                self.ckpt.save(step)
            return 0.0
        if self.kind == "none" or (not force and (step + 1) % self.every):
            return 0.0
        t0 = time.perf_counter()
        self.n += 1
        if self.kind == "torch.save":
            path = os.path.join(self.root, f"ckpt{self.n % 2}.pt")
            with open(path, "wb") as f:
                torch.save(_state_dicts(self.state), f)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            self.persist.append(time.perf_counter() - t0)
        elif self.kind in ("dcp", "dcp-process"):
            import torch.distributed.checkpoint as dcp
            self.finish_pending()  # DCP: the previous save must finish first
            t0b = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fut = _dcp_future(dcp.async_save(
                    _state_dicts(self.state, ("model", "optim")),
                    checkpoint_id=os.path.join(self.root, f"step{self.n % 2}"),
                    **DCP_ASYNC_KWARGS.get(self.kind, {})))
            self.pending = (t0b, fut)
        elif self.kind == "torchsnapshot":
            from torchsnapshot import Snapshot
            self.finish_pending()
            t0b = time.perf_counter()
            path = os.path.join(self.root, f"snap{self.n % 2}")
            shutil.rmtree(path, ignore_errors=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pend = Snapshot.async_take(path=path, app_state={
                    k: v for k, v in self.state.items() if k in ("model", "optim")})
            self.pending = (t0b, pend)
        return time.perf_counter() - t0

    def close(self, saves: int = 0) -> dict:
        """Waits for everything in flight; returns persist statistics (over
        the last `saves` checkpoints for nonstop)."""
        out = {}
        if self.ckpt is not None:
            self.ckpt.wait()
            st = self.ckpt.stats()
            rec = [r for r in st.get("recent", []) if r.get("committed")][-max(1, saves):]
            if rec:
                out.update(persist_s=statistics.median(r["persist_s"] for r in rec),
                           copy_s=statistics.median(r.get("copy_s", 0.0) for r in rec),
                           write_GBps=statistics.median(r.get("write_GBps", 0.0) for r in rec),
                           ckpt_bytes=rec[-1].get("bytes", 0))
                # Device snapshots (concurrent mode on a GPU; docs/CUDA.md):
                # per checkpoint, bytes snapshotted on the device and drained
                # later, bytes copied straight to the host, drain seconds.
                if "snapshot_bytes" in rec[-1]:
                    out.update(
                        snapshot_bytes=statistics.median(r["snapshot_bytes"] for r in rec),
                        direct_bytes=statistics.median(r["direct_bytes"] for r in rec),
                        snapshot_drain_s=statistics.median(r["drain_s"] for r in rec))
            if "device_snapshot_note" in st:
                out.update(device_snapshot_capacity=st["device_snapshot_capacity"],
                           device_snapshot_note=st["device_snapshot_note"],
                           snapshot_busy=st["snapshot_busy"])
            if st.get("disk_every", 1) != 1:  # the tiered cadence: what reached the disk
                out.update(disk_every=st["disk_every"], persisted=st.get("persisted", 0),
                           persist_failures=st.get("persist_failures", 0))
            if "mode_auto" in st:  # mode="auto": the mode it runs and the figures why
                out["mode_auto"] = st["mode_auto"]
            out.update(medium=st.get("medium", ""), max_in_flight=st.get("max_in_flight", 1),
                       copy_engine=st.get("copy_engine", ""),
                       hook_stall_s=st.get("hook_stall_s", 0.0))
            self.ckpt.close()
        else:
            self.finish_pending()
            if self.persist:
                out["persist_s"] = statistics.median(self.persist)
        return out


def run_one(kind: str, every: int, steps: int, step_fn, state: dict, root: str, first_step: int,
            *, nonstop_opts: dict | None = None, fsync: bool = True, warmup: int = 0,
            sync=None) -> dict:
    """One run: a warm-up checkpoint of the current state (unmeasured:
    registration, first touch, thread start-up; the first run of a process
    trains a step before it) waited for until durable, `warmup` unmeasured
    steps at the scheme's cadence (multistep: at least one whole window),
    then `steps` measured steps.
    step_fn(s) trains step s; sync() (optional) waits for the device before
    the clock is read. The run's checkpoints are deleted afterwards."""
    root = os.path.join(root, kind.replace(".", "_"), str(every))
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    sync = sync or (lambda: None)
    t_run = time.perf_counter()
    saver = Saver(kind, state, root, max(every, 1), nonstop_opts, fsync)
    try:
        return _run(saver, kind, every, steps, step_fn, root, first_step, warmup, sync, t_run)
    except BaseException:
        saver.abandon()
        shutil.rmtree(root, ignore_errors=True)
        raise


def _run(saver, kind, every, steps, step_fn, root, first_step, warmup, sync, t_run) -> dict:
    s = first_step
    if s == 0:  # the warm-up checkpoint follows a step (later runs: the previous run's)
        step_fn(s)
        s += 1
    saver.after_step(s - 1, force=kind != "none")
    if kind == "nonstop-multistep":
        # Its windows start only from step(): run one whole window (the next
        # multiple of `every`, then its K parts) before measuring.
        warmup = max(warmup, every + int(saver.ckpt.stats().get("parts", 4)))
    for _ in range(warmup):
        step_fn(s)
        saver.after_step(s)
        s += 1
    if saver.ckpt is not None:
        saver.ckpt.wait()
    saver.finish_pending()
    saver.persist.clear()
    sync()
    stall0 = saver.stall_total()
    stall_extra, saves = 0.0, 0
    t_begin, c_begin = time.perf_counter(), cpu_s()
    for _ in range(steps):
        step_fn(s)
        if kind != "none" and (s + 1) % every == 0:
            saves += 1
        stall_extra += saver.after_step(s)
        saver.poll()
        s += 1
    sync()
    wall = time.perf_counter() - t_begin
    cpu = cpu_s() - c_begin
    stall = saver.stall_total() - stall0 + stall_extra
    t0 = time.perf_counter()
    res = {"scheme": kind, "interval": every if kind != "none" else 0, "steps": steps,
           "step_s": wall / steps, "cpu_per_step_s": cpu / steps, "saves": saves,
           "stall_s": stall, "stall_per_step_s": stall / steps,
           "stall_per_ckpt_s": stall / saves if saves else 0.0}
    res.update(saver.close(saves))
    res["drain_s"] = time.perf_counter() - t0  # after the window; not in step_s
    shutil.rmtree(root, ignore_errors=True)
    res["run_s"] = time.perf_counter() - t_run
    res["next_step"] = s
    return res


def run_rounds(groups: list, rounds: int, run, *, log=print, deadline: float | None = None,
               label=None) -> dict:
    """Runs rounds of `groups` (lists of (kind, every)) interleaved:
    none, group 1, none, group 2, ..., none, in every round. run(kind, every)
    does one run and returns its dict, or None when it did not run (a scheme
    that crashed earlier, recorded by the caller). With `deadline` (a time.perf_counter()
    value) no run starts that is predicted (from earlier runs of the same
    scheme and interval, else of the same scheme, else any) to end after it.
    Prints each run with the progress and an ETA. Returns {"runs", "stopped"}."""
    order = []
    for rnd in range(rounds):
        order.append((rnd, "none", 0))
        for g in groups:
            order += [(rnd, k, e) for k, e in g] + [(rnd, "none", 0)]
    label = label or (lambda r: (f"{r['scheme']:<20} f={r['interval']:<3} {r['step_s']:.3f} s/step"
                                 f"  stall/ckpt {r['stall_per_ckpt_s'] * 1e3:8.1f} ms" +
                                 (f"  persist {r['persist_s']:.3f} s" if "persist_s" in r else "")))
    runs, took = [], {}
    stopped = ""

    def guess(kind, every):
        for key in ((kind, every), kind, None):
            if took.get(key):
                return statistics.median(took[key])
        return 0.0

    for i, (rnd, kind, every) in enumerate(order):
        now = time.perf_counter()
        if deadline is not None and now + guess(kind, every) > deadline:
            stopped = (f"time budget: stopped before run {i + 1}/{len(order)} (round {rnd + 1}, "
                       f"{kind} f={every})")
            log(f"  {stopped}")
            break
        r = run(kind, every)
        if r is None:
            log(f"  [{i + 1}/{len(order)}] round {rnd + 1}/{rounds} {kind} f={every}: not run "
                "(crashed earlier, recorded)")
            continue
        r["round"] = rnd
        runs.append(r)
        dt = time.perf_counter() - now
        for key in ((kind, every), kind, None):
            took.setdefault(key, []).append(dt)
        eta = sum(guess(k, e) for _, k, e in order[i + 1:])
        log(f"  [{i + 1}/{len(order)} eta {eta:4.0f} s] round {rnd + 1}/{rounds} " + label(r))
    return {"runs": runs, "stopped": stopped}


def summarize(runs: list) -> tuple:
    """Rows per (scheme, interval): median step time and its spread,
    throughput relative to the median `none` run (median and max - min over
    runs), stall, CPU, persist. Returns (rows, none drift, none step_s)."""
    none = [r["step_s"] for r in runs if r["scheme"] == "none"]
    base = statistics.median(none) if none else float("nan")
    drift = (max(none) - min(none)) / base if len(none) > 1 else 0.0
    rows = []
    for scheme, every in dict.fromkeys((r["scheme"], r["interval"]) for r in runs):
        rs = [r for r in runs if r["scheme"] == scheme and r["interval"] == every]
        st = [r["step_s"] for r in rs]
        med = statistics.median(st)
        rel = [base / x for x in st]
        stall = statistics.median(r["stall_per_step_s"] for r in rs)
        row = {"scheme": scheme, "interval": every, "step_s": med, "steps_per_s": 1.0 / med,
               "relative": statistics.median(rel), "relative_spread": max(rel) - min(rel),
               "spread": (max(st) - min(st)) / med, "throughput_overhead": med / base - 1,
               "runs": len(rs), "steps_measured": sum(r["steps"] for r in rs),
               "ckpts_measured": sum(r["saves"] for r in rs),
               "stall_per_step_s": stall, "stall_overhead": stall / base,
               "stall_per_ckpt_s": statistics.median(r["stall_per_ckpt_s"] for r in rs),
               "cpu_per_step_s": statistics.median(r["cpu_per_step_s"] for r in rs),
               "drain_s": statistics.median(r["drain_s"] for r in rs), "none_drift": drift}
        for k in ("persist_s", "copy_s", "write_GBps", "ckpt_bytes", "max_in_flight"):
            vals = [r[k] for r in rs if k in r]
            if vals:
                row[k] = statistics.median(vals)
        rows.append(row)
    return rows, drift, base
