"""A directory written by 2 ranks, restored by 1 process: a reshard that
cannot find a checkpoint committed on every old rank file raises one line
naming that file and why; it never returns None (which restarts training
from step 0 over committed checkpoints).

The two rank files are written by the real engine, one per rank, with the
layout a 2-rank job records (each rank holds half of tensor 't')."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
import nonstop  # noqa: E402
from nonstop import _ext, _read  # noqa: E402
from nonstop.errors import CorruptCheckpointError, IncompatibleCheckpointError  # noqa: E402


def write_rank(d, rank, lineage, steps):
    """Rank `rank` of a 2-rank job: checkpoints of `steps`, each holding
    t = [step] * 4, this rank's half of it."""
    engine = _ext.core().Engine(d, rank=rank, world_size=2, max_in_flight=1)
    half = torch.zeros(2)
    engine.register([("t", 7, [2], 8, half.data_ptr(), 0, 0, 0, False)], layouts=[([4], 2 * rank)])
    for s in steps:
        half.fill_(float(s))
        meta = {"format": _read.FORMAT, "step": s, "rank": rank, "world_size": 2,
                "state": {"t": {"__tensor__": "t"}},
                "dist": {"world_size": 2, "lineage": lineage, "replicated": "shard",
                         "shared": {"t": [[4], "float32"]}, "local": [], "own": [], "ddp": [],
                         "zero": {}}}
        engine.wait_committed(engine.checkpoint(s, json.dumps(meta)))
    engine.close()


def damage_all(d, rank):
    """Flips a data byte of every checkpoint of `rank`'s file."""
    reader = _ext.core().Reader(d, rank=rank, verify_data=False)
    with open(reader.path, "r+b") as f:
        for c in reader.checkpoints:
            f.seek(c["data_offset"])
            b = f.read(1)
            f.seek(c["data_offset"])
            f.write(bytes([b[0] ^ 0xFF]))


def restore_one(d):
    t = torch.full((4,), -1.0)
    ckpt = nonstop.Checkpointer(d, {"t": t}, every=1, on_preempt=False)
    try:
        return ckpt.restore(), t
    finally:
        ckpt.close()


def test_healthy_two_rank_directory_reshards_to_one_process(tmp_path):
    d = str(tmp_path / "ck")
    write_rank(d, 0, 11, [3, 5])
    write_rank(d, 1, 11, [3, 5])
    with pytest.warns(UserWarning, match="world size 2"):
        step, t = restore_one(d)
    assert step == 5 and torch.equal(t, torch.full((4,), 5.0))


def test_old_rank_file_of_another_job_raises(tmp_path):
    d = str(tmp_path / "ck")
    write_rank(d, 0, 11, [3, 5])
    write_rank(d, 1, 22, [3, 5])  # another run's rank 1
    with pytest.warns(UserWarning, match="world size 2"):
        with pytest.raises(IncompatibleCheckpointError) as e:
            restore_one(d)
    msg = str(e.value)
    assert "\n" not in msg and "rank-00001.nsck" in msg and "another job" in msg, msg


def test_old_rank_file_damaged_everywhere_raises(tmp_path):
    d = str(tmp_path / "ck")
    write_rank(d, 0, 11, [3, 5])
    write_rank(d, 1, 11, [3, 5])
    damage_all(d, 1)
    with pytest.warns(UserWarning, match="world size 2"):
        with pytest.raises(CorruptCheckpointError) as e:
            restore_one(d)
    msg = str(e.value)
    assert "\n" not in msg and "rank-00001.nsck" in msg and "no committed checkpoint" in msg, msg


def test_old_rank_file_damaged_newest_falls_back(tmp_path):
    d = str(tmp_path / "ck")
    write_rank(d, 0, 11, [3, 5])
    write_rank(d, 1, 11, [3])      # rank 1 never committed step 5
    with pytest.warns(UserWarning, match="world size 2"):
        step, t = restore_one(d)
    assert step == 3 and torch.equal(t, torch.full((4,), 3.0))
    assert os.path.isdir(os.path.join(d, "world-2"))


def test_every_old_rank_file_damaged_raises_never_a_fresh_start(tmp_path):
    d = str(tmp_path / "ck")
    write_rank(d, 0, 11, [3, 5])
    write_rank(d, 1, 11, [3, 5])
    damage_all(d, 0)
    damage_all(d, 1)
    with pytest.warns(UserWarning, match="world size 2"):
        with pytest.raises(CorruptCheckpointError) as e:
            restore_one(d)
    msg = str(e.value)
    assert "\n" not in msg and "rank-0000" in msg and "no committed checkpoint" in msg, msg


def test_old_rank_files_of_one_step_from_two_runs_are_never_mixed(tmp_path):
    d = str(tmp_path / "ck")
    write_rank(d, 0, 11, [3])
    write_rank(d, 1, 11, [3])
    # Both ranks wrote step 5, rank 1 in another run (it was restarted from
    # elsewhere): step 5 is not one checkpoint; step 3 is.
    write_rank(d, 0, 11, [5])  # an engine reopened on its file numbers after what is there
    write_rank(d, 1, 22, [5])
    with pytest.warns(UserWarning, match="world size 2"):
        step, t = restore_one(d)
    assert step == 3 and torch.equal(t, torch.full((4,), 3.0))
