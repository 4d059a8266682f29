"""The stall job of bench/peer_stall_bench.py and bench/peer_restart_bench.py:
one run of a 2-rank training job (bench/peer_restart_worker.py train), one
rank per host (tests/python/netns_hosts.py), and what each rank reported.
Not a tool of its own.
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
import netns_hosts  # noqa: E402

WORKER = os.path.join(HERE, "peer_restart_worker.py")


def train_argv(hs, job: str, mb: float, every: int, steps: int, step_s: float, extra: list):
    """argv(rank) of one rank of the job `job` (its directory on its host's disk)."""
    return lambda r: [WORKER, "train", "--dir", os.path.join(hs[r].disk, job), "--mb", str(mb),
                      "--every", str(every), "--steps", str(steps), "--step-s", str(step_s),
                      *extra(r)]


def run_job(hs, job: str, log: str, argv, replicating: bool, start=None) -> list:
    """Runs the job's two ranks (`start(hs, argv, log)`, netns_hosts.start_ranks
    by default) to their end and returns each rank's JSON line; then removes
    what the job left on the hosts' disks and memory directories."""
    start = start or (lambda h, av, lg: netns_hosts.start_ranks(h, [0, 1], av, lg))
    procs = start(hs, argv, log)
    netns_hosts.wait_ranks(procs, 600, log)
    ranks = []
    for r in range(2):
        for line in netns_hosts.read_log(f"{log}-{r}").splitlines():
            if line.startswith("{") and '"step_s_mean"' in line:
                ranks.append(json.loads(line))
    assert len(ranks) == 2, f"stall run {job}: see {log}-*"
    if replicating:
        assert all(x["peer_replicated_drained"] > 0 for x in ranks), ranks
    for h in hs:
        shutil.rmtree(os.path.join(h.disk, job), ignore_errors=True)
        for n in os.listdir(h.shm):
            p = os.path.join(h.shm, n)
            (shutil.rmtree if os.path.isdir(p) else os.unlink)(p)
    return ranks


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print("wrote", path)
