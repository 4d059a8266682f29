"""A rank of test_which_checkpoint's distributed remote-tier cases (2 ranks,
the remote tier at URL, every=1):

    python remote_pick_dist_train.py DIR URL PHASE

"write" commits steps 9, 19, 29 (weights filled with the step); "rollback"
restores step 9 (19 and 29 are abandoned) and commits step 19 again (weights
-19); "restore" restarts and prints what restore() returned, the weight and
where it was restored from. close() waits for the newest upload."""
import json
import sys

import torch

from dist_launch import end_rank, start_rank


def main():
    d, url, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = start_rank()
    import nonstop
    model = torch.nn.Linear(4, 4)
    ck = nonstop.Checkpointer(d, {"model": model}, every=1, rng=False, medium="buffered",
                              remote=url, dist_timeout_s=60)
    got = ck.restore(step=9 if phase == "rollback" else None)
    steps = {"write": [9, 19, 29], "rollback": [10, 11, 12, 13]}.get(phase, [])
    for s in steps:
        with torch.no_grad():
            model.weight.fill_(float(s) if phase == "write" else -float(s))
        ck.step(s)
        ck.wait()
    where = ck.stats()["remote"].get("restored_from")
    ck.close()
    print(json.dumps({"rank": rank, "restored": got, "weight": model.weight[0, 0].item(),
                      "from": where}), flush=True)
    end_rank()


if __name__ == "__main__":
    main()
