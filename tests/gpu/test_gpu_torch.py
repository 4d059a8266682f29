"""PyTorch GPU checks for nonstop, run by `make test-gpu` with the GPU
machine's python3 when torch sees a CUDA device.

1. Stream handles: what the front end passes to the engine
   (tensor.data_ptr(), the device index, torch.cuda.current_stream().cuda_stream)
   is what the engine expects.
2. GPU training resume: a small GPT on CUDA, AdamW, a LambdaLR schedule and
   dropout, checkpointed by nonstop.Checkpointer (concurrent mode) every
   EVERY steps. The training subprocess is killed with SIGKILL twice
   mid-run and restarted; each restart restores the newest checkpoint
   (weights, AdamW state, schedule, CPU and CUDA RNG) and goes on. The final
   weights, optimizer state, schedule, RNG states and the losses after each
   restore must equal, bit for bit, an uninterrupted run without
   checkpoints on the same GPU. Deterministic kernels are forced
   (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, the
   math attention kernel, no TF32), fixed seeds.
3. Layer-wise on CUDA (copy="host" and "device"): each parameter's next
   update waits for its copy on the GPU stream (an event), not on the host;
   every committed checkpoint holds, bit for bit, each tensor's value at its
   step (references cloned on the stream at that step).
4. mode="multistep" on CUDA (replay="torch", docs/MULTISTEP.md "Replay"):
   a. the same GPT run as 2., checkpointed by multistep (K = 4, 1 MiB blocks
      so parts split tensors), SIGKILLed twice (once inside a window) and
      resumed: final state and losses bitwise equal to the uninterrupted run;
   b. in one process, AdamW (foreach default, fused, foreach=False) and SGD
      nesterov (foreach), K = 2 and 4: restore() of each window's checkpoint
      into fresh objects (the parts replayed with the training optimizer on
      the GPU) equals the live state at its version bit for bit;
   c. replay="host" with CUDA parameters is refused with one line.
5. Device snapshots of concurrent checkpoints (device_snapshot_bytes: the
   default, a third of the state, 0), one and two in flight: every
   committed checkpoint holds, bit for bit, each tensor's value at its
   step although the next step updates the tensors while the snapshot
   drains; on CUDA the stats say what was snapshotted and sent straight.

    PYTHONPATH=<dir holding nonstop with _core> python3 tests/gpu/test_gpu_torch.py
    ... --device cpu     # the same harness on CPU (to check it without a GPU)

6. Restore into CUDA tensors (restore_device_test): Checkpointer.restore()
   from the disk and from the memory tier reads through the C++ restore
   path into pinned buffers and copies host-to-device; bit for bit, in
   place, every byte counted in restore_h2d_bytes.

The resume tests (2., 4a.) run their training processes beside the other
checks, to fit one device call.

Exit 0 = passed or skipped (a line says SKIP and why), 1 = failed.
Hard timeouts: each training process 180 s, the whole file 540 s (--timeout).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

STEPS, EVERY = 40, 4
KILL_AFTER = (13, 27)  # SIGKILL once a step >= this is reported and a checkpoint exists
PROC_TIMEOUT_S, TOTAL_TIMEOUT_S = 180, 540
CFG = dict(vocab=4096, dim=256, layers=4, heads=8, seq=64, batch=8)
CPU_CFG = dict(vocab=256, dim=64, layers=2, heads=4, seq=32, batch=4)  # --device cpu


# ------------------------------------------------------------------ the worker

def _deterministic(torch, device: str) -> None:
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device == "cuda":
        # The math attention kernel: flash / memory-efficient backward
        # kernels are not deterministic.
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)


MS_PARTS, MS_BLOCK_BYTES = 4, 1 << 20  # multistep: K, and blocks small enough to split tensors


def worker(args) -> int:
    import torch
    import torch.nn.functional as F
    from nonstop.demo import GPT, batch_for_step

    cfg = CFG
    if args.device == "cpu":  # a check of the harness, not of the GPU path
        torch.set_num_threads(2)
        cfg = CPU_CFG
    _deterministic(torch, args.device)
    dev = torch.device(args.device)
    torch.manual_seed(1234)
    if args.device == "cuda":
        torch.cuda.manual_seed_all(1234)
    model = GPT(**cfg).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=2e-3,
                            betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 8) * 0.97 ** s)
    ckpt, start = None, 0
    if args.ckpt_dir:
        import nonstop
        extra = {}
        if args.mode == "multistep":
            from nonstop import _multistep
            _multistep.BLOCK_BYTES = MS_BLOCK_BYTES
            extra = {"parts": MS_PARTS, "replay": "torch"}
        ckpt = nonstop.Checkpointer(args.ckpt_dir, {"model": model, "optim": opt, "sched": sched},
                                    every=EVERY, mode=args.mode, **extra)
        restored = ckpt.restore()
        start = 0 if restored is None else restored + 1
        print(json.dumps({"event": "start", "restored": restored,
                          "copy_engine": ckpt.stats().get("copy_engine")}), flush=True)
    losses = {}
    for step in range(start, STEPS):
        x, y = (t.to(dev) for t in batch_for_step(cfg, step))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses[step] = loss.item()  # syncs: the kill lands between steps or in a save
        latest = None
        if ckpt is not None:
            ckpt.step(step)
            latest = ckpt.latest()
        print(json.dumps({"event": "step", "step": step, "latest": latest}), flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    stats = None
    if ckpt is not None:
        ckpt.wait()
        st = ckpt.stats()
        stats = {k: st.get(k) for k in ("committed", "failed", "visible_stall_s", "copy_engine")}
        ckpt.close()
    final = {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
             "optim": _to_cpu(opt.state_dict()), "sched": sched.state_dict(),
             "cpu_rng": torch.get_rng_state(), "losses": losses, "start": start}
    if args.device == "cuda":
        final["cuda_rng"] = torch.cuda.get_rng_state()
    _save_final(final, args.final)
    print(json.dumps({"event": "done", "stats": stats}), flush=True)
    return 0


def _save_final(final: dict, path: str) -> None:
    """Tensors to safetensors, the rest to JSON (nonstop's own flattening): no pickle."""
    from safetensors.torch import save_file

    from nonstop import _state
    tensors: dict = {}
    tree = _state.flatten(final, "final", tensors)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path + ".safetensors")
    with open(path + ".json", "w") as f:
        f.write(_state.dumps(tree))


def _load_final(path: str) -> dict:
    from safetensors.torch import load_file

    from nonstop import _state
    with open(path + ".json") as f:
        tree = _state.loads(f.read())
    return _state.unflatten(tree, load_file(path + ".safetensors"))


def _to_cpu(x):
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


# ------------------------------------------------------------------ the parent

def run_worker(args, tmp: str, name: str, ckpt_dir: str | None, kill_after: int | None,
               step_sleep: float, mode: str = "concurrent") -> dict:
    """Runs one training process; SIGKILLs it once it reports a step >=
    kill_after with a committed checkpoint. Returns what it reported."""
    final = os.path.join(tmp, f"final-{name}")  # .safetensors + .json
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--device", args.device,
           "--final", final, "--step-sleep", str(step_sleep)]
    if ckpt_dir:
        cmd += ["--ckpt-dir", ckpt_dir, "--mode", mode]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put("")],
                              daemon=True)
    reader.start()
    got = {"name": name, "steps": [], "killed_after": None, "final": final, "start": None}
    try:
        while True:
            left = PROC_TIMEOUT_S - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(f"{name}: training process ran past {PROC_TIMEOUT_S} s")
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if not line:
                break
            ev = json.loads(line)
            if ev["event"] == "start":
                got["start"] = ev
            elif ev["event"] == "step":
                got["steps"].append(ev["step"])
                if (kill_after is not None and ev["step"] >= kill_after
                        and ev["latest"] is not None):
                    os.kill(proc.pid, signal.SIGKILL)
                    got["killed_after"] = ev["step"]
                    break
            elif ev["event"] == "done":
                got["done"] = ev
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got["rc"] = rc
    got["wall_s"] = time.monotonic() - t0
    if got["killed_after"] is None and rc != 0:
        raise RuntimeError(f"{name}: training process failed with exit status {rc}")
    return got


def compare(torch, a: dict, b: dict, where: str = "") -> list:
    """Paths where a and b differ (tensors bitwise, incl. dtype and shape)."""
    out = []
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8),
                                b.reshape(-1).view(torch.uint8))):
            out.append(where)
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.append(f"{where} keys {sorted(map(str, set(a) ^ set(b)))[:3]}")
        for k in a:
            if k in b:
                out += compare(torch, a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where} length")
        for i, (x, y) in enumerate(zip(a, b)):
            out += compare(torch, x, y, f"{where}/{i}")
    elif not (a == b or (a != a and b != b)):
        out.append(where)
    return out


def check_streams(torch) -> None:
    stream = torch.cuda.current_stream()
    # torch's default stream is the legacy default stream, handle 0; the
    # engine treats 0 as "order after the legacy default stream".
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, "
          f"current_stream handle {stream.cuda_stream:#x}")
    assert isinstance(stream.cuda_stream, int)
    with torch.cuda.stream(torch.cuda.Stream()):
        assert torch.cuda.current_stream().cuda_stream != 0
    print("PASS stream handles")


def resume_test(args, torch, mode: str = "concurrent") -> bool:
    tmp = tempfile.mkdtemp(prefix=f"nonstop-gpu-resume-{mode}-")
    try:
        ckpt_dir = os.path.join(tmp, "ckpt")
        ref = run_worker(args, tmp, "reference", None, None, 0.0)
        print(f"reference: {len(ref['steps'])} steps without checkpoints, "
              f"{ref['wall_s']:.1f} s")
        runs = []
        for i, kill_after in enumerate(KILL_AFTER + (None,)):
            r = run_worker(args, tmp, f"part{i}", ckpt_dir, kill_after, args.step_sleep, mode)
            runs.append(r)
            start = r["start"] or {}
            print(f"part {i}: restored step {start.get('restored')}, ran steps "
                  f"{r['steps'][0] if r['steps'] else '-'}..{r['steps'][-1] if r['steps'] else '-'}"
                  + (f", SIGKILLed after step {r['killed_after']}" if r["killed_after"] is not None
                     else ", finished") + f" ({r['wall_s']:.1f} s); engine: "
                  f"{start.get('copy_engine')}")
        ok = True
        if args.device == "cuda" and "cuda" not in str((runs[0]["start"] or {}).get("copy_engine",
                                                                                    "")).lower():
            print("FAIL the engine did not use the CUDA copy engine")
            ok = False
        if any(r["killed_after"] is None for r in runs[:-1]):
            print("FAIL a training process finished before it could be killed")
            ok = False
        restored = [(r["start"] or {}).get("restored") for r in runs]
        if restored[0] is not None or any(x is None for x in restored[1:]):
            print(f"FAIL unexpected restore points {restored}")
            ok = False
        a = _load_final(ref["final"])
        b = _load_final(runs[-1]["final"])
        diffs = compare(torch, {k: a[k] for k in a if k not in ("losses", "start")},
                        {k: b[k] for k in b if k not in ("losses", "start")})
        # Losses after the last restore, bitwise (floats from .item()).
        lost = [s for s, v in b["losses"].items() if a["losses"].get(s) != v]
        if diffs or lost:
            ok = False
            print(f"FAIL resumed run differs from the uninterrupted one: {len(diffs)} entries, "
                  f"e.g. {diffs[:5]}; losses differ at steps {lost[:5]}")
            again = run_worker(args, tmp, "reference2", None, None, 0.0)
            c = _load_final(again["final"])
            if compare(torch, {k: a[k] for k in a if k != "start"},
                       {k: c[k] for k in c if k != "start"}):
                print("  (two uninterrupted runs differ too: training is not deterministic here)")
        else:
            n = sum(t.numel() for t in a["model"].values())
            rngs = "CPU+CUDA" if args.device == "cuda" else "CPU"
            print(f"PASS GPU training resume ({mode}): killed after steps {KILL_AFTER[0]}+ and "
                  f"{KILL_AFTER[1]}+, restored {restored[1:]}; final weights ({n} values), AdamW "
                  f"state, schedule, {rngs} RNG and {len(b['losses'])} losses after the last "
                  f"restore are bitwise equal to the uninterrupted run")
        return ok
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _flat(torch, model, opt) -> dict:
    """Every tensor of the model and the optimizer, cloned (on the stream,
    so the clone is the value at this point of the step), by state name."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optim/state/{pid}/{k}"] = v.detach().clone()
    return out


def _train_and_check(torch, dev: str, tmp: str, model, opt, what: str, **ck_kwargs):
    """Twelve AdamW steps of `model` with a checkpoint every 2 (Checkpointer
    keywords `ck_kwargs`); each committed checkpoint must hold, bit for bit,
    every tensor's value at its step (references cloned on the stream).
    Returns (ok, checkpoints checked, stats, wall seconds)."""
    import nonstop
    refs = {}
    t0 = time.perf_counter()
    with nonstop.Checkpointer(tmp, {"model": model, "optim": opt}, every=2, rng=False,
                              **ck_kwargs) as ck:
        for s in range(12):
            x = torch.randn(64, 1024, device=dev)
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if (s + 1) % 2 == 0:
                refs[s] = _flat(torch, model, opt)
            ck.step(s)
        ck.wait()
        stats = ck.stats()
    wall = time.perf_counter() - t0
    ok, checked = True, 0
    for c in nonstop._core.Reader(tmp).checkpoints:
        if not c["committed"] or c["step"] not in refs:
            continue
        loaded = nonstop.load(tmp, step=c["step"])
        for name, t in refs[c["step"]].items():
            got = loaded.tensors[name].reshape(-1).view(torch.uint8)
            if not torch.equal(got, t.cpu().reshape(-1).view(torch.uint8)):
                print(f"FAIL {what}: {name} of the checkpoint of step {c['step']} is not its "
                      "step value")
                ok = False
                break
        checked += 1
    if checked == 0 or stats.get("failed"):
        print(f"FAIL {what}: {checked} checkpoints checked, {stats.get('failed')} failed")
        ok = False
    return ok, checked, stats, wall


def _mlp(torch, dev: str):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(6)]
    model = torch.nn.Sequential(*[m for l in layers for m in (l, torch.nn.Tanh())]).to(dev)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def layerwise_test(args, torch) -> bool:
    """Layer-wise checkpoints of CUDA tensors: every committed checkpoint
    holds each tensor's value at its step. The copies are made to lag (a
    small staging pool on a real file, several in flight), so an update that
    did not wait for its copy on the stream would show."""
    ok = True
    dev = args.device
    for copy in ("host", "device"):
        tmp = tempfile.mkdtemp(prefix=f"nonstop-gpu-layerwise-{copy}-")
        try:
            model, opt = _mlp(torch, dev)
            good, checked, stats, wall = _train_and_check(
                torch, dev, tmp, model, opt, f"layerwise copy={copy}", mode="layerwise",
                copy=copy, max_in_flight=2, chunk_bytes=1 << 20, staging_bytes=8 << 20, writers=2)
            ok = good and ok
            engine = str(stats.get("copy_engine", ""))
            if dev == "cuda" and "cuda" not in engine.lower():
                print(f"FAIL layerwise copy={copy}: copy engine is {engine!r}")
                ok = False
            elif good:
                print(f"PASS layerwise on {dev}, copy={copy}: {checked} checkpoints hold their "
                      f"step values bit for bit ({wall:.1f} s, visible stall "
                      f"{stats.get('visible_stall_s', float('nan')):.3f} s)")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ok


def device_snapshot_test(args, torch) -> bool:
    """Concurrent checkpoints with device snapshots (docs/CUDA.md): each
    committed checkpoint holds its step's values, for a budget that holds
    everything, a third of the state, and none; with two in flight too."""
    ok = True
    dev = args.device
    model, opt = _mlp(torch, dev)
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    for budget, in_flight in ((None, 1), (None, 2), (state_bytes // 3, 1), (0, 1)):
        tmp = tempfile.mkdtemp(prefix="nonstop-gpu-dsnap-")
        what = f"device snapshot device_snapshot_bytes={budget} max_in_flight={in_flight}"
        try:
            good, checked, stats, wall = _train_and_check(
                torch, dev, tmp, model, opt, what, max_in_flight=in_flight,
                device_snapshot_bytes=budget, chunk_bytes=1 << 20)
            ok = good and ok
            note = stats.get("device_snapshot_note", "")
            snap, direct = stats.get("snapshot_bytes_total", 0), stats.get("direct_bytes_total", 0)
            if dev == "cuda":
                want = {None: "on", 0: "off"}.get(budget, "partial")
                if not note.startswith(want) or (want != "off") != (snap > 0) or \
                        (want != "on" and direct == 0):
                    print(f"FAIL {what}: note {note!r}, snapshot {snap} B, direct {direct} B")
                    ok = good = False
            if good:
                print(f"PASS {what} on {dev}: {checked} checkpoints hold their step values bit "
                      f"for bit ({wall:.1f} s, visible stall "
                      f"{stats.get('visible_stall_s', float('nan')):.3f} s, snapshot {snap} B, "
                      f"direct {direct} B, drain {stats.get('drain_s_total', 0):.3f} s, busy "
                      f"{stats.get('snapshot_busy', 0)}; {note or 'no device tensors'})")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ok


def restore_device_test(args, torch) -> bool:
    """Checkpointer.restore() into the live CUDA tensors through the C++
    restore path (docs/CUDA.md "Restore into CUDA tensors"): chunks read
    into pinned buffers, verified, then copied host-to-device while the next
    are read; from the job directory (a new Checkpointer) and from the
    memory tier (the same one, disk_every: the checkpoint is only in
    memory). Every tensor must come back bit for bit, in place (the same
    storage), and on CUDA stats() must count every byte as copied to the
    device (restore_h2d_bytes)."""
    import nonstop
    ok = True
    dev = args.device
    for where in ("disk", "memory"):
        tmp = tempfile.mkdtemp(prefix=f"nonstop-gpu-restore-{where}-")
        try:
            model, opt = _mlp(torch, dev)
            kw = dict(every=1 << 30, rng=False, chunk_bytes=1 << 20)
            if where == "memory":
                kw.update(disk_every=1 << 20, tier="memory")
            ck = nonstop.Checkpointer(tmp, {"model": model, "optim": opt}, **kw)
            x = torch.randn(64, 1024, device=dev)
            for s in range(5):
                opt.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                opt.step()
                if s == 2:
                    ck.save(s)
                    ck.wait()
                    truth = {k: v.cpu() for k, v in _flat(torch, model, opt).items()}
            ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
            if where == "disk":
                ck.close()
                ck = nonstop.Checkpointer(tmp, {"model": model, "optim": opt}, **kw)
            t0 = time.perf_counter()
            got = ck.restore()
            if dev == "cuda":
                torch.cuda.synchronize()
            took = time.perf_counter() - t0
            st = ck.stats()
            ck.close()
            now = _flat(torch, model, opt)
            bad = [k for k, v in truth.items()
                   if not torch.equal(now[k].cpu().reshape(-1).view(torch.uint8),
                                      v.reshape(-1).view(torch.uint8))]
            moved = [k for k, v in model.state_dict().items() if v.data_ptr() != ptrs[k]]
            dev_bytes = sum(v.numel() * v.element_size() for v in now.values()
                            if v.device.type == "cuda")
            h2d = st.get("restore_h2d_bytes", 0)
            want_h2d = dev_bytes if dev == "cuda" else 0
            if got != 2 or bad or moved or st.get("restored_from") != where or h2d != want_h2d:
                ok = False
                print(f"FAIL restore into {dev} tensors from {where}: step {got}, "
                      f"{len(bad)} tensors differ (e.g. {bad[:3]}), {len(moved)} moved, from "
                      f"{st.get('restored_from')!r}, restore_h2d_bytes {h2d} (want {want_h2d})")
            else:
                print(f"PASS restore into {dev} tensors from {where}: {len(truth)} tensors bit "
                      f"for bit, in place, {h2d} B copied to the device ({took:.3f} s; read "
                      f"{st.get('restore_read_s', 0):.3f} s, H2D wait "
                      f"{st.get('restore_h2d_wait_s', 0):.3f} s)")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ok


MS_CASES = (  # (name, optimizer factory)
    ("adamw-foreach-default", lambda torch, ps: torch.optim.AdamW(ps, lr=2e-3, weight_decay=0.1)),
    ("adamw-fused", lambda torch, ps: torch.optim.AdamW(ps, lr=2e-3, weight_decay=0.1, fused=True)),
    ("adamw-single", lambda torch, ps: torch.optim.AdamW(ps, lr=2e-3, foreach=False)),
    ("sgd-nesterov-foreach", lambda torch, ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                                nesterov=True, foreach=True)),
)


def multistep_exact(args, torch) -> bool:
    """4b: every window's checkpoint, restored (replayed on the device), is
    the live state at its version bit for bit."""
    import nonstop
    from nonstop import _multistep
    _multistep.BLOCK_BYTES = 64 << 10  # 16 Ki elements: tensors straddle parts
    dev = torch.device(args.device)
    ok = True
    for name, make_opt in MS_CASES:
        for parts in (2, 4):
            tmp = tempfile.mkdtemp(prefix="nonstop-gpu-multistep-")
            try:
                def build():
                    torch.manual_seed(7)
                    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(),
                                                torch.nn.Linear(512, 256), torch.nn.GELU(),
                                                torch.nn.Linear(256, 8)).to(dev)
                    opt = make_opt(torch, list(model.parameters()))
                    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 6))
                    return model, opt, sched

                def live(model, opt):
                    out = {f"m/{k}": v.detach().cpu().clone() for k, v in
                           model.state_dict().items()}
                    for i, st in opt.state_dict()["state"].items():
                        out.update({f"o/{i}/{k}": v.detach().cpu().clone()
                                    for k, v in st.items() if torch.is_tensor(v)})
                    return out
                model, opt, sched = build()
                ck = nonstop.Checkpointer(tmp, {"model": model, "optim": opt, "sched": sched},
                                          every=5, mode="multistep", parts=parts, replay="torch",
                                          keep=1)  # every window's checkpoint stays
                g = torch.Generator(device=dev).manual_seed(3)
                x = torch.randn(64, 64, device=dev, generator=g)
                y = torch.randn(64, 8, device=dev, generator=g)
                truth = {}
                for s in range(16):
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x + 0.01 * s), y).backward()
                    opt.step()
                    sched.step()
                    ck.step(s)
                    truth[s] = live(model, opt)
                ck.wait()
                versions = [w["version"] for w in ck.stats()["recent"]
                            if w["counter"] and not w["error"]]
                ck.close()
                bad = []
                for v in reversed(versions):  # restoring one abandons those after it
                    model, opt, sched = build()
                    ck = nonstop.Checkpointer(tmp, {"model": model, "optim": opt, "sched": sched},
                                              every=5, mode="multistep", parts=parts,
                                              replay="torch")
                    try:
                        got = ck.restore(v)
                    finally:
                        ck.close()
                    bad += [f"{v}:{k}" for k in compare(torch, live(model, opt), truth[v])]
                if not versions or bad:
                    ok = False
                    print(f"FAIL multistep {name} K={parts} on {args.device}: versions {versions}, "
                          f"restored {got}, differs at {bad[:5]}")
                else:
                    print(f"PASS multistep {name} K={parts} on {args.device}: versions "
                          f"{versions} restored and replayed bit for bit")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return ok


def multistep_host_refused(args, torch) -> bool:
    """4c: the CPU kernels' replay cannot reproduce CUDA arithmetic."""
    import nonstop
    model = torch.nn.Linear(8, 8).to(args.device)
    opt = torch.optim.AdamW(model.parameters())
    tmp = tempfile.mkdtemp(prefix="nonstop-gpu-multistep-")
    try:
        nonstop.Checkpointer(tmp, {"model": model, "optim": opt}, mode="multistep",
                             replay="host").close()
    except nonstop.CheckpointMismatchError as e:
        msg = str(e)
        if "\n" not in msg and "use replay='torch'" in msg:
            print(f"PASS multistep replay='host' with {args.device} parameters refused: {msg}")
            return True
        print(f"FAIL multistep refusal is not the one line expected: {msg!r}")
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"FAIL multistep replay='host' with {args.device} parameters was accepted")
    return False


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--ckpt-dir")
    p.add_argument("--final")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--mode", default="concurrent", choices=["concurrent", "multistep"])
    p.add_argument("--only", choices=["resume", "layerwise", "multistep", "devsnap", "restore"])
    p.add_argument("--timeout", type=int, default=TOTAL_TIMEOUT_S,
                   help="hard limit for the whole file (bench/gpu_run.sh passes its share)")
    args = p.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.worker:
        return worker(args)
    signal.signal(signal.SIGALRM, lambda *_: (print(f"FAIL ran past {args.timeout} s",
                                                    flush=True), os._exit(1)))
    signal.alarm(args.timeout)
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("SKIP: torch sees no CUDA device")
            return 0
        check_streams(torch)
    try:
        import nonstop
        if nonstop._core is None:
            raise ImportError(nonstop._CORE_ERROR)
    except ImportError as e:
        print(f"SKIP: the nonstop Python module is not built here ({e}); "
              "GPU resume test not run")
        return 0
    print(f"nonstop from {os.path.dirname(nonstop.__file__)}, build {nonstop.build_info()}")
    # The two SIGKILL/resume tests (concurrent, multistep) run their training
    # processes at the same time, beside the in-process checks: the GPU
    # check must fit one device call (bench/gpu_run.sh).
    resumes = [m for m, part in (("concurrent", "resume"), ("multistep", "multistep"))
               if args.only in (None, part)]
    results: dict = {}

    def resume(mode):
        try:
            results[mode] = resume_test(args, torch, mode)
        except Exception as e:  # noqa: BLE001 -- reported as a failure below
            print(f"FAIL GPU training resume ({mode}): {type(e).__name__}: {e}", flush=True)
            results[mode] = False
    threads = [threading.Thread(target=resume, args=(m,)) for m in resumes]
    for t in threads:
        t.start()
    ok = True
    if args.only in (None, "layerwise"):
        ok = layerwise_test(args, torch) and ok
    if args.only in (None, "multistep"):
        ok = multistep_exact(args, torch) and ok
        if args.device == "cuda":
            ok = multistep_host_refused(args, torch) and ok
    if args.only in (None, "devsnap"):
        ok = device_snapshot_test(args, torch) and ok
    if args.only in (None, "restore"):
        ok = restore_device_test(args, torch) and ok
    for t in threads:
        t.join()
    ok = all(results.get(m, False) for m in resumes) and ok
    print("PASS all" if ok else "FAIL some checks above", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
