"""FSDP2 (fully_shard) state, 2 ranks with gloo on CPU (docs/DISTRIBUTED.md,
"FSDP2"). Ranks from fsdp_train.py, each multi-process run under a hard
timeout (dist_launch.run_ranks kills the ranks' process groups)."""
import hashlib
import json
import os
import sys
import warnings

import pytest
import torch

from conftest import needs_engine

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from dist_launch import run_ranks  # noqa: E402


def _fsdp2_runs() -> str:
    """Why FSDP2 cannot run here, or '' when it can."""
    if not torch.distributed.is_available():
        return "torch built without torch.distributed"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError as e:
        return f"this torch has no FSDP2 (torch.distributed.fsdp.fully_shard): {e}"
    return ""


STEPS, EVERY = 12, 3  # checkpoints after steps 2, 5, 8, 11
TIMEOUT = 150
pytestmark = [needs_engine, pytest.mark.skipif(bool(_fsdp2_runs()), reason=_fsdp2_runs())]


def launch(d, out, *extra):
    return run_ranks(2, [os.path.join(HERE, "fsdp_train.py"), d, str(STEPS), str(EVERY), out,
                         *extra], timeout=TIMEOUT)


def check_ok(res):
    for rank, (rc, _, err) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}: {err[-2000:]}"


def finals(out):
    got = []
    for r in range(2):
        with open(f"{out}.rank-{r}.json") as f:
            got.append(json.load(f))
    return got


def starts(res):
    return [next(l for l in lines if l["event"] == "start") for _, lines, _ in res]


def same_training(a, b):
    keys = ("params", "buffers", "optim", "rng", "samples", "lr", "shapes")
    for x, y in zip(a, b):
        assert [x[k] for k in keys] == [y[k] for k in keys], (x, y)


def corrupt_newest(d, rank):
    import nonstop
    c = nonstop.load(d, rank=rank)
    with open(c.path, "r+b") as f:
        f.seek(c.info["data_offset"] + 8)
        b = f.read(1)
        f.seek(c.info["data_offset"] + 8)
        f.write(bytes([b[0] ^ 0xFF]))
    return c.step


def test_fsdp2_kill_resume_corrupt_dcp_and_reshard(tmp_path):
    ref, ref_dir = str(tmp_path / "ref"), str(tmp_path / "ref-ckpt")
    check_ok(launch(ref_dir, ref))
    for f in finals(ref):  # the job really is FSDP2: sharded params and optimizer state
        assert f["optim_kinds"] == ["DTensor", "Tensor"], f
    assert [f["shapes"] for f in finals(ref)] == [
        [[34, 32], [34], [34], [34], [16, 67], [16], [1, 31], [1]],  # 67: 34 + 33 rows,
        [[33, 32], [33], [33], [33], [15, 67], [15], [0, 31], [0]]]  # 31: 16 + 15, 1: 1 + 0
    assert finals(ref)[0]["buffers"] != finals(ref)[1]["buffers"]  # per-rank BatchNorm stats
    import nonstop
    exp = str(tmp_path / "dcp")  # the DCP export of the reference's last step
    assert nonstop.export(ref_dir, exp, format="dcp")["step"] == 11

    # SIGKILL of rank 1 right after it starts the checkpoint of step 8, then
    # a restart of both: one resume step, and training ends bit-identical.
    d, out = str(tmp_path / "ckpt"), str(tmp_path / "run")
    killed = launch(d, out, "--kill-at", "8", "--kill-rank", "1")
    assert killed[1][0] == -9
    resumed = launch(d, out)
    check_ok(resumed)
    st = starts(resumed)
    assert st[0]["restored"] == st[1]["restored"] in (2, 5, 8), st
    assert st[0]["kinds"] == st[1]["kinds"] == ["DTensor"], st
    same_training(finals(out), finals(ref))

    # Rank 1's newest slot damaged: both ranks fall back to step 8 together.
    assert corrupt_newest(d, 1) == 11
    again = launch(d, out, "--load-dcp", exp)
    check_ok(again)
    assert [s["restored"] for s in starts(again)] == [8, 8]
    assert "restores step 8, older than the agreed step 11" in again[1][2]
    same_training(finals(out), finals(ref))
    # The DCP export, loaded by a 2-rank FSDP2 job into fresh DTensors: each
    # rank gets its own rows of the reference's last step back.
    for got, want in zip(finals(out), finals(ref)):
        assert got["dcp"] == {"step": 11, "params": want["params"], "kinds": ["DTensor"]}, got

    target = check_layout_dcp_reshard(tmp_path, ref_dir, exp)
    reshard_two_to_one(tmp_path, ref_dir, ref, target)


def check_layout_dcp_reshard(tmp_path, d, exp):
    import nonstop
    from nonstop import _fsdp, _read
    a, b = nonstop.load(d, rank=0), nonstop.load(d, rank=1)
    assert a.step == b.step == 11
    sa, sb = ({s["name"]: s for s in c.info["tensors"]} for c in (a, b))
    # Each rank wrote only its own rows (uneven: 34 + 33), with their place
    # in the global tensor; the optimizer state likewise.
    for name in ("model/0.weight", "optim/state/0/exp_avg", "optim/state/0/exp_avg_sq"):
        assert sa[name]["global_shape"] == sb[name]["global_shape"] == [67, 32]
        assert (sa[name]["shape"], sa[name]["global_offset"]) == ([34, 32], 0)
        assert (sb[name]["shape"], sb[name]["global_offset"]) == ([33, 32], 34 * 32)
    assert (sb["model/4.bias"]["shape"], sb["model/4.bias"]["global_offset"]) == ([15], 16)
    assert "model/6.weight" in sa and "model/6.weight" not in sb  # rank 1 holds no row
    doc = a.meta["dist"]["dtensor"]
    assert doc["model/0.weight"] == [[67, 32], "float32", "S0"]
    assert doc == b.meta["dist"]["dtensor"]
    # BatchNorm running statistics: each rank its own, whole.
    assert a.tensors["model/1.running_mean"].shape == (67,)
    assert not torch.equal(a.tensors["model/1.running_mean"], b.tensors["model/1.running_mean"])

    # DCP export: full tensors, loadable in one process, in get_state_dict's
    # layout ("model": {"0.weight"}, "optim": {"state": {"0.weight": {"exp_avg"}}}).
    import torch.distributed.checkpoint as dcp
    fqn = a.meta["names"]["optimizers"]["optim"]["params"]

    def path(name):
        key, _, rest = name.partition("/")
        if key == "optim":
            _, i, k = rest.split("/")
            return ("optim", "state", fqn[int(i)], k)
        return (key, rest)

    nested = {}
    for name, (shape, dtype, _) in doc.items():
        *up, leaf = path(name)
        node = nested
        for p in up:
            node = node.setdefault(p, {})
        node[leaf] = torch.zeros(shape, dtype=getattr(torch, dtype))
    nested["nonstop.step"] = torch.tensor(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(nested, checkpoint_id=exp)
    assert int(nested["nonstop.step"]) == 11
    target = {}
    for name in doc:
        node = nested
        for p in path(name):
            node = node[p]
        target[name] = node
    for name in doc:
        rows_a = sa[name]["shape"][0]
        assert torch.equal(target[name][:rows_a], a.tensors[name]), name
        if name in sb:
            assert torch.equal(target[name][rows_a:], b.tensors[name]), name

    # Another world size: the pieces of all old rank files give any rank of
    # any new world size its rows (here 1 and 3 ranks), bit-exact.
    readers = _read.readers(d)
    idx = [next(i for i, c in enumerate(rd.checkpoints) if c["committed"] and c["step"] == 11)
           for rd in readers]
    whole = _fsdp.reshard(readers, idx, doc, rank=0, world=1, where=d, step=11)
    for name in doc:
        assert torch.equal(whole[name], target[name]), name
    three = [_fsdp.reshard(readers, idx, doc, rank=r, world=3, where=d, step=11)
             for r in range(3)]
    assert [t["model/0.weight"].shape[0] for t in three] == [23, 23, 21]
    for name in doc:
        assert torch.equal(torch.cat([t[name] for t in three]), target[name]), name
    return target


def reshard_two_to_one(tmp_path, d, ref, target):
    """Restoring the 2-rank FSDP2 checkpoint with one process (a plain model,
    and a 1-rank FSDP2 job): resharded from both old rank files when
    resharding is available, else refused with one line naming both world
    sizes. `target`: the full tensors (from the DCP export)."""
    import nonstop
    from nonstop import _distributed
    if not hasattr(_distributed, "set_aside"):
        with pytest.raises(nonstop.IncompatibleCheckpointError,
                           match=r"world size 2.*world size 1"):
            nonstop.Checkpointer(d, {"t": torch.zeros(2)}, world_size=1, rank=0)
        return
    import shutil
    plain_dir = str(tmp_path / "plain")
    shutil.copytree(d, plain_dir)  # the 2-rank files, for a plain model below

    # A 1-rank FSDP2 job: the global parameters and optimizer state are those
    # of the 2-rank job at step 11, bit for bit; it trains on and checkpoints
    # step 14 (one rank: each DTensor's local tensor is whole).
    one = str(tmp_path / "one")
    res = run_ranks(1, [os.path.join(HERE, "fsdp_train.py"), d, str(STEPS + 3), str(EVERY),
                        one], timeout=TIMEOUT)
    assert res[0][0] == 0, res[0][2][-2000:]
    st = starts(res)[0]
    want = finals(ref)[0]
    assert st["restored"] == 11 and st["kinds"] == ["DTensor"], st
    assert (st["full_params"], st["full_optim"], st["samples"], st["lr"]) == (
        want["full_params"], want["full_optim"], want["samples"], want["lr"])
    with open(f"{one}.rank-0.json") as f:
        one_final = json.load(f)
    assert one_final["samples"] == want["samples"] + 3 * 16 and one_final["agreed"] == 14

    # One process, no process group, no fully_shard: plain full tensors,
    # from the 2-rank files (resharded) and from the 1-rank FSDP2 job's own.
    for where, step in ((plain_dir, 11), (d, 14)):
        torch.manual_seed(0)
        nn = torch.nn
        plain = nn.Sequential(nn.Linear(32, 67), nn.BatchNorm1d(67), nn.ReLU(), nn.Dropout(0.1),
                              nn.Linear(67, 31), nn.ReLU(), nn.Linear(31, 1))
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "moved to .../world-2 and restore() reshards them"
            ck = nonstop.Checkpointer(where, {"model": plain, "optim": opt}, rng=False)
            assert ck.restore() == step
        ck.close()
        for prm in plain.parameters():
            assert type(prm) is torch.nn.Parameter
        opt_tensors = [v for _, s in sorted(opt.state_dict()["state"].items())
                       for _, v in sorted(s.items())]
        if step == 11:
            for i, (name, prm) in enumerate(plain.named_parameters()):
                assert torch.equal(prm, target[f"model/{name}"]), name
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(opt.state[prm][k], target[f"optim/state/{i}/{k}"]), name
            assert digest(opt_tensors) == want["full_optim"]
        else:
            assert digest(plain.parameters()) == one_final["full_params"]
            assert digest(opt_tensors) == one_final["full_optim"]


def digest(tensors) -> str:  # as fsdp_train.py's
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_reshard_refuses_a_missing_rank_file(tmp_path):
    """reshard() says what is missing instead of returning zeros, and
    copies the overlapping part of each old piece."""
    import ctypes

    from nonstop import _fsdp
    from nonstop.errors import IncompatibleCheckpointError

    class Reader:
        def __init__(self, off, n):
            self.off = off
            self.checkpoints = [{"tensors": [{"name": "w", "shape": [n], "global_offset": off,
                                              "dtype": 7, "nbytes": 4 * n}]}]

        def read_into(self, idx, dests, threads=4):  # as the real Reader: every destination
            for ptr, nbytes in dests:
                if nbytes:
                    src = torch.arange(self.off, self.off + nbytes // 4, dtype=torch.float32)
                    ctypes.memmove(ptr, src.data_ptr(), nbytes)
            return {}

    doc = {"w": [[10], "float32", "S0"]}  # rank 1 of 3: rows 4..8
    got = _fsdp.reshard([Reader(0, 5), Reader(5, 5)], [0, 0], doc, 1, 3, "/old", 7)
    assert torch.equal(got["w"], torch.arange(4.0, 8.0))
    with pytest.raises(IncompatibleCheckpointError, match="hold 1 of elements 4..8"):
        _fsdp.reshard([Reader(0, 5)], [0], doc, 1, 3, "/old", 7)


def test_rows_follow_torch_chunk():
    from nonstop import _ext
    for d0 in (0, 1, 5, 7, 67, 64):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(d0).chunk(world) if d0 else []
            sizes = [len(c) for c in chunks] + [0] * (world - len(chunks))
            got = [_ext.core().dist_shard_rows(d0, r, world) for r in range(world)]
            assert [e - b for b, e in got] == sizes, (d0, world)
