"""A rank of test_which_checkpoint's distributed rollback case: phase
"write" commits steps 9, 19, 29; "rollback" restores step 9 (19 and 29 are
abandoned) and commits step 5 (the run counts its steps anew); "restore" restarts every rank and prints what restore() returned and the
step the weights hold."""
import json
import sys

import torch

from dist_launch import end_rank, start_rank


def main():
    d, phase = sys.argv[1], sys.argv[2]
    rank = start_rank()
    import nonstop
    model = torch.nn.Linear(4, 4)
    ck = nonstop.Checkpointer(d, {"model": model}, every=1, medium="buffered", dist_timeout_s=60)
    got = ck.restore(step=9 if phase == "rollback" else None)
    if phase == "write":
        for s in (9, 19, 29):
            with torch.no_grad():
                model.weight.fill_(float(s))
            ck.step(s)
            ck.wait()
    if phase == "rollback":
        with torch.no_grad():
            model.weight.fill_(5.0)
        ck.step(5)
        ck.wait()
    ck.close()
    print(json.dumps({"rank": rank, "restored": got, "weight": model.weight[0, 0].item()}),
          flush=True)
    end_rank()


if __name__ == "__main__":
    main()
