"""Issue #19 measurements of the staging allocation and the memory tier, on a
~1.32 GB state (a 110M-parameter model of fp32 Linear layers plus Adam's two
moments), each phase in fresh processes, schemes interleaved per round:

  first   first vs second checkpoint stall (time in save() plus the wait of
          the next optimizer.step() for the copy), with the staging prepared
          in the background from the constructor ("prepared", the default)
          and without it ("unprepared": the estimate patched to 0, so the
          first save() allocates as before). Target: first within 2x of second.
  restart a process checkpoints, waits until the memory tier holds it and
          SIGKILLs itself; a new process builds a Checkpointer and restore()s:
          from the memory tier ("memory"), from the disk with a warm and a
          cold page cache ("disk-warm", "disk-cold": tier="disk"). Also the
          engine's own C++ Restore() into the registered tensors (restore_s
          of Engine.restore). Target: memory tier >= 5 GB/s. GB/s of
          restore() counts its whole call (checks, read, load_state_dict);
          "its read" is the read alone (stats restore_GBps).

Usage: python bench/memtier_bench.py [--gb 1.32] [--rounds 2] [--out bench/memtier_bench.json]
Prints a table and writes JSON.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def build(gb, seed):
    import torch
    torch.manual_seed(seed)
    # Adam triples the parameters' bytes: params = gb / 3.
    params = int(gb * 1e9 / 3 / 4)
    cols = 3840
    rows = 4096
    layers = max(1, round(params / (rows * cols)))
    model = torch.nn.Sequential(*[torch.nn.Linear(cols, rows, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def fake_step(model, opt):
    import torch
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()


def state_bytes(model, opt):
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if hasattr(t, "numel"))
    return n


def child_first(a):
    import nonstop
    from nonstop import _checkpointer
    if a.scheme == "unprepared":
        _checkpointer._state_bytes_estimate = lambda state: 0
    model, opt = build(a.gb, 0)
    ckpt = nonstop.Checkpointer(a.dir, {"model": model, "optim": opt}, every=1 << 30,
                                tier="disk")
    time.sleep(a.gap)  # what a job does before its first checkpoint (data, first forward)
    stalls = []
    for i in range(3):
        fake_step(model, opt)  # waits for the previous checkpoint's copy (hook)
        if stalls:
            stalls[-1] += ckpt.stats()["hook_stall_s"] - hook0
        t0 = time.perf_counter()
        ckpt.save(i)
        stalls.append(time.perf_counter() - t0)
        hook0 = ckpt.stats()["hook_stall_s"]
        time.sleep(a.gap)
    fake_step(model, opt)
    stalls[-1] += ckpt.stats()["hook_stall_s"] - hook0
    ckpt.wait()
    s = ckpt.stats()
    ckpt.close()
    print(json.dumps(dict(stalls=stalls, bytes=s["recent"][0]["bytes"],
                          staging_alloc_waits=s["staging_alloc_waits"],
                          staging_alloc_wait_s=s["staging_alloc_wait_s"],
                          staging_prepared_bytes=s["staging_prepared_bytes"])))


def child_crash(a):
    import nonstop
    model, opt = build(a.gb, 1)
    ckpt = nonstop.Checkpointer(a.dir, {"model": model, "optim": opt}, every=1 << 30,
                                tier="memory")
    fake_step(model, opt)
    ckpt.save(0)
    ckpt.wait()
    newest = ckpt.session.engine.latest()[0]
    end = time.monotonic() + 120
    while ckpt.stats()["memory_counter"] != newest and time.monotonic() < end:
        time.sleep(0.01)  # polls a condition, bounded
    s = ckpt.stats()
    print(json.dumps(dict(bytes=s["recent"][0]["bytes"], memory_counter=s["memory_counter"],
                          memory_error=s["memory_error"],
                          checksum=float(sum(p.double().sum() for p in model.parameters())))),
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: the segment stays


def drop_cache(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def child_restore(a):
    import nonstop
    if a.scheme == "disk-cold":
        drop_cache(a.dir)
    model, opt = build(a.gb, 2)  # other values: restore must overwrite them
    fake_step(model, opt)  # Adam's state exists (restore into existing tensors)
    tier = "memory" if a.scheme == "memory" else "disk"
    t0 = time.perf_counter()
    ckpt = nonstop.Checkpointer(a.dir, {"model": model, "optim": opt}, every=1 << 30, tier=tier)
    t_open = time.perf_counter() - t0
    t1 = time.perf_counter()
    step = ckpt.restore()
    t_restore = time.perf_counter() - t1
    s = ckpt.stats()
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    # The engine's C++ Restore() into the registered tensors.
    eng = ckpt.session.engine
    from nonstop import _state
    tensors = {}
    for key, obj in ckpt.state.items():
        _state.flatten(obj.state_dict(), key, tensors, key)
    eng.register(ckpt.session.refs(tensors, nonstop._session.optimizer_owned(ckpt.state)))
    if a.scheme == "disk-cold":
        drop_cache(a.dir)
    t2 = time.perf_counter()
    eng.restore()
    t_engine = time.perf_counter() - t2
    es = eng.stats()
    ceiling = {}
    if a.scheme == "memory":
        ceiling = read_ceiling(a.dir, tensors)
    ckpt.close()
    print(json.dumps(dict(step=step, open_s=t_open, restore_s=t_restore,
                          read_s=s.get("restore_read_s"), read_GBps=s.get("restore_GBps"),
                          restored_from=s.get("restored_from"),
                          why=s.get("memory_unused_because"), checksum=checksum,
                          engine_restore_s=t_engine, ceiling=ceiling,
                          engine_from_memory=es["restored_from_memory"])))


def read_ceiling(d, tensors):
    """What bounds a read of the segment on this machine, with the segment
    still there (before close): the C++ read alone (Reader.read_into: pread +
    crc32c of every chunk) into the same live tensors again (warm pages),
    with 1 and 4 threads, and a plain memcpy of the same bytes (torch copy_
    into warm tensors, one thread): the read cannot beat memcpy + crc."""
    import torch
    from nonstop import _ext
    core = _ext.core()
    reader, why = core.open_memory_segment(d, 0)
    if reader is None:
        return {"why": why}
    idx = reader.newest_valid
    info = reader.checkpoints[idx]
    dst = []
    for spec in info["tensors"]:
        t = tensors.get(spec["name"])
        ok = t is not None and t.is_contiguous() and t.numel() * t.element_size() == spec["nbytes"]
        dst.append((t.data_ptr(), spec["nbytes"]) if ok else (0, 0))
    nbytes = sum(n for _, n in dst)
    out = {"bytes": nbytes}
    for threads in (1, 4):
        best = 1e9
        for _ in range(2):
            t0 = time.perf_counter()
            reader.read_into(idx, dst, threads=threads)
            best = min(best, time.perf_counter() - t0)
        out[f"read_{threads}t_GBps"] = nbytes / best / 1e9
    src = [t.detach() for t in tensors.values() if t.is_contiguous()]
    copies = [t.clone() for t in src]
    best = 1e9
    for _ in range(2):
        t0 = time.perf_counter()
        for c, t in zip(copies, src):
            c.copy_(t)
        best = min(best, time.perf_counter() - t0)
    out["memcpy_GBps"] = sum(t.numel() * t.element_size() for t in src) / best / 1e9
    return out


def run_child(args, phase, scheme, d, timeout=600):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", phase, "--scheme", scheme,
           "--dir", d, "--gb", str(args.gb), "--gap", str(args.gap)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"{phase}/{scheme} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gap", type=float, default=1.5,
                    help="seconds of 'training' before the first and between checkpoints")
    ap.add_argument("--out", default=os.path.join(HERE, "memtier_bench.json"))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--scheme", default=None)
    ap.add_argument("--phases", default="first,restart")
    a = ap.parse_args()
    if a.child == "first":
        return child_first(a)
    if a.child == "crash":
        return child_crash(a)
    if a.child == "restore":
        return child_restore(a)

    base = a.dir or tempfile.mkdtemp(prefix="nonstop-memtier-bench-", dir="/tmp")
    rows = []
    phases = a.phases.split(",")
    for r in range(a.rounds):
        if "first" in phases:
            for scheme in (["prepared", "unprepared"] if r % 2 == 0 else ["unprepared", "prepared"]):
                d = os.path.join(base, f"first-{scheme}-{r}")
                got = run_child(a, "first", scheme, d)
                s = got["stalls"]
                rows.append(dict(phase="first", scheme=scheme, round=r, bytes=got["bytes"],
                                 first_s=s[0], second_s=s[1], third_s=s[2],
                                 ratio=s[0] / max(s[1], 1e-9),
                                 staging_alloc_waits=got["staging_alloc_waits"],
                                 staging_alloc_wait_s=got["staging_alloc_wait_s"]))
                subprocess.run(["rm", "-rf", d])
        if "restart" in phases:
            d = os.path.join(base, f"restart-{r}")
            crashed = run_child(a, "crash", "-", d)
            order = ["memory", "disk-warm", "disk-cold"]
            order = order[r % 3:] + order[:r % 3]
            # The memory run last: its clean close gives the segment back.
            order = [x for x in order if x != "memory"] + ["memory"]
            for scheme in order:
                got = run_child(a, "restore", scheme, d)
                ok = abs(got["checksum"] - crashed["checksum"]) <= 1e-6 * abs(crashed["checksum"])
                rows.append(dict(phase="restart", scheme=scheme, round=r, bytes=crashed["bytes"],
                                 restored_from=got["restored_from"], why=got["why"],
                                 open_s=got["open_s"], restore_s=got["restore_s"],
                                 GBps=crashed["bytes"] / got["restore_s"] / 1e9,
                                 read_s=got["read_s"], read_GBps=got["read_GBps"],
                                 engine_restore_s=got["engine_restore_s"],
                                 engine_GBps=crashed["bytes"] / got["engine_restore_s"] / 1e9,
                                 engine_from_memory=got["engine_from_memory"], correct=ok,
                                 ceiling=got.get("ceiling", {})))
            subprocess.run(["rm", "-rf", d])
    print(f"{'phase':8} {'scheme':11} {'rnd':>3} {'GB':>5}  result")
    for x in rows:
        if x["phase"] == "first":
            res = (f"first {x['first_s']*1e3:8.1f} ms  second {x['second_s']*1e3:8.1f} ms  "
                   f"first/second {x['ratio']:5.2f}  alloc waits {x['staging_alloc_waits']} "
                   f"({x['staging_alloc_wait_s']*1e3:.1f} ms)")
        else:
            res = (f"restore() {x['restore_s']:6.2f} s {x['GBps']:6.2f} GB/s from {x['restored_from']}"
                   f" (its read {x['read_GBps'] or 0:5.2f} GB/s)"
                   f" | Engine.restore {x['engine_restore_s']:6.3f} s {x['engine_GBps']:6.2f} GB/s"
                   f" (memory: {x['engine_from_memory']}) correct={x['correct']}")
        print(f"{x['phase']:8} {x['scheme']:11} {x['round']:>3} {x['bytes']/1e9:5.2f}  {res}")
        c = x.get("ceiling") or {}
        if "memcpy_GBps" in c:
            print(f"{'':33}segment read alone, warm: {c['read_1t_GBps']:5.2f} GB/s 1 thread, "
                  f"{c['read_4t_GBps']:5.2f} GB/s 4 threads; memcpy {c['memcpy_GBps']:5.2f} GB/s")
    out = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               host=os.uname().nodename, cpus=os.cpu_count(), rows=rows)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", a.out)
    if not a.dir:
        subprocess.run(["rm", "-rf", base])


if __name__ == "__main__":
    main()
