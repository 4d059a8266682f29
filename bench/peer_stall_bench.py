"""Issue #27: the training stall of the peer tier, replication on against
off, and what it is made of.

    sudo .venv/bin/python bench/peer_stall_bench.py [--rounds 4] [--arms off,on,nice0,every4] [--pin] [--one-session]
        [--mb 64] [--every 1] [--steps 20] [--step-s 0.1] [--out bench/peer_stall_bench.json]

Needs root (network namespaces, as tests/python/test_peer_tier.py).

A 2-rank job, one rank per host (two network namespaces on one bridge,
tests/python/netns_hosts.py; gloo across the veths; with --pin each
host's process on its own core, CPU 0 and CPU 1, as two hosts have their
own CPUs: without it rank 0's replicator competes with rank 1's training
for the same cores, and each rank is a session of its own, an autogroup
of the scheduler, inside which alone a thread's nice counts; --one-session
puts both ranks in this process's session, one autogroup), each rank its own
--mb MB state, tier="memory", every=--every, per step a sleep of --step-s
(the forward/backward) and an in-place update of the whole state, then
ck.step() (bench/peer_restart_worker.py train). Arms, each run a fresh job:

  off     replicas=0
  on      replicas=1 as shipped: the peer threads at nice 10, unpaced
  niceN   replicas=1, peer_nice=N; nice0: the peer threads at training's
          priority, what ran before replication yielded the CPU
  everyN  replicas=1, peer_every=N (a partner takes a checkpoint only N
          after the one it holds)
  idle    replicas=1, peer_nice="idle" (the peer threads in SCHED_IDLE)
  bpsN    replicas=1, peer_bps=N MB/s (a push's frames paced to N MB/s)
  unpaced replicas=1, peer_bps=0 (the default today)
  spread  replicas=1, peer_bps="spread" (each push spread over the commit
          interval, 10 s at least)

The arms run in a rotating order every round (interleaved: the noise of
this shared 2-core box falls on all of them). Per run: the mean step time
and the visible stall per checkpoint (warm-up excluded), and the training
thread's run-queue wait per step (/proc/thread-self/schedstat: time it was
runnable but had no CPU), the CPU time of each rank's process per step
(every thread), the machine's softirq and system time over the run
(/proc/stat: other load included), the replicas stored during the steps
and after the drain, and the oldest a checkpoint was when its partner
held it (peer_lag_s_max: during the steps, and with the drain). Per round each
arm's ratio to "off" in the same round; the summary is their median.

Prints a table and writes JSON.
"""
import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
import netns_hosts  # noqa: E402
import peer_stall_job  # noqa: E402


def arm_flags(arm: str) -> list:
    if arm == "off":
        return ["--replicas", "0"]
    if arm == "on":
        return ["--replicas", "1"]
    if arm.startswith("nice") and arm[4:].isdigit():
        return ["--replicas", "1", "--peer-nice", arm[4:]]
    if arm.startswith("every") and arm[5:].isdigit():
        return ["--replicas", "1", "--peer-every", arm[5:]]
    if arm == "idle":
        return ["--replicas", "1", "--peer-nice", "idle"]
    if arm.startswith("bps") and arm[3:].isdigit():
        return ["--replicas", "1", "--peer-bps", str(int(arm[3:]) * 10**6)]
    if arm == "unpaced":  # the pace off (peer_bps=0), whatever the default
        return ["--replicas", "1", "--peer-bps", "0"]
    if arm == "spread":
        return ["--replicas", "1", "--peer-bps", "spread"]
    raise SystemExit(f"unknown arm {arm!r}")


def start_one_session(hs, argv, log) -> list:
    """netns_hosts.start_ranks, but every rank in this process's session
    (its own process group only): one scheduler autogroup for both ranks."""
    port = netns_hosts.free_port()
    procs = []
    for rank in range(2):
        e = dict(os.environ, NONSTOP_SHM_DIR=hs[rank].shm, GLOO_SOCKET_IFNAME=netns_hosts.IFNAME,
                 PYTHONUNBUFFERED="1", RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2",
                 MASTER_ADDR=hs[0].addr, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        with open(f"{log}-{rank}", "ab") as f:
            p = subprocess.Popen(["ip", "netns", "exec", hs[rank].ns, sys.executable, *argv(rank)],
                                 env=e, stdout=f, stderr=subprocess.STDOUT, process_group=0)
        hs[rank].procs.append(p)
        procs.append(p)
    return procs


def kernel_times() -> dict:
    """System-wide seconds of softirq and system time (/proc/stat, all CPUs)
    and the counts of network softirqs (/proc/softirqs NET_TX, NET_RX)."""
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        cpu = f.readline().split()
    out = {"softirq_s": int(cpu[7]) / hz, "system_s": int(cpu[3]) / hz}
    with open("/proc/softirqs") as f:
        for line in f:
            k, *v = line.split()
            if k in ("NET_TX:", "NET_RX:"):
                out[k[:-1].lower()] = sum(int(x) for x in v)
    return out


def run_arm(a, hs, root, rnd, arm) -> dict:
    job = f"stall-{rnd}-{arm}"
    argv = peer_stall_job.train_argv(
        hs, job, a.mb, a.every, a.steps, a.step_s,
        lambda r: arm_flags(arm) + (["--cpu", str(r % os.cpu_count())] if a.pin else []))
    k0 = kernel_times()
    ranks = peer_stall_job.run_job(hs, job, os.path.join(root, f"{job}.log"), argv,
                                   replicating=arm != "off",
                                   start=start_one_session if a.one_session else None)
    k1 = kernel_times()
    return {"step_s_mean": statistics.mean(x["step_s_mean"] for x in ranks),
            "stall_per_ckpt_s": statistics.mean(x["stall_per_ckpt_s"] for x in ranks),
            "runq_wait_s_mean": statistics.mean(x["runq_wait_s_mean"] for x in ranks),
            "cpu_s_per_step": statistics.mean(x.get("cpu_s_per_step", 0.0) for x in ranks),
            "peer_replicated": sum(x["peer_replicated"] for x in ranks),
            "peer_replicated_drained": sum(x["peer_replicated_drained"] for x in ranks),
            # the oldest a checkpoint was when it reached its partner, during
            # the steps (None: none did) and with the drain after them
            "peer_lag_s_max": max((x.get("peer_lag_s_max") for x in ranks
                                   if x.get("peer_lag_s_max") is not None), default=None),
            "peer_lag_s_max_drained": max((x.get("peer_lag_s_max_drained") or 0.0) for x in ranks),
            # the whole machine, the job's start to its end (other load included)
            "kernel": {k: k1[k] - k0[k] for k in k0},
            "ranks": ranks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--arms", default="off,on,nice0,every4")
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--pin", action="store_true",
                    help="each host's rank on its own core (CPU r): hosts that do not share CPUs")
    ap.add_argument("--one-session", action="store_true",
                    help="both ranks in this process's session: one scheduler autogroup")
    ap.add_argument("--out", default=os.path.join(HERE, "peer_stall_bench.json"))
    a = ap.parse_args()
    arms = a.arms.split(",")
    assert "off" in arms, "the ratios are to the arm off"
    for arm in arms:
        arm_flags(arm)
    if os.geteuid() != 0:
        sys.exit("peer_stall_bench: network namespaces need root")

    root = tempfile.mkdtemp(prefix="peer-stall-", dir="/var/tmp")
    shm = tempfile.mkdtemp(prefix="peer-stall-", dir="/dev/shm")
    res = {"command": "python " + " ".join(sys.argv), "cpus": os.cpu_count(),
           "machine": platform.machine(), "mb": a.mb, "every": a.every, "steps": a.steps,
           "step_s": a.step_s, "arms": arms, "pin": a.pin, "one_session": a.one_session,
           "rounds": [],
           "loadavg_start": os.getloadavg()[0],
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    hs = netns_hosts.Hosts(2, root)
    try:
        hs.up()
        for h in hs:
            h.shm = os.path.join(shm, f"host{h.index}")
            os.makedirs(h.shm)
        for rnd in range(a.rounds):
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            got = {}
            for arm in order:
                got[arm] = run_arm(a, hs, root, rnd, arm)
                g = got[arm]
                print(f"  round {rnd} {arm:<7} step {g['step_s_mean'] * 1e3:7.1f} ms"
                      f"  stall/ckpt {g['stall_per_ckpt_s'] * 1e3:7.1f} ms"
                      f"  run-queue wait/step {g['runq_wait_s_mean'] * 1e3:6.1f} ms"
                      f"  CPU/step {g['cpu_s_per_step'] * 1e3:6.1f} ms"
                      f"  softirq {g['kernel']['softirq_s']:5.2f} s sys {g['kernel']['system_s']:5.2f} s"
                      f"  replicated {g['peer_replicated']} ({g['peer_replicated_drained']} drained)", flush=True)
            off = got["off"]
            ratios = {arm: {"step": got[arm]["step_s_mean"] / off["step_s_mean"],
                            "stall": (got[arm]["stall_per_ckpt_s"] / off["stall_per_ckpt_s"]
                                      if off["stall_per_ckpt_s"] > 0 else None)}
                      for arm in arms if arm != "off"}
            res["rounds"].append({"round": rnd, "order": order, "arms": got, "ratios": ratios})
    finally:
        hs.down()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()[0]
    summary = {}
    for arm in arms:
        rows = [r["arms"][arm] for r in res["rounds"]]
        s = {"step_s_median": statistics.median(x["step_s_mean"] for x in rows),
             "stall_per_ckpt_s_median": statistics.median(x["stall_per_ckpt_s"] for x in rows),
             "runq_wait_s_median": statistics.median(x["runq_wait_s_mean"] for x in rows),
             "replicated_median": statistics.median(x["peer_replicated"] for x in rows),
             "cpu_s_per_step_median": statistics.median(x["cpu_s_per_step"] for x in rows),
             "softirq_s_median": statistics.median(x["kernel"]["softirq_s"] for x in rows),
             "lag_s_max": max((x["peer_lag_s_max"] for x in rows
                               if x.get("peer_lag_s_max") is not None), default=None),
             "lag_s_max_drained": max((x["peer_lag_s_max_drained"] for x in rows), default=0.0)}
        if arm != "off":
            st = [r["ratios"][arm]["step"] for r in res["rounds"]]
            sl = [r["ratios"][arm]["stall"] for r in res["rounds"]
                  if r["ratios"][arm]["stall"] is not None]
            s.update(step_ratio_median=statistics.median(st), step_ratio_range=[min(st), max(st)],
                     stall_ratio_median=statistics.median(sl) if sl else None,
                     stall_ratio_range=[min(sl), max(sl)] if sl else None)
        summary[arm] = s
    res["summary"] = summary
    print(f"\n{'arm':<8}{'step ms':>9}{'x off':>7}{'range':>13}{'stall/ckpt ms':>15}{'x off':>7}"
          f"{'runq ms':>9}{'CPU ms':>8}{'softirq s':>10}{'replicated':>11}{'lag max s':>10}"
          f"{'drained':>8}")
    for arm, s in summary.items():
        rs = (f"{s['step_ratio_median']:>7.3f}{s['step_ratio_range'][0]:>6.2f}-"
              f"{s['step_ratio_range'][1]:<6.2f}" if arm != "off" else f"{'':>7}{'':>13}")
        sr = f"{s['stall_ratio_median']:>7.3f}" if arm != "off" and s["stall_ratio_median"] else f"{'':>7}"
        print(f"{arm:<8}{s['step_s_median'] * 1e3:>9.1f}{rs}{s['stall_per_ckpt_s_median'] * 1e3:>15.1f}"
              f"{sr}{s['runq_wait_s_median'] * 1e3:>9.1f}{s['cpu_s_per_step_median'] * 1e3:>8.1f}"
              f"{s['softirq_s_median']:>10.2f}{s['replicated_median']:>11}"
              f"{s['lag_s_max'] if s['lag_s_max'] is not None else float('nan'):>10.1f}"
              f"{s['lag_s_max_drained']:>8.1f}")
    print(f"load average {res['loadavg_start']:.1f} -> {res['loadavg_end']:.1f}")
    peer_stall_job.write_json(a.out, res)


if __name__ == "__main__":
    main()
