"""nonstop._core.JobDir: the job directory's one owner, from Python."""
import os

import pytest

torch = pytest.importorskip("torch")
import nonstop  # noqa: E402
from nonstop import _core  # noqa: E402
from nonstop.errors import (CheckpointMismatchError, CheckpointNotFoundError,  # noqa: E402
                            CorruptCheckpointError, IncompatibleCheckpointError)


def _train(path, steps, keep=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    weights = {}
    with nonstop.Checkpointer(path, state={"model": model}, every=1, keep=keep, rng=False) as ck:
        for step in range(steps):
            with torch.no_grad():
                model.weight.add_(1.0)
            weights[step] = model.weight.detach().clone()
            ck.step(step)
            ck.wait()
    return weights


def _read(sel, name):
    for i, spec in enumerate(sel.info["tensors"]):
        if spec["name"] == name:
            t = torch.empty(spec["shape"], dtype=torch.float32)
            sel.read_tensor(i, t.data_ptr(), spec["nbytes"])
            return t
    raise KeyError(name)


def test_second_writer_is_refused_and_readers_take_no_lock(tmp_path):
    d = str(tmp_path / "ck")
    w = _core.JobDir.open_for_write(d)
    with pytest.raises(IncompatibleCheckpointError, match=r"\.nonstop\.lock.*pid %d on host" % os.getpid()):
        _core.JobDir.open_for_write(d)
    r = _core.JobDir.open_for_read(d)
    assert r.select() is None  # nothing written yet: a fresh start
    w.close()
    _core.JobDir.open_for_write(d).close()
    with pytest.raises(CheckpointNotFoundError):
        _core.JobDir.open_for_read(str(tmp_path / "missing"))


def test_select_reads_the_newest_and_a_rollback_is_final(tmp_path):
    d = str(tmp_path / "ck")
    weights = _train(d, 4)
    r = _core.JobDir.open_for_read(d)
    sel = r.select()
    assert sel.step == 3 and sel.where == "rank-00000.nsck" and not sel.fallback
    assert torch.equal(_read(sel, "model/weight"), weights[3])
    listed = r.list()
    assert [c["state"] for c in listed][:1] == ["committed"]
    older = next(c for c in listed if c["step"] < 3 and c["state"] == "committed")
    w = _core.JobDir.open_for_write(d)
    chosen = w.select(step=older["step"])
    w.record_restore(0, chosen.counter)
    assert w.lineage()["restored"] == chosen.counter
    assert w.next_counter() > max(c["counter"] for c in listed)
    assert w.protected_counter() == chosen.counter
    again = _core.JobDir.open_for_read(d).select()
    assert again.step == older["step"]
    assert any("abandoned" in s for s in again.skipped)
    with pytest.raises(CheckpointNotFoundError):
        _core.JobDir.open_for_read(d).select(step=3)
    with pytest.raises(CheckpointMismatchError):
        w.record_restore(1, 1)  # not this writer's rank


def test_keep_copies_are_listed_and_selected(tmp_path):
    d = str(tmp_path / "ck")
    weights = _train(d, 4, keep=2)
    os.remove(os.path.join(d, "rank-00000.nsck"))
    r = _core.JobDir.open_for_read(d)
    sel = r.select()
    assert sel.keep and sel.where.startswith("keep/step-")
    assert torch.equal(_read(sel, "model/weight"), weights[sel.step])


def test_agreed_records_and_hostile_ones(tmp_path):
    d = str(tmp_path / "ck")
    w = _core.JobDir.open_for_write(d)
    assert w.read_agreed() is None
    w.write_agreed({"step": 5, "counter": -1, "lineage": 3, "world_size": 1,
                    "resharded_from": ("world-2", 2)})
    assert w.read_agreed()["resharded_from"] == ("world-2", 2)
    with open(os.path.join(d, _core.JobDir.agreed_name(0)), "w") as f:
        f.write("[" * 100000)
    with pytest.raises(CorruptCheckpointError):
        w.read_agreed()
    assert w.set_aside_worlds() == [] and not w.needs_set_aside(1)
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("x")
    assert w.foreign_entries() == ["notes.txt"]
