"""Issue 23: one answer to "which checkpoint?". Every reader (restore, load,
export, the DCP export, `nonstop verify/inspect/ls`, nonstop.list) asks the
one recovery planner, so they agree on a rolled-back lineage and on damage."""
import os
import subprocess
import warnings

import pytest

torch = pytest.importorskip("torch")
import nonstop  # noqa: E402
from nonstop import _core  # noqa: E402
from nonstop.errors import CheckpointNotFoundError, CorruptCheckpointError  # noqa: E402
from conftest import nonstop_cli, warned  # noqa: E402

def _cli(*args):
    cli = nonstop_cli()
    if cli is None:
        pytest.skip("the nonstop CLI is not built")
    return subprocess.run([cli, *args], capture_output=True, text=True, timeout=60)


def _commit(ck, model, steps, value):
    for s in steps:
        with torch.no_grad():
            model.weight.fill_(value(s))
        ck.step(s)
        ck.wait()


def _rolled_back(d, new19=True):
    """Commits 9, 19, 29 (weights = step), restores step 9 and, with new19,
    commits a new step 19 whose weights are -19."""
    model = torch.nn.Linear(4, 4)
    with nonstop.Checkpointer(d, state={"model": model}, every=1, rng=False) as ck:
        _commit(ck, model, [9, 19, 29], float)
    model = torch.nn.Linear(4, 4)
    with nonstop.Checkpointer(d, state={"model": model}, every=1, rng=False) as ck:
        assert ck.restore(step=9) == 9
        if new19:
            _commit(ck, model, [19], lambda s: -float(s))


def test_dcp_export_never_writes_an_abandoned_future(tmp_path):
    # Case 1: load and the safetensors export give the new 19; so must DCP.
    d = str(tmp_path / "ck")
    _rolled_back(d)
    assert nonstop.load(d).step == 19
    from nonstop import _dcp
    step, tensors, _, _ = _dcp.gather(d)
    assert step == 19
    assert torch.equal(tensors[0]["model/weight"], torch.full((4, 4), -19.0))


def test_exports_verify_and_inspect_agree_with_load_after_a_rollback(tmp_path):
    # Case 2 (and 7: the rollback is recorded by restore(step=9) itself).
    d = str(tmp_path / "ck")
    _rolled_back(d, new19=False)
    # As a kill while the first new checkpoint is in flight leaves it (on
    # every version): the lineage record written, nothing newer committed.
    w = _core.JobDir.open_for_write(d)
    w.record_restore(0, next(c["counter"] for c in w.list(0) if c["step"] == 9))
    w.close()
    assert nonstop.load(d).step == 9
    out = str(tmp_path / "m.safetensors")
    assert nonstop.export(d, out)["step"] == 9
    with pytest.raises(CheckpointNotFoundError):
        nonstop.load(d, step=29)
    with pytest.raises(CheckpointNotFoundError):
        nonstop.export(d, str(tmp_path / "m29.safetensors"), step=29)
    from nonstop import _dcp
    assert _dcp.gather(d)[0] == 9
    r = _cli("verify", d)
    assert r.returncode == 0 and "step 9 verified" in r.stdout, r.stdout + r.stderr
    r = _cli("verify", d, "--step", "29")
    assert r.returncode != 0 and "abandoned" in r.stderr, r.stdout + r.stderr
    r = _cli("export", d, "-o", str(tmp_path / "c.safetensors"))
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "c.safetensors"))
    assert torch.equal(got["model/weight"], torch.full((4, 4), 9.0))
    r = _cli("export", d, "-o", str(tmp_path / "c29.safetensors"), "--step", "29")
    assert r.returncode != 0 and "abandoned" in r.stderr, r.stdout + r.stderr
    r = _cli("inspect", d)
    line29 = next(ln for ln in r.stdout.splitlines() if "step 29" in ln and "#" in ln)
    assert "abandoned" in line29, r.stdout
    line9 = next(ln for ln in r.stdout.splitlines() if "step 9 " in ln and "#" in ln)
    assert "(newest)" in line9, r.stdout


def test_a_rollback_is_durable_before_restore_returns(tmp_path):
    # Case 7: restore(step=9), then a crash before any new checkpoint.
    d = str(tmp_path / "ck")
    _rolled_back(d, new19=False)
    assert _core.JobDir.open_for_read(d).lineage(0)["restored"] > 0
    model = torch.nn.Linear(4, 4)
    with nonstop.Checkpointer(d, state={"model": model}, every=1, rng=False) as ck:
        assert ck.restore() == 9
    assert torch.equal(model.weight, torch.full((4, 4), 9.0))


def _three(d):
    model = torch.nn.Linear(64, 64)
    with nonstop.Checkpointer(d, state={"model": model}, every=1, rng=False) as ck:
        _commit(ck, model, [1, 2, 3], float)


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "directory"])
def test_a_damaged_slot_file_is_never_no_checkpoint(tmp_path, damage):
    # Cases 5 and 6: restore raises naming the damage; ls and list report it.
    d = str(tmp_path / "ck")
    _three(d)
    slot = os.path.join(d, "rank-00000.nsck")
    if damage == "truncated":
        os.truncate(slot, 8192)
    elif damage == "zeroed":
        size = os.path.getsize(slot)
        with open(slot, "r+b") as f:
            f.write(b"\0" * size)
    else:
        os.remove(slot)
        os.mkdir(slot)
    listed = nonstop.list(d)
    assert listed and all(c["state"] == "damaged" for c in listed), listed
    r = _cli("ls", d)
    assert r.returncode != 0 and "no checkpoint" not in r.stdout, r.stdout + r.stderr
    model = torch.nn.Linear(64, 64)
    with pytest.raises((CorruptCheckpointError, nonstop.errors.CheckpointError)) as e:
        with nonstop.Checkpointer(d, state={"model": model}, every=1, rng=False) as ck:
            ck.restore()
    if damage == "truncated":
        assert "truncated" in str(e.value)


def _remote_job(d, url, steps, value, restore_step=None):
    """Commits `steps` (weights value(step)) with the remote tier at `url`;
    close() waits for the newest upload."""
    model = torch.nn.Linear(4, 4)
    with nonstop.Checkpointer(d, state={"model": model}, every=1, rng=False,
                              remote=url) as ck:
        if restore_step is not None:
            assert ck.restore(step=restore_step) == restore_step
        for s in steps:
            with torch.no_grad():
                model.weight.fill_(value(s))
            ck.step(s)
            ck.wait()
    return model


def _fresh_restore(d, url):
    """(the step restored, the model, what it warned: the message of an
    assertion about the step)."""
    model = torch.nn.Linear(4, 4)
    with nonstop.Checkpointer(d, state={"model": model}, every=1, rng=False, remote=url) as ck:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            got = ck.restore()
    return got, model, f"restored {got}; {warned(rec)}"


def test_after_a_rollback_the_new_checkpoint_is_uploaded_and_a_new_node_gets_it(tmp_path):
    # Case 3: the remote's old COMMITTED marker of step 19 is not the new 19.
    from nonstop import _remote
    d, url = str(tmp_path / "local"), str(tmp_path / "shared")
    _remote_job(d, url, [9, 19, 29], float)
    _remote_job(d, url, [19], lambda s: -float(s), restore_step=9)
    new19 = max(c["counter"] for c in nonstop.list(d) if c["step"] == 19)
    store = _remote.open_store(url, {})
    markers = dict(_core.RemoteTier(store).committed_steps())
    assert markers[19]["counter"] == new19, markers
    import shutil
    shutil.rmtree(d)  # the replaced node
    got, model, why = _fresh_restore(d, url)
    assert got == 19, why
    assert torch.equal(model.weight, torch.full((4, 4), -19.0))


def _flip_bit(d, rank, step):
    """One bit flipped in the data of rank `rank`'s local checkpoint of `step`."""
    info = next(c for c in _core.Reader(d, rank=rank, verify_data=False).checkpoints
                if c["step"] == step)
    with open(os.path.join(d, _core.JobDir.slot_name(rank)), "r+b") as f:
        f.seek(info["data_offset"] + 5)
        b = f.read(1)
        f.seek(info["data_offset"] + 5)
        f.write(bytes([b[0] ^ 0x10]))

def test_a_damaged_local_newest_restores_its_intact_remote_copy(tmp_path):
    # Case 4: not an older local checkpoint.
    d, url = str(tmp_path / "local"), str(tmp_path / "shared")
    _remote_job(d, url, [14, 19], float)
    _flip_bit(d, 0, 19)
    got, model, why = _fresh_restore(d, url)
    assert got == 19, why
    assert torch.equal(model.weight, torch.full((4, 4), 19.0))


def test_a_fresh_job_refuses_another_jobs_remote_prefix_unless_it_adopts_it(tmp_path):
    # Case 8: the remote names its job (JOB); another job is refused.
    from nonstop.errors import IncompatibleCheckpointError
    url = str(tmp_path / "shared")
    _remote_job(str(tmp_path / "job-a"), url, [5], float)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(IncompatibleCheckpointError, match=r"belongs to job .*job-a.*'adopt': True"):
        with nonstop.Checkpointer(str(tmp_path / "job-b"), state={"model": model}, every=1,
                                  rng=False, remote=url) as ck:
            ck.restore()
    with nonstop.Checkpointer(str(tmp_path / "job-b"), state={"model": model}, every=1,
                              rng=False, remote=url, remote_options={"adopt": True}) as ck:
        assert ck.restore() == 5
    assert torch.equal(model.weight, torch.full((4, 4), 5.0))


def test_ranks_agree_on_the_lineages_newest_not_the_highest_step(tmp_path):
    """Distributed restart after a rollback whose new checkpoint has a lower
    step (the run counts anew from 5 after restore(step=9)): every rank
    restores step 5, the newest checkpoint of the lineage, as the single
    process does, not step 9 (the highest step still live)."""
    import json
    import sys
    import torch
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    here = os.path.dirname(__file__)
    sys.path.insert(0, here)
    from dist_launch import run_ranks
    d = str(tmp_path / "job")
    script = os.path.join(here, "rollback_dist_train.py")
    for phase in ("write", "rollback", "restore"):
        res = run_ranks(2, [script, d, phase], timeout=90)
        for rank, (rc, _, err) in enumerate(res):
            assert rc == 0, f"{phase}: rank {rank} exited {rc}: {err[-2000:]}"
    got = [json.loads(out[-1]) if isinstance(out[-1], str) else out[-1] for _, out, _ in res]
    assert [(g["restored"], g["weight"]) for g in got] == [(5, 5.0), (5, 5.0)], got


def _remote_ranks(tmp_path, phases, between=None):
    """Runs remote_pick_dist_train.py's phases on 2 ranks (gloo) with the
    remote tier at tmp_path/shared, each under a hard timeout; between(phase)
    runs after each phase. Returns the last phase's lines, by rank."""
    import json
    import sys
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    here = os.path.dirname(__file__)
    sys.path.insert(0, here)
    from dist_launch import run_ranks
    d, url = str(tmp_path / "job"), str(tmp_path / "shared")
    script = os.path.join(here, "remote_pick_dist_train.py")
    for phase in phases:
        res = run_ranks(2, [script, d, url, phase], timeout=90)
        for rank, (rc, _, err) in enumerate(res):
            assert rc == 0, f"{phase}: rank {rank} exited {rc}: {err[-2000:]}"
        if between is not None:
            between(phase, d)
    return [out[-1] if isinstance(out[-1], dict) else json.loads(out[-1]) for _, out, _ in res]


@pytest.mark.timeout(300)
def test_ranks_never_restore_an_abandoned_future_from_the_remote(tmp_path):
    """Distributed case 3: after restore(step=9) and a new step 19, the
    remote still holds step 29 of the abandoned run; a restart restores the
    new 19 (the planner drops 29 by its counter), not the remote's 29."""
    got = _remote_ranks(tmp_path, ("write", "rollback", "restore"))
    assert [(g["restored"], g["weight"]) for g in got] == [(13, -13.0), (13, -13.0)], got


@pytest.mark.timeout(300)
def test_ranks_restore_a_damaged_local_newests_intact_remote_copy(tmp_path):
    """Distributed case 4: one bit flipped in rank 1's local step 29, its
    remote copy intact: every rank restores 29 from the remote, not the
    older local 19."""
    def damage(phase, d):
        if phase == "write":
            _flip_bit(d, 1, 29)
    got = _remote_ranks(tmp_path, ("write", "restore"), damage)
    assert [(g["restored"], g["weight"]) for g in got] == [(29, 29.0), (29, 29.0)], got
    assert all(g["from"].endswith("step-000000000029") for g in got), got
