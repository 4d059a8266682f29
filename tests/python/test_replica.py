"""In DDP, a tensor treated as replicated (not under local=) must be equal
on every rank: the first checkpoint compares a hash across the ranks and
refuses a rank-local one with one line naming it and local= (#16). Real
2-rank gloo jobs under a hard timeout (dist_launch.run_ranks)."""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dist_launch import run_ranks  # noqa: E402


def test_a_rank_local_tensor_is_refused_without_local_and_restored_with_it(tmp_path):
    res = run_ranks(2, [os.path.join(HERE, "replica_train.py"), str(tmp_path)], timeout=240)
    got = {}
    for rc, lines, err in res:
        assert rc == 0, err[-2000:]
        for o in lines:
            got[o["mode"], o["rank"]] = o
    assert len(got) == 4, got
    # Without local=: every rank raises the same one line; no checkpoint started.
    for r in range(2):
        err = got["mixed", r].get("error")
        assert err is not None, got["mixed", r]
        assert "'extra/seen'" in err and "local=['extra']" in err and "rank 1" in err, err
        assert "\n" not in err
    import nonstop
    assert not nonstop.list(str(tmp_path / "mixed"))
    # With local=: DDP parameters, AdamW state and the BatchNorm buffers (rank
    # 0's by design) pass the check (no false alarm); each rank gets its own back.
    for r in range(2):
        o = got["local", r]
        assert "error" not in o, o
        assert o["restored"] == 1 and o["extra"] == [float(r)] * 4, o


def test_digest_tells_apart_what_differs():
    from nonstop import _replica
    a = torch.arange(1000, dtype=torch.float32)
    b = a.clone()
    assert _replica.digest(a) == _replica.digest(b)
    b[500] = torch.nextafter(b[500], torch.tensor(1e9))  # one ulp
    assert _replica.digest(a) != _replica.digest(b)
    assert _replica.digest(a.view(10, 100).t()) == _replica.digest(a.view(10, 100).t().clone())
    assert _replica.digest(torch.ones(3, dtype=torch.bfloat16)) != _replica.digest(
        torch.ones(3, dtype=torch.float16))
