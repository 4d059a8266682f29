"""max_to_keep= and best= with world_size > 1 (issue 16): every rank keeps
and deletes the same steps. Rank 0's metrics are agreed over gloo (the ranks
pass different losses), each rank deletes its own file of a kept step, and
a step kept on some ranks only (a kill between the ranks' deletions) is
deleted at the next start. A real 2-process gloo job, killed with SIGKILL
and restarted, under a hard timeout (dist_launch.run_ranks)."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dist_launch import run_ranks  # noqa: E402

import nonstop  # noqa: E402

SCRIPT = os.path.join(HERE, "retention_ddp_train.py")


def _by_rank(res, key):
    out = {}
    for r, (_, lines, _) in enumerate(res):
        for o in lines:
            if key in o:
                out.setdefault(r, []).append(o)
    return out


def test_two_ranks_keep_the_same_steps_through_a_kill_and_restore_a_kept_one(tmp_path):
    d = str(tmp_path / "ck")
    res = run_ranks(2, [SCRIPT, d, "train"], timeout=240)
    assert res[0][0] == -9, res[0][2][-2000:]  # rank 0 killed itself after step 7
    weights = {o["step"]: o["w"] for o in _by_rank(res, "step")[0]}
    assert sorted(weights) == list(range(8)), res[0][2][-2000:]
    slot = {r: nonstop._core.JobDir.slot_name(r) for r in range(2)}

    def kept(r):
        k = os.path.join(d, "keep")
        return sorted(int(n.split("-")[1]) for n in os.listdir(k)
                      if os.path.isfile(os.path.join(k, n, slot[r])))

    # Rank 0's losses rank steps 3 (0.2) and 1 (0.3) best, plus the newest two;
    # rank 1's own losses would have kept 7 and 0.
    assert kept(0) == kept(1) == [1, 3, 6, 7]
    # Rank 1's checkpoints carry rank 0's loss of their step, not its own.
    for r in range(2):
        rows = {x["step"]: x for x in nonstop.list(d, rank=r) if x["where"] == "keep"}
        assert rows[3]["metrics"] == {"loss": 0.2} and rows[7]["metrics"] == {"loss": 0.95}
    # A kill between the ranks' deletions of step 1: rank 1's file is gone,
    # rank 0's is not. The next start deletes rank 0's too.
    os.unlink(os.path.join(d, "keep", "step-000000000001", slot[1]))

    res = run_ranks(2, [SCRIPT, d, "resume"], timeout=240)
    for rc, _, err in res:
        assert rc == 0, err[-3000:]
    opened = _by_rank(res, "at_open")
    assert opened[0][0]["at_open"] == opened[1][0]["at_open"] == [3, 6, 7]
    assert not os.path.exists(os.path.join(d, "keep", "step-000000000001"))
    # Steps 8..11: 9 (0.1) and 3 (0.2) are the best two, 10 and 11 the newest.
    closed = _by_rank(res, "at_close")
    assert closed[0][0]["at_close"] == closed[1][0]["at_close"] == [3, 9, 10, 11]
    # restore(step=3) of a copy that left the ring, on both ranks.
    for r, [o] in _by_rank(res, "restored").items():
        assert o["restored"] == 3 and o["w"] == weights[3], (r, o)
