"""A rank whose training loop ends in an engine error that nobody catches:
no close(), no end_rank(); the exception leaves the script and the
interpreter exits as it does for a user's job (test_exit_after_error.py).

    python exit_error_train.py DIR --tier memory|disk [--remote URL|file]
        [--replicas N] [--fail-at STEP] [--linger-s S]

The error is real: a regular file planted where the engine makes the keep
folder of step FAIL_AT (DIR/keep/step-N), so that keep copy fails on every
rank and the next step() raises it (a CheckpointIOError). --linger-s: rank
1 stays S seconds longer at exit (its last atexit handler), so rank 0
finalizes while rank 1's agreement thread still gathers. --replicas 1:
each rank a host of its own (NONSTOP_HOST_ID), peers on loopback.
Launched by dist_launch.run_ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
import argparse
import atexit
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_launch  # noqa: E402

import torch  # noqa: E402

import nonstop  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tier", default="disk")
    ap.add_argument("--remote", default=None)
    ap.add_argument("--replicas", type=int, default=0)
    ap.add_argument("--fail-at", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--linger-s", type=float, default=0.0)
    a = ap.parse_args()
    rank = dist_launch.start_rank()
    if rank == 1 and a.linger_s:
        atexit.register(time.sleep, a.linger_s)  # first registered: runs last
    os.environ["NONSTOP_SHM_DIR"] = os.path.join(a.dir, f"shm-{rank}")
    if a.replicas:
        os.environ.update(NONSTOP_HOST_ID=f"host-{rank}", NONSTOP_PEER_ADDR="127.0.0.1")
    state = {"w": torch.randn(64, 256)}
    kw = {}
    if a.remote:  # "file": a file:// store in DIR/remote
        url = "file://" + os.path.join(a.dir, "remote") if a.remote == "file" else a.remote
        kw.update(remote=url, remote_options={"poll_s": 0.01})
    # keep=FAIL_AT+1: the steps kept are FAIL_AT, 2*FAIL_AT+1, ...
    ck = nonstop.Checkpointer(os.path.join(a.dir, "ck"), state, every=1, tier=a.tier,
                              replicas=a.replicas, local=["w"], keep=a.fail_at + 1,
                              on_preempt=False, **kw)
    ck.restore()
    if rank == 0:
        os.makedirs(os.path.join(a.dir, "ck", "keep"), exist_ok=True)
        with open(os.path.join(a.dir, "ck", "keep", f"step-{a.fail_at:012d}"), "w") as f:
            f.write("in the way")
    torch.distributed.barrier()
    st = ck.stats()
    print(json.dumps({"event": "training", "peer_replicas": st.get("peer_replicas", 0),
                      "peer_note": st.get("peer_note", ""), "tier": st.get("tier"),
                      "remote": sorted(k for k in st if k.startswith("remote"))[:3]}), flush=True)
    for step in range(a.steps):
        state["w"].mul_(0.999)
        ck.step(step)  # raises the failed keep copy's error; nothing catches it
        time.sleep(0.02)
    print('{"event": "no error"}', flush=True)


if __name__ == "__main__":
    main()
