"""Overhead of checkpointing a PyTorch training loop on a GPU: nonstop
(concurrent, layerwise with copy="host" and "device", multistep) vs
torch.save vs DCP async_save (torch.distributed.checkpoint) in thread mode
and in process mode with pinned staging, every 1, 10 and 50 steps, relative
to no checkpoints. Same model, same state ({"model", "optim"}: fp32 weights
and AdamW moments, on the GPU), same run. Prints a table, writes JSON.

    PYTHONPATH=build-gpu/pkg python3 bench/gpu_overhead.py --json $OUT/gpu_overhead.json
    ... --size 1.4b --max-in-flight 1      # the >= 1B model (16.5 GB of state)
    ... --disk-GBps 2.1                    # fio's O_DIRECT write bandwidth: disk-bound limit
    ... --restore                          # also: restore into CUDA tensors vs DCP load
    ... --device cpu --size tiny           # a check of this script, not a measurement

mode="multistep" runs on CUDA with replay="torch" (docs/MULTISTEP.md,
"Replay"); if it refuses the model, the run records the refusal in the JSON
("refused") instead of a row.

(`make test-gpu` builds nonstop._core and assembles build-gpu/pkg.)

Method (the interleaved-rounds loop of bench/suite_rounds.py, shared with
bench/torch_overhead.py and bench/suite_torch.py; docs/DESIGN.md "Measuring
on a noisy machine"):
- one process, one model; the schemes run interleaved, grouped by interval:
  none, nonstop/1, torch.save/1, dcp/1, none, nonstop/10, ..., none; the
  whole round is repeated --repeats times; the `none` runs give the drift;
- each run continues the same training; it starts with one unmeasured step
  and save (registration, pinning, thread start-up, file creation), then `every`
  warm-up steps (at least 3) with saves at the same cadence, so the window
  starts in steady state; then the measured window of steps (a multiple of
  `every`), timed by wall clock, loss.item() every step (as a logging loop
  does; it also keeps the host from running ahead of the GPU);
- throughput overhead = median step time / median `none` step time - 1;
- visible stall = time the training thread spent blocked in checkpoint calls
  (nonstop: save() and the optimizer pre-hook's wait for the D2H copy;
  torch.save: the call; DCP: async_save (it stages GPU tensors to host
  memory inside the call) plus waiting for the previous save's future);
- after the window, each scheme waits for its last save (drain, not in the
  step time).
Durability differs: nonstop fsyncs before it commits, DCP's FileSystemWriter
fsyncs its files (sync_files=True), torch.save does not fsync.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import nonstop
    from nonstop.demo import GPT
except ImportError:  # run from the repository: python/ holds the package
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import nonstop
    from nonstop.demo import GPT
sys.path.insert(0, HERE)
import suite_rounds  # noqa: E402
from suite_rounds import run_one, run_rounds, summarize  # noqa: E402

CONFIGS = {
    # name: vocab, dim, layers, heads (GPT-2 small / medium shapes)
    "125m": dict(vocab=32768, dim=768, layers=12, heads=12),
    "350m": dict(vocab=32768, dim=1024, layers=24, heads=16),
    "tiny": dict(vocab=1024, dim=128, layers=2, heads=4),
    # >= 1B parameters and >= 16 GB of fp32 weights + AdamW moments:
    # 1.38B parameters, 16.5 GB.
    "1.4b": dict(vocab=32768, dim=2048, layers=26, heads=16),
}
ALL_SCHEMES = ["nonstop", "nonstop-tiered", "nonstop-direct", "nonstop-layerwise",
               "nonstop-layerwise-device", "nonstop-multistep", "nonstop-auto", "torch.save", "dcp",
               "dcp-process"]
# Layer-wise with copy="device" (suite_rounds knows the mode of each nonstop kind).
suite_rounds.NONSTOP_MODES.setdefault("nonstop-layerwise-device", "layerwise")
# The concurrent mode without device snapshots (device_snapshot_bytes=0): the
# stall is the whole device-to-host copy; "nonstop" takes the snapshot (docs/CUDA.md).
suite_rounds.NONSTOP_MODES.setdefault("nonstop-direct", "concurrent")
# The tiered cadence (disk_every="auto", docs/PYTHON.md): every checkpoint
# commits to the memory tier, the disk persists the newest at its own pace;
# with the default device snapshot. Issue 25's overhead targets are its rows.
suite_rounds.NONSTOP_MODES.setdefault("nonstop-tiered", "concurrent")
# mode="auto" (docs/LAYERWISE.md): layer-wise or concurrent, whichever this
# job measures cheaper; tiered like nonstop-tiered, so the two rows differ
# only in the mode. Its warm-up covers the probe (9 checkpoints), so the
# measured window runs the chosen mode; the row records the choice and why.
suite_rounds.NONSTOP_MODES.setdefault("nonstop-auto", "auto")
AUTO_PROBE_CHECKPOINTS = 9


class Training:
    def __init__(self, size: str, batch: int, seq: int, device: str, seed: int = 0):
        torch.manual_seed(seed)
        cfg = dict(CONFIGS[size], seq=seq)
        self.device = device
        self.model = GPT(**cfg).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                     weight_decay=0.1)
        g = torch.Generator(device=device).manual_seed(seed)
        # A small pool of batches, made on the GPU: no host-side data loading.
        self.batches = [torch.randint(0, cfg["vocab"], (batch, seq + 1), device=device,
                                      generator=g) for _ in range(8)]
        self.step_no = 0
        # Layer-wise runs clip inside nonstop (clip_grad_norm=1.0): the
        # gradients are gone once backward has updated the parameters.
        self.clip = True

    def step(self) -> float:
        b = self.batches[self.step_no % len(self.batches)]
        self.step_no += 1
        loss = F.cross_entropy(self.model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def state_bytes(self) -> int:
        seen, n = set(), 0
        for t in list(self.model.state_dict().values()) + [
                v for st in self.opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                n += t.numel() * t.element_size()
        return n


def print_table(rows: list) -> None:
    hdr = (f"{'scheme':<22} {'ms/step':>8} {'spread':>7} {'thru ovh':>9} {'stall/ckpt':>11} "
           f"{'stall ovh':>10} {'drain s':>8} {'copy s':>7} {'persist s':>9} {'GB/s':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:  # crashed or refused: the row says so
            print(f"{r['scheme']:<22} {'crashed' if r.get('crashed') else 'refused'}: "
                  f"{r['error'][:120]}")
            continue
        extra = (f" {r['copy_s']:7.3f} {r['persist_s']:9.3f} {r['write_GBps']:6.2f}"
                 if "copy_s" in r else "")
        print(f"{r['scheme']:<22} {r['step_s'] * 1e3:8.1f} {r['spread'] * 100:6.1f}% "
              f"{r['throughput_overhead'] * 100:8.1f}% {r['stall_per_ckpt_s'] * 1e3:9.1f}ms "
              f"{r['stall_overhead'] * 100:9.2f}% {r['drain_s']:8.2f}" + extra)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="125m", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--schemes", nargs="+", default=ALL_SCHEMES,
                   choices=ALL_SCHEMES + ["nonstop-fullstaging"],
                   help="nonstop-fullstaging: nonstop with staging_bytes >= the state; "
                        "dcp-process: DCP async_save in process mode, pinned staging")
    p.add_argument("--max-in-flight", type=int, default=0,
                   help="nonstop max_in_flight (0: its default); the slot file holds this + 1 "
                        "checkpoints: use 1 for the 1.4b model on a 64 GB disk")
    p.add_argument("--disk-GBps", type=float, default=0,
                   help="O_DIRECT write bandwidth of the checkpoint disk (fio, same machine): "
                        "adds the disk-bound limit (state bytes / bandwidth) to the table")
    p.add_argument("--restore", action="store_true",
                   help="after the rounds: restore into the CUDA tensors (nonstop) vs DCP load")
    p.add_argument("--restore-repeats", type=int, default=3)
    p.add_argument("--measure-disk", metavar="DIR",
                   help="only measure O_DIRECT write bandwidth in DIR (where fio is missing)")
    p.add_argument("--intervals", nargs="+", type=int, default=[1, 10, 50])
    p.add_argument("--runs", nargs="+", default=None, metavar="SCHEME/EVERY",
                   help="exactly these runs (e.g. nonstop-tiered/10 dcp/10) instead of every "
                        "--schemes at every --intervals; grouped by interval in this order")
    p.add_argument("--run-timeout", type=float, default=300,
                   help="a run of a scheme that takes longer is recorded as crashed "
                        "(a hung peer must not eat the device call); 0: none")
    p.add_argument("--steps", type=int, default=8, help="measured steps at interval 1")
    p.add_argument("--periods", type=int, default=3,
                   help="measured saves at intervals > 1 (window = periods * interval, "
                        "at least --min-steps)")
    p.add_argument("--min-steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=0,
                   help="unmeasured steps at the scheme's cadence before the window (default: "
                        "max(3, interval)); the 1.4b run uses fewer to fit a device call")
    p.add_argument("--none-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tf32", type=int, default=1, help="TF32 matmuls (default on)")
    p.add_argument("--out", default="/tmp/nonstop-gpu-bench")
    p.add_argument("--json", default="runs/bench/gpu_overhead.json")
    p.add_argument("--time-budget", type=float, default=0,
                   help="start no run predicted (from the earlier runs of its scheme) to "
                        "end after this many seconds (the table then holds what ran)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a check of this script, not a measurement")
    args = p.parse_args()
    plan = run_plan(args.runs, args.schemes, args.intervals)
    if args.measure_disk:
        return measure_disk(args.measure_disk, args.json)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 0
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    torch.backends.cudnn.allow_tf32 = bool(args.tf32)
    warnings.filterwarnings("ignore", message=r".*(overwrit|torch\.distributed is disabled)")
    os.makedirs(args.out, exist_ok=True)
    schemes = list(dict.fromkeys(k for g in plan for k, _ in g))
    extra = {"refused": {}, "crashed": {}, "restore": None, "disk_GBps": args.disk_GBps or None}
    if "dcp-process" in schemes:
        try:
            dcp_process_setup(args.device)
        except Exception as e:  # noqa: BLE001 -- recorded as its rows; the run goes on
            extra["crashed"]["dcp-process"] = {"interval": 0, "error": one_line(e)}
    tr = Training(args.size, args.batch, args.seq, args.device)
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    params = sum(p.numel() for p in {id(p): p for p in tr.model.parameters()}.values())
    for _ in range(3):
        tr.step()
    state = tr.state_bytes()
    print(f"{dev_name}, torch {torch.__version__}, nonstop build "
          f"{nonstop.build_info()}\nmodel {args.size}: {params / 1e6:.1f}M parameters, batch "
          f"{args.batch} x seq {args.seq}, tf32 {args.tf32}; checkpointed state "
          f"{state / 1e9:.2f} GB (fp32 weights + AdamW moments); dir {args.out}", flush=True)
    staging_full = (state + (64 << 20)) // (4 << 20) * (4 << 20)

    def window(kind: str, every: int) -> int:
        if kind == "none":
            return args.none_steps
        if every == 1:
            return args.steps
        return max(args.min_steps, args.periods * every) // every * every

    runs = []
    full_plan = plan
    if "nonstop-multistep" in schemes:
        why = multistep_refusal(tr, args.out)
        if why is not None:
            print(f"nonstop-multistep: refused on {args.device} ({why}); recorded, not run",
                  flush=True)
            extra["refused"]["nonstop-multistep"] = why
            plan = [[(k, e) for k, e in g if k != "nonstop-multistep"] for g in plan]

    def dump(rows=None):
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "device": dev_name,
                       "params": params, "state_bytes": state, "runs": runs, "rows": rows,
                       "wall_s": time.perf_counter() - t_start, **extra}, f, indent=1)

    def one(kind: str, every: int) -> dict:
        # A staging pool that holds the whole state for nonstop-fullstaging
        # (the default grows to the state's size, capped: docs/CUDA.md).
        opts = {"staging_bytes": staging_full} if kind == "nonstop-fullstaging" else {}
        if kind.startswith("nonstop") and args.max_in_flight:
            opts["max_in_flight"] = args.max_in_flight
        if kind == "nonstop-direct":
            opts["device_snapshot_bytes"] = 0
        if kind in ("nonstop-tiered", "nonstop-auto"):
            opts["disk_every"] = "auto"
        if kind.startswith("nonstop-layerwise") or kind == "nonstop-auto":
            opts["clip_grad_norm"] = 1.0
            if kind.endswith("-device"):
                opts["copy"] = "device"
        if kind in extra["crashed"]:
            return None
        tr.clip = not (kind.startswith("nonstop-layerwise") or kind == "nonstop-auto")
        warmup = (args.warmup or max(3, every)) if kind != "none" else 3
        if kind == "nonstop-auto":
            warmup = max(warmup, AUTO_PROBE_CHECKPOINTS * every)
        try:
            with run_timeout(args.run_timeout if kind != "none" else 0, f"{kind}/{every}"):
                r = run_one(kind, every, window(kind, every), lambda s: tr.step(),
                            {"model": tr.model, "optim": tr.opt}, args.out, tr.step_no,
                            nonstop_opts=opts, fsync=False, sync=tr.sync,
                            warmup=warmup)
        except Exception as e:  # noqa: BLE001 -- a scheme's crash is a result, not the end
            if kind == "none":
                raise  # without the baseline nothing can be measured
            # Any scheme, nonstop's too: its row says it crashed and why, and
            # the rounds go on (issue 25: a DCP crash once lost every row after it).
            why = one_line(e)
            print(f"  {kind}/{every}: crashed ({why}); recorded, its later runs skipped",
                  flush=True)
            extra["crashed"][kind] = {"interval": every, "error": why}
            dump()
            return None
        finally:
            tr.clip = True
        r.pop("next_step")
        r["scheme"] = kind if kind == "none" else f"{kind}/{every}"
        runs.append(r)
        dump()  # what ran so far survives a kill
        return r

    def label(r):
        return (f"{r['scheme']:<22} {r['step_s'] * 1e3:7.1f} ms/step  stall "
                f"{r['stall_per_ckpt_s'] * 1e3:8.1f} ms/ckpt ({r['saves']} saves)  drain "
                f"{r['drain_s']:.2f} s" + (f"  persist {r['persist_s']:.2f} s" if "persist_s" in r
                                           else "")
                + (f", {r['write_GBps']:.2f} GB/s" if "write_GBps" in r else "")
                + (f"  snapshot {r['snapshot_bytes'] / 1e9:.2f} GB + direct "
                   f"{r['direct_bytes'] / 1e9:.2f} GB, drain {r['snapshot_drain_s']:.2f} s"
                   if "snapshot_bytes" in r else "")
                + (f"  [{r['device_snapshot_note']}]" if r.get("device_snapshot_note") else "")
                + (f"  auto: {r['mode_auto']['active']} ({r['mode_auto']['reason']})"
                   if r.get("mode_auto") else ""))

    res = run_rounds(plan, args.repeats, one,
                     label=label, deadline=(t_start + args.time_budget if args.time_budget
                                            else None))
    if res["stopped"]:
        print(f"  --time-budget {args.time_budget:.0f} s: {res['stopped']}")
    rows = summarize(runs)[0]
    # A scheme that crashed (or was refused) is a row too, with its error,
    # at every interval of the plan it did not run.
    done = {(r["scheme"], r["interval"]) for r in rows}
    for g in full_plan:
        for k, e in g:
            why = extra["crashed"].get(k, {}).get("error") or extra["refused"].get(k)
            if why and (f"{k}/{e}", e) not in done:
                rows.append({"scheme": f"{k}/{e}", "interval": e, "error": why,
                             "crashed": k in extra["crashed"]})
    print(f"\n{args.size} ({params / 1e6:.1f}M params, {state / 1e9:.2f} GB state; 'none' drift "
          f"between its runs: {rows[0]['none_drift'] * 100:.1f}%)")
    if args.disk_GBps:
        # At every step the disk is the limit: state bytes / O_DIRECT bandwidth
        # per step (or the step itself, if longer).
        limit = max(state / (args.disk_GBps * 1e9), rows[0]["step_s"])
        extra["disk_bound_step_s"] = limit
        for r in rows:
            if r.get("interval") == 1 and "step_s" in r:
                r["vs_disk_bound"] = r["step_s"] / limit
    print_table(rows)
    if args.disk_GBps:
        print(f"disk-bound step at interval 1: {extra['disk_bound_step_s'] * 1e3:.1f} ms "
              f"({state / 1e9:.2f} GB at {args.disk_GBps:.2f} GB/s O_DIRECT); interval-1 rows: "
              + ", ".join(f"{r['scheme']} {r['vs_disk_bound']:.2f}x" for r in rows
                          if "vs_disk_bound" in r))
    for k, why in extra["refused"].items():
        print(f"{k}: refused ({why})")
    for k, c in extra["crashed"].items():
        print(f"{k}: crashed at its first run of interval {c['interval']} ({c['error']}); "
              "recorded, not measured")
    print("\nthru ovh: median wall time per step vs 'none'; stall ovh: time blocked in "
          "checkpoint calls per step / 'none' step time; spread: (max-min)/median over rounds; "
          "drain: wait for the last save after the window.")
    dump(rows)
    if args.restore:
        extra["restore"] = restore_bench(tr, args.out, args.restore_repeats, args.device)
        dump(rows)
    print(f"wrote {args.json}")
    return 0


def run_plan(runs, schemes, intervals) -> list:
    """The rounds' groups: [[(scheme, every), ...] per interval]. --runs
    "scheme/every ..." gives them exactly (grouped by interval, in order of
    first appearance); else every scheme at every interval."""
    if not runs:
        return [[(k, e) for k in schemes] for e in intervals]
    groups: dict = {}
    for item in runs:
        kind, _, every = item.rpartition("/")
        if kind not in ALL_SCHEMES + ["nonstop-fullstaging"] or not every.isdigit() or \
                int(every) < 1:
            raise SystemExit(f"--runs {item!r}: want SCHEME/EVERY, SCHEME one of "
                             f"{', '.join(ALL_SCHEMES)}")
        groups.setdefault(int(every), []).append((kind, int(every)))
    return list(groups.values())


def one_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]


class run_timeout:
    """A run that takes longer than `seconds` raises TimeoutError in the
    main thread (SIGALRM; a Python-level wait such as a DCP future's is
    interrupted), so a hung scheme becomes a crashed row."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = int(seconds), what

    def _fire(self, *_):
        raise TimeoutError(f"{self.what} ran past --run-timeout {self.seconds} s")

    def __enter__(self):
        if self.seconds > 0:
            self.prev = signal.signal(signal.SIGALRM, self._fire)
            signal.alarm(self.seconds)
        return self

    def __exit__(self, *exc):
        if self.seconds > 0:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, self.prev)
        return False


def measure_disk(d: str, json_path: str, gib: int = 8, threads: int = 4) -> int:
    """Sequential 4 MiB O_DIRECT pwrites from `threads` threads into one
    file of `gib` GiB, then fsync: the bandwidth a checkpoint's writes can
    reach (fio's job, for machines without fio)."""
    import mmap
    import threading
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "disk-probe.dat")
    block = 4 << 20
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    total = gib << 30
    per = total // threads

    def writer(i):
        for off in range(i * per, (i + 1) * per, block):
            os.pwrite(fd, buf, off)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.fsync(fd)
    secs = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    res = {"tool": "python O_DIRECT pwrite", "bytes": total, "threads": threads,
           "block": block, "seconds": secs, "GBps": round(total / secs / 1e9, 3),
           "o_direct": hasattr(os, "O_DIRECT")}
    with open(json_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"O_DIRECT write bandwidth of {d}: {res['GBps']} GB/s ({gib} GiB, {threads} threads)")
    return 0


def dcp_process_setup(device: str) -> None:
    """DCP's process mode needs a process group; one rank, on a HashStore so
    that MASTER_PORT stays free for DCP's checkpoint daemon."""
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    suite_rounds.DCP_ASYNC_KWARGS["dcp-process"] = dcp_process_kwargs(device)


def dcp_process_kwargs(device: str) -> dict:
    """async_save arguments of the process mode with pinned staging, where
    this torch has them (DefaultStager, torch >= 2.9)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    kw = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return kw
    cuda = device == "cuda"
    kw["async_stager"] = DefaultStager(StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
        use_non_blocking_copy=cuda))
    return kw


def multistep_refusal(tr, root: str):
    """None when mode="multistep" accepts this model, else its one-line error."""
    import shutil
    d = os.path.join(root, "multistep-probe")
    shutil.rmtree(d, ignore_errors=True)
    try:
        nonstop.Checkpointer(d, {"model": tr.model, "optim": tr.opt}, mode="multistep").close()
    except nonstop.CheckpointMismatchError as e:
        return str(e)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return None


def restore_bench(tr, root: str, repeats: int, device: str) -> dict:
    """Restore of the whole state into the live (CUDA) tensors: nonstop's
    Checkpointer.restore() vs DCP load into the same state dicts. One
    checkpoint of each, written once; each repeat reads it again (page cache
    dropped first on a GPU machine where allowed: `cold` says whether it
    was). nonstop's time is restore() alone; opening the Checkpointer (engine
    start, staging allocation) is reported apart as nonstop_open_s."""
    import shutil
    import statistics
    import torch.distributed.checkpoint as dcp

    def drop_caches() -> bool:
        if device != "cuda":
            return False  # a shared CPU box: leave its page cache alone
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return True
        except OSError:
            return False

    d = os.path.join(root, "restore")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    state = {"model": tr.model, "optim": tr.opt}
    nbytes = tr.state_bytes()
    # max_in_flight 1: a slot file of 2 checkpoints (33 GB for the 1.4b model).
    with nonstop.Checkpointer(os.path.join(d, "nonstop"), state, every=1 << 30, rng=False,
                              max_in_flight=1) as ck:
        ck.save(tr.step_no)
        ck.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(suite_rounds._state_dicts(state), checkpoint_id=os.path.join(d, "dcp"))
    out = {"bytes": nbytes, "nonstop_s": [], "nonstop_open_s": [], "dcp_s": [], "cold": [],
           # nonstop's split (Checkpointer.stats()): the read and verify, then
           # load_state_dict's copies into the live tensors, and where it read
           "nonstop_read_s": [], "nonstop_apply_s": [], "nonstop_from": [],
           "nonstop_h2d_wait_s": [], "nonstop_h2d_bytes": []}
    for _ in range(repeats):
        for kind in ("nonstop", "dcp"):
            cold = drop_caches()
            tr.sync()
            t0 = time.perf_counter()
            if kind == "nonstop":
                with nonstop.Checkpointer(os.path.join(d, "nonstop"), state, every=1 << 30,
                                          rng=False, max_in_flight=1) as ck:
                    tr.sync()
                    t1 = time.perf_counter()
                    out["nonstop_open_s"].append(t1 - t0)
                    t0 = t1
                    ck.restore()
                    tr.sync()
                    t1 = time.perf_counter()
                    st = ck.stats()
                    out["nonstop_read_s"].append(st.get("restore_read_s"))
                    out["nonstop_apply_s"].append(st.get("restore_apply_s"))
                    out["nonstop_from"].append(st.get("restored_from"))
                    out["nonstop_h2d_wait_s"].append(st.get("restore_h2d_wait_s"))
                    out["nonstop_h2d_bytes"].append(st.get("restore_h2d_bytes"))
            else:
                sd = suite_rounds._state_dicts(state)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.load(sd, checkpoint_id=os.path.join(d, "dcp"))
                tr.opt.load_state_dict(sd["optim"])
                tr.sync()
                t1 = time.perf_counter()
            out[f"{kind}_s"].append(t1 - t0)
            out["cold"].append(cold)
    for kind in ("nonstop", "dcp"):
        med = statistics.median(out[f"{kind}_s"])
        out[f"{kind}_GBps"] = nbytes / med / 1e9
        print(f"restore into {device} tensors: {kind} {med:.2f} s, {out[f'{kind}_GBps']:.2f} GB/s "
              f"(median of {repeats}; page cache dropped: {all(out['cold'])})", flush=True)
    out["nonstop_vs_dcp"] = statistics.median(out["dcp_s"]) / statistics.median(out["nonstop_s"])
    print(f"restore: nonstop {out['nonstop_vs_dcp']:.2f}x DCP load (target >= 1.2x cold); "
          f"nonstop read {out['nonstop_read_s']} s, load_state_dict {out['nonstop_apply_s']} s, "
          f"H2D wait {out['nonstop_h2d_wait_s']} s, from {out['nonstop_from']}", flush=True)
    shutil.rmtree(d, ignore_errors=True)
    out["memory"] = memory_restore(tr, root, repeats, device)
    return out


def memory_restore(tr, root: str, repeats: int, device: str) -> dict:
    """Restore from the memory tier into the live tensors: a checkpoint
    committed only to the memory tier's segment (disk_every: the disk gets
    it at close), restored by the same Checkpointer `repeats` times.
    GB/s = state bytes / restore() wall time; `from` must say "memory"."""
    import shutil
    import statistics
    d = os.path.join(root, "restore-memory")
    shutil.rmtree(d, ignore_errors=True)
    nbytes = tr.state_bytes()
    out = {"bytes": nbytes, "s": [], "from": [], "read_s": [], "h2d_wait_s": [], "error": None}
    try:
        with nonstop.Checkpointer(d, {"model": tr.model, "optim": tr.opt}, every=1 << 30,
                                  rng=False, max_in_flight=1, disk_every=1 << 20,
                                  tier="memory") as ck:
            ck.save(tr.step_no)
            ck.wait()
            for _ in range(repeats):
                tr.sync()
                t0 = time.perf_counter()
                ck.restore()
                tr.sync()
                out["s"].append(time.perf_counter() - t0)
                st = ck.stats()
                out["from"].append(st.get("restored_from"))
                out["read_s"].append(st.get("restore_read_s"))
                out["h2d_wait_s"].append(st.get("restore_h2d_wait_s"))
    except Exception as e:  # noqa: BLE001 -- recorded; the rest of the results stand
        out["error"] = one_line(e)
        print(f"restore from the memory tier: failed ({out['error']})", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if out["s"]:
        out["GBps"] = nbytes / statistics.median(out["s"]) / 1e9
        print(f"restore from the memory tier into {device} tensors: "
              f"{statistics.median(out['s']):.3f} s, {out['GBps']:.2f} GB/s (median of "
              f"{len(out['s'])}; from {out['from']}; target >= 10 GB/s)", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
