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
  on      replicas=1 (the peer threads at their default nice, 10)
  niceN   replicas=1, peer_nice=N; nice0: the peer threads at training's
          priority, what ran before replication yielded the CPU
  everyN  replicas=1, peer_every=N (a partner takes a checkpoint only N
          after the one it holds)

The arms run in a rotating order every round (interleaved: the noise of
this shared 2-core box falls on all of them). Per run: the mean step time
and the visible stall per checkpoint (warm-up excluded), and the training
thread's run-queue wait per step (/proc/thread-self/schedstat: time it was
runnable but had no CPU), the replicas sent and skipped. Per round each
arm's ratio to "off" in the same round; the summary is their median.

Prints a table and writes JSON.
"""
import argparse
import json
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

WORKER = os.path.join(HERE, "peer_restart_worker.py")


def arm_flags(arm: str) -> list:
    if arm == "off":
        return ["--replicas", "0"]
    if arm == "on":
        return ["--replicas", "1"]
    if arm.startswith("nice") and arm[4:].isdigit():
        return ["--replicas", "1", "--peer-nice", arm[4:]]
    if arm.startswith("every") and arm[5:].isdigit():
        return ["--replicas", "1", "--peer-every", arm[5:]]
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


def run_arm(a, hs, root, rnd, arm) -> dict:
    log = os.path.join(root, f"stall-{rnd}-{arm}.log")
    job = f"stall-{rnd}-{arm}"
    argv = (lambda r: [WORKER, "train", "--dir", os.path.join(hs[r].disk, job),
                       "--mb", str(a.mb), "--every", str(a.every),
                       "--steps", str(a.steps), "--step-s", str(a.step_s)]
            + arm_flags(arm) + (["--cpu", str(r % os.cpu_count())] if a.pin else []))
    procs = (start_one_session(hs, argv, log) if a.one_session
             else netns_hosts.start_ranks(hs, [0, 1], argv, log))
    netns_hosts.wait_ranks(procs, 600, log)
    ranks = []
    for r in range(2):
        for line in netns_hosts.read_log(f"{log}-{r}").splitlines():
            if line.startswith("{") and '"step_s_mean"' in line:
                ranks.append(json.loads(line))
    assert len(ranks) == 2, f"stall run {rnd}/{arm}: see {log}-*"
    if arm != "off":
        assert all(x["peer_replicated_drained"] > 0 for x in ranks), ranks
    for h in hs:
        shutil.rmtree(os.path.join(h.disk, job), ignore_errors=True)
        for n in os.listdir(h.shm):
            p = os.path.join(h.shm, n)
            (shutil.rmtree if os.path.isdir(p) else os.unlink)(p)
    return {"step_s_mean": statistics.mean(x["step_s_mean"] for x in ranks),
            "stall_per_ckpt_s": statistics.mean(x["stall_per_ckpt_s"] for x in ranks),
            "runq_wait_s_mean": statistics.mean(x["runq_wait_s_mean"] for x in ranks),
            "peer_replicated": sum(x["peer_replicated"] for x in ranks),
            "peer_replicated_drained": sum(x["peer_replicated_drained"] for x in ranks),
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
             "replicated_median": statistics.median(x["peer_replicated"] for x in rows)}
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
          f"{'runq ms':>9}{'replicated':>11}")
    for arm, s in summary.items():
        rs = (f"{s['step_ratio_median']:>7.3f}{s['step_ratio_range'][0]:>6.2f}-"
              f"{s['step_ratio_range'][1]:<6.2f}" if arm != "off" else f"{'':>7}{'':>13}")
        sr = f"{s['stall_ratio_median']:>7.3f}" if arm != "off" and s["stall_ratio_median"] else f"{'':>7}"
        print(f"{arm:<8}{s['step_s_median'] * 1e3:>9.1f}{rs}{s['stall_per_ckpt_s_median'] * 1e3:>15.1f}"
              f"{sr}{s['runq_wait_s_median'] * 1e3:>9.1f}{s['replicated_median']:>11}")
    print(f"load average {res['loadavg_start']:.1f} -> {res['loadavg_end']:.1f}")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
