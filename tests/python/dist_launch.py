"""Starts `world` ranks of a script on localhost (gloo) under a hard timeout,
as torchrun would, and kills them all (their whole process groups) when one
dies or the time is up. Used by test_distributed.py and bench/distributed_bench.py.

The rank scripts (tests/python/*_train.py) begin with start_rank() and end
with end_rank()."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time


def start_rank(seed: int = 0) -> int:
    """A rank script's start, as torchrun's environment gives it (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT): one intra-op thread, the gloo process
    group with a 60 s timeout, torch's RNG seeded. Returns the rank."""
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(seed)
    return dist.get_rank()


def end_rank(code: int = 0) -> None:
    """A rank script's end: destroys the process group, then leaves without
    Python's interpreter finalization. torch's gloo worker threads can still
    hold a finished collective's work (ZeroRedundancyOptimizer's
    consolidate_state_dict broadcasts, DDP's allreduces) when the main thread
    returns; the thread that drops it last needs the GIL to free its tensors,
    is ended by the finalizing interpreter, and std::terminate aborts the
    process ("terminate called without an active exception", exit -6), after
    the script's work was all done. Everything the scripts write is closed
    before this is called."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def finish_rank(out: str, rank: int, result: dict) -> None:
    """A rank script's last lines: its result to OUT.rank-R.json, a "done"
    event line, then end_rank()."""
    with open(f"{out}.rank-{rank}.json", "w") as f:
        json.dump(result, f)
    print(json.dumps({"event": "done", "rank": rank}), flush=True)
    end_rank()


# Ports the tests hand to processes they start (MASTER_PORT, SeaweedFS's
# listeners). A port found with bind(("127.0.0.1", 0)) and released is in the
# kernel's ephemeral range: until the child binds it (seconds: it imports
# torch first), any connect() or bind(0) on the machine may be given it (the
# other pytest worker's gloo pairs and S3 clients), and the child dies with
# EADDRINUSE. free_port() gives ports below that range, which the kernel
# never hands out: each pytest-xdist worker its own share of them
# (PYTEST_XDIST_WORKER), in turn from a random start, each checked free on
# every address when given.
PORTS_LOW = 20000
_ports = {"next": None}


def _port_share():
    """[low, high): this process's share of the ports below the ephemeral
    range; None when that range starts too low to leave room."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = (high - PORTS_LOW) // max(1, workers)
    if size < 256:
        return None
    low = PORTS_LOW + (index % workers) * size
    return low, low + size


def free_port() -> int:
    """A TCP port free now on every address, for a process about to be
    started to listen on (see above); successive calls give distinct ports."""
    share = _port_share()
    if share is None:  # an odd ip_local_port_range: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low, high = share
    if _ports["next"] is None:
        _ports["next"] = random.SystemRandom().randrange(low, high)
    for _ in range(high - low):
        port = _ports["next"]
        _ports["next"] = low + (port + 1 - low) % (high - low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue  # taken (another checkout's tests, a leftover process)
        return port
    raise RuntimeError(f"no free TCP port in {low}..{high - 1}")


# Processes silent (crash_harness.Watchdog) or running (run_ranks) for a
# window while using less than this share of a core are blocked: hung. A
# runnable one gets more however loaded the machine (at load 40 on 2 cores,
# 5 %); a blocked one ~0 (idle threads that poll: under 0.2 %).
HUNG_CPU_SHARE = 0.01


def cpu_s(pid: int):
    """The CPU time (user + system, all threads) process `pid` used, in
    seconds; None once it is gone (or reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def run_ranks(world: int, argv: list, timeout: float = 60.0, env=None, cap=None) -> list:
    """Runs `python argv...` as ranks 0..world-1. Returns, per rank,
    (returncode, [parsed JSON lines], stderr). A rank killed by a signal has
    a negative returncode; when one rank dies the others are killed (-9) too,
    as torchrun does. The ranks are killed as hung when, over `timeout` s,
    they used under HUNG_CPU_SHARE of a core (a hang is caught in `timeout`
    s at any load; a job slow only because the machine is loaded goes on),
    and in any case past `cap` s (4 x `timeout`): TimeoutError."""
    cap = 4 * timeout if cap is None else cap
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ, **(env or {}))
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                 GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable] + argv, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    start = time.monotonic()
    used = {p.pid: 0.0 for p in procs}  # the last CPU time read of each rank
    history = [(start, 0.0)]  # (time, the ranks' CPU time together)
    expired = None
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode is not None and p.returncode < 0 for p in procs):
                break  # one rank was killed: torchrun stops the others
            now = time.monotonic()
            for p in procs:
                c = cpu_s(p.pid) if p.returncode is None else None
                if c is not None:
                    used[p.pid] = c
            history.append((now, sum(used.values())))
            while len(history) > 2 and history[1][0] <= now - timeout:
                history.pop(0)
            t0, c0 = history[0]
            if now - t0 >= timeout and history[-1][1] - c0 < HUNG_CPU_SHARE * (now - t0):
                expired = (f"ranks hung: {history[-1][1] - c0:.2f} s of CPU in the last "
                           f"{now - t0:.0f} s")
                break
            if now - start > cap:
                expired = f"ranks did not finish in {cap:.0f} s"
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=30)
        lines = []
        for line in stdout.splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
        out.append((p.returncode, lines, stderr))
    if expired is not None:
        raise TimeoutError(expired + ": " + " | ".join(e[-400:] for _, _, e in out))
    return out
