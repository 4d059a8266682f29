"""nonstop.lightning: zero-copy registration of the LightningModule's
parameters and optimizer state, a last.ckpt marker that only ever names a
committed checkpoint, and an exact resume after SIGKILL with
trainer.fit(..., ckpt_path="last")."""
import os

import pytest
import torch

from conftest import needs_engine

L = pytest.importorskip("lightning")
pytestmark = needs_engine


def _fit(tmp_path, steps, callbacks):
    from torchdata.stateful_dataloader import StatefulDataLoader

    import integration_jobs as jobs

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = jobs.Net()

        def training_step(self, batch, batch_idx):
            return jobs.loss_of(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    module = Module()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, default_root_dir=str(tmp_path))
    trainer.fit(module, jobs.loader_of(StatefulDataLoader), ckpt_path="last")
    return trainer, module


def test_zero_copy_and_marker_only_after_commit(tmp_path):
    import nonstop
    from nonstop.lightning import NonstopCheckpoint, read_marker

    seen_markers, registered = [], {}

    class Check(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            # Whenever last.ckpt exists, the step it names is committed on
            # disk (or a newer one is: the ring may have reused its slot
            # before the marker of the newer one is written).
            m = read_marker(str(tmp_path / "ck" / "last.ckpt"))
            if m is not None:
                got = nonstop.load(str(tmp_path / "ck" / "nonstop"))
                assert got.step >= m["step"]
                seen_markers.append(m["step"])
            if cb.ckpt is not None:
                registered.update(refs=cb.ckpt.session.registered, registers=cb.ckpt.session.registers)

    committed = []
    cb = NonstopCheckpoint(str(tmp_path / "ck"), every=2, on_commit=committed.append)
    trainer, module = _fit(tmp_path, 9, [cb, Check()])
    # The engine registered the live tensors once; those the optimizer owns
    # are copied in the background (copy_at_checkpoint False), not in save().
    assert registered["registers"] == 1
    refs = {r[0]: r for r in registered["refs"]}
    params = [n for n in refs if n.startswith("lightning/state_dict/net.fc")]
    assert len(params) == 4 and all(refs[n][8] is False for n in params), refs
    for n in params:
        p = module.net.get_parameter(n.split("/")[-1][len("net."):])
        assert refs[n][4] == p.data_ptr()
    states = [n for n in refs if n.startswith("lightning/optimizer_states/0/state/")]
    assert states and all(refs[n][8] is False for n in states)
    assert refs["lightning/state_dict/net.seen"][8] is True  # a buffer: copied in save()
    assert [s["step"] for s in committed] == [1, 3, 5, 7] and all(s["committed"] for s in committed)
    assert seen_markers and seen_markers == sorted(seen_markers)
    assert read_marker(str(tmp_path / "ck" / "last.ckpt"))["step"] == 7
    got = nonstop.load(str(tmp_path / "ck" / "nonstop"), step=7).state["lightning"]
    assert got["global_step"] == 8 and trainer.global_step == 9


def test_lightning_killed_in_epoch_2_resumes_exactly(tmp_path):
    from integration_harness import EPOCH2, kill_resume_compare
    kill_resume_compare("lightning", tmp_path, **EPOCH2)



def test_load_weights_for_evaluation(tmp_path):
    """last.ckpt is a JSON marker, which Lightning's load_from_checkpoint
    cannot read (torch.load); nonstop.lightning.load_weights gives the
    weights of the step it names, into a fresh module, strictly."""
    import pickle

    import integration_jobs as jobs
    from nonstop.lightning import NonstopCheckpoint, load_weights

    trainer, module = _fit(tmp_path, 6, [NonstopCheckpoint(str(tmp_path / "ck"), every=3)])
    marker = str(tmp_path / "ck" / "last.ckpt")
    with pytest.raises((pickle.UnpicklingError, RuntimeError, EOFError)):
        type(module).load_from_checkpoint(marker)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = jobs.Net()

    fresh = load_weights(marker, Module())
    for k, v in module.state_dict().items():  # step 5 (the last), committed at the end
        assert torch.equal(fresh.state_dict()[k], v), k
    sd = load_weights(str(tmp_path / "ck" / "nonstop"))
    assert set(sd) == set(module.state_dict())


def test_marker_is_read_through_the_seam(tmp_path):
    """read_marker reads last.ckpt through the Env seam (C++
    ReadLightningMarker): a marker is found, a link planted at last.ckpt is
    refused (never followed: None, so Lightning's own loader gets the path),
    a torch file bigger than a marker or not JSON is no marker, nor is one
    naming anything but a directory beside it."""
    import json

    from nonstop.lightning import MARKER_FORMAT, read_marker
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"format": MARKER_FORMAT, "dir": "nonstop", "step": 3}))
    assert read_marker(str(real)) == {"format": MARKER_FORMAT, "dir": "nonstop", "step": 3,
                                      "global_step": 4,
                                      "nonstop_dir": str(tmp_path / "nonstop")}
    for bad in ("../nonstop", "a/b", 5, None):
        (tmp_path / "bad.ckpt").write_text(
            json.dumps({"format": MARKER_FORMAT, "dir": bad, "step": 3}))
        assert read_marker(str(tmp_path / "bad.ckpt")) is None, bad
    os.symlink(real, tmp_path / "last.ckpt")
    assert read_marker(str(tmp_path / "last.ckpt")) is None
    (tmp_path / "big.ckpt").write_bytes(b"\x80" * (1 << 17))
    (tmp_path / "small.ckpt").write_bytes(b"\x80\x02}q\x00.")
    assert read_marker(str(tmp_path / "big.ckpt")) is None
    assert read_marker(str(tmp_path / "small.ckpt")) is None
    assert read_marker(str(tmp_path / "missing" / "last.ckpt")) is None
    assert read_marker(str(tmp_path)) is None


def test_monitor_and_save_top_k_keep_the_best_steps(tmp_path):
    """monitor=/mode=/save_top_k= (ModelCheckpoint's) become best=: the
    metric logged with self.log reaches each checkpoint, and the kept copies
    are the k best by it."""
    import nonstop
    from nonstop.lightning import NonstopCheckpoint

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            # a score that is lowest at steps 3 and 5 (of 0..7)
            self.log("score", float(abs(self.global_step - 4)))
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    from torchdata.stateful_dataloader import StatefulDataLoader
    ds = torch.utils.data.TensorDataset(torch.randn(16, 2))
    loader = StatefulDataLoader(ds, batch_size=2, generator=torch.Generator().manual_seed(1))
    cb = NonstopCheckpoint(str(tmp_path / "ck"), every=2, monitor="score", mode="min",
                           save_top_k=2)
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb], default_root_dir=str(tmp_path))
    trainer.fit(Module(), loader)
    rows = nonstop.list(str(tmp_path / "ck" / "nonstop"))
    assert all("score" in r["metrics"] for r in rows), rows
    kept = sorted(r["step"] for r in rows if r["where"] == "keep")
    # checkpoints of steps 1, 3, 5, 7 with scores 3, 1, 1, 3: the two best kept
    assert kept == [3, 5], rows
    with pytest.raises(nonstop.CheckpointMismatchError, match="save_top_k= needs monitor="):
        NonstopCheckpoint(str(tmp_path), save_top_k=2)


# ---------------------------------------------------------------- cadence

def _tiny_fit(tmp_path, callbacks, max_epochs=-1, max_steps=-1, loader=None, seed=0):
    """A small job (8 samples, batch 2: 4 steps per epoch) with dropout and
    a shuffling loader that resumes exactly; returns (trainer, module)."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.3),
                                           torch.nn.Linear(8, 1))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch[1].tolist())
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(5)
    ds = torch.utils.data.TensorDataset(torch.randn(8, 2, generator=g), torch.arange(8))
    if loader is None:
        loader = StatefulDataLoader(
            ds, batch_size=2, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(1)),
            generator=torch.Generator().manual_seed(2))
    torch.manual_seed(seed)
    module = Module()
    trainer = L.Trainer(max_epochs=max_epochs, max_steps=max_steps, accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, default_root_dir=str(tmp_path))
    trainer.fit(module, loader, ckpt_path="last")
    return trainer, module


def test_every_n_epochs_checkpoints_epoch_ends_and_resumes_from_one(tmp_path):
    """every_n_epochs=2 (ModelCheckpoint's): a checkpoint at the end of
    epochs 2 and 4 only; a run stopped after epoch 3 resumes from the end
    of epoch 2 and ends bit-identical to an uninterrupted one."""
    import nonstop
    from nonstop.lightning import NonstopCheckpoint

    committed = []
    ref, ref_module = _tiny_fit(tmp_path / "ref", [NonstopCheckpoint(
        str(tmp_path / "ref-ck"), every_n_epochs=2, on_commit=committed.append)], max_epochs=4)
    assert [s["step"] for s in committed] == [7, 15] and all(s["committed"] for s in committed)
    got = nonstop.load(str(tmp_path / "ref-ck" / "nonstop"), step=7).state["lightning"]
    assert got["epoch"] == 1 and got["global_step"] == 8

    d = str(tmp_path / "ck")
    _tiny_fit(tmp_path / "a", [NonstopCheckpoint(d, every_n_epochs=2)], max_epochs=3)
    cb = NonstopCheckpoint(d, every_n_epochs=2)
    trainer, module = _tiny_fit(tmp_path / "b", [cb], max_epochs=4, seed=1)  # other init
    assert cb.io.loaded_step == 7 and trainer.global_step == 16  # resumed at the end of epoch 2
    assert module.seen == ref_module.seen[8:]  # epochs 3 and 4, in the same order
    for k, v in ref_module.state_dict().items():
        assert torch.equal(module.state_dict()[k], v), k
    assert torch.equal(trainer.optimizers[0].state_dict()["state"][0]["exp_avg"],
                       ref.optimizers[0].state_dict()["state"][0]["exp_avg"])


def test_train_time_interval_checkpoints_by_the_clock(tmp_path):
    """train_time_interval (a timedelta, ModelCheckpoint's semantics): the
    first optimizer step at least that long after the previous checkpoint
    (or the start). The clock is injected: one second per look."""
    import datetime

    from nonstop.lightning import NonstopCheckpoint

    ticks = []

    def clock():
        ticks.append(None)
        return float(len(ticks))

    committed = []
    cb = NonstopCheckpoint(str(tmp_path / "ck"), on_commit=committed.append,
                           train_time_interval=datetime.timedelta(seconds=2.5))
    cb._clock = clock
    _tiny_fit(tmp_path, [cb], max_steps=9)
    # on_train_start reads 1; the step s reads s + 2: due at 4, 7, 10
    assert [s["step"] for s in committed] == [2, 5, 8]


def test_cadence_options_are_checked_when_made(tmp_path):
    import datetime

    import nonstop
    from nonstop.lightning import NonstopCheckpoint
    hour = datetime.timedelta(hours=1)
    for kwargs, msg in [
        (dict(every=5, every_n_epochs=1), "mutually exclusive"),
        (dict(every_n_train_steps=5, train_time_interval=hour), "mutually exclusive"),
        (dict(every_n_epochs=1, train_time_interval=hour), "mutually exclusive"),
        (dict(every=5, every_n_train_steps=5), "not both"),
        (dict(every_n_epochs=0), "every_n_epochs must be a positive integer"),
        (dict(train_time_interval=60), "positive datetime.timedelta"),
        (dict(train_time_interval=datetime.timedelta(0)), "positive datetime.timedelta"),
    ]:
        with pytest.raises(nonstop.CheckpointMismatchError, match=msg):
            NonstopCheckpoint(str(tmp_path), **kwargs)
    assert NonstopCheckpoint(str(tmp_path), every_n_train_steps=4).every == 4
    assert NonstopCheckpoint(str(tmp_path)).every == 10
    assert NonstopCheckpoint(str(tmp_path), train_time_interval=hour).every is None


def test_other_strategies_and_wrapped_samplers_are_refused(tmp_path):
    """Lightning's FSDPStrategy refuses a CPU accelerator itself; on GPUs it
    loads and saves checkpoints without CheckpointIO, so NonstopCheckpoint
    refuses it in setup: here a subclass, which passes Lightning's
    accelerator check and is refused before torch's FSDP would stop it
    (on main it stopped there: "FSDP needs a non-CPU accelerator device"). A
    DistributedSamplerWrapper (what Lightning makes of a sampler other than
    torch's under DDP) draws its inner sampler anew each epoch, a state no
    loader saves: refused before the first step."""
    import nonstop
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from lightning.pytorch.strategies import FSDPStrategy
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    from nonstop.lightning import NonstopCheckpoint
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(strategy="fsdp", accelerator="cpu", devices=2)

    class FSDPOnCPU(FSDPStrategy):
        pass

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = torch.utils.data.TensorDataset(torch.randn(8, 2))
    trainer = L.Trainer(strategy=FSDPOnCPU(), accelerator="cpu", devices=1, max_steps=2,
                        logger=False, enable_progress_bar=False, default_root_dir=str(tmp_path),
                        callbacks=[NonstopCheckpoint(str(tmp_path / "ck"), every=1)])
    with pytest.raises(nonstop.CheckpointMismatchError, match="not FSDPOnCPU"):
        trainer.fit(Module(), torch.utils.data.DataLoader(ds, batch_size=2))

    wrapped = DistributedSamplerWrapper(RandomSampler(ds, generator=torch.Generator().manual_seed(1)),
                                        num_replicas=2, rank=0)
    loader = StatefulDataLoader(ds, batch_size=2, sampler=wrapped,
                                generator=torch.Generator().manual_seed(2))
    with pytest.raises(nonstop.CheckpointMismatchError, match="DistributedSamplerWrapper"):
        _tiny_fit(tmp_path / "w", [NonstopCheckpoint(str(tmp_path / "ck2"), every=1)],
                  max_steps=2, loader=loader)


# ------------------------------------------------- DDP (2 gloo processes)

def _ddp(d, steps, out, *extra, timeout=120):
    """Runs tests/python/lightning_ddp_train.py as 2 ranks under a hard
    timeout (dist_launch.run_ranks kills both process groups)."""
    import sys
    here = os.path.dirname(__file__)
    sys.path.insert(0, here)
    from dist_launch import run_ranks
    return run_ranks(2, [os.path.join(here, "lightning_ddp_train.py"), str(d), str(steps),
                         str(out), *extra], timeout=timeout)


def _ok(res):
    for rank, (rc, _, err) in enumerate(res):
        assert rc == 0, f"rank {rank} exited {rc}: {err[-3000:]}"


def _final(out, rank):
    import json
    with open(f"{out}.rank-{rank}.json") as f:
        return json.load(f)


def _events(res, name):
    return [[line for line in lines if line["event"] == name] for _, lines, _ in res]


needs_dist = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch built without torch.distributed")


@needs_dist
def test_ddp_killed_in_epoch_3_resumes_bitwise_and_top_k_is_rank_0s(tmp_path):
    """Lightning's DDP strategy, 2 CPU processes (gloo), 5 steps per epoch,
    a checkpoint every 3 steps (after steps 2, 5, 8, 11, 14). After step 12
    (epoch 3) both ranks wait for their checkpoints to commit, meet, and
    SIGKILL themselves (the first to die takes the other with it, as under
    torchrun); the restart resumes both ranks from step 11, the newest
    that every rank committed (whether or not its agreement round ran),
    and ends bit-identical to an uninterrupted run: weights, AdamW state,
    each rank's RNG and data order (a DistributedSampler in epoch 3). The
    uninterrupted run also keeps its save_top_k=2 best checkpoints by a
    metric that ranks the other way on rank 1 (not synced): every rank
    keeps rank 0's best."""
    import nonstop
    ref = tmp_path / "ref"
    res = _ddp(tmp_path / "ref-ck", 15, ref, "--every", "3", "--monitor")
    _ok(res)
    for rank, commits in enumerate(_events(res, "commit")):
        assert [c["step"] for c in commits] == [2, 5, 8, 11, 14], commits
        assert all(c["committed"] for c in commits), commits
        rows = nonstop.list(str(tmp_path / "ref-ck" / "nonstop"), rank=rank)
        # rank 0's scores |s - 6.5|: 4.5, 1.5, 1.5, 4.5, 7.5 -> steps 5 and 8
        assert sorted(r["step"] for r in rows if r["where"] == "keep") == [5, 8], (rank, rows)
    from nonstop.lightning import read_marker
    assert read_marker(str(tmp_path / "ref-ck" / "last.ckpt"))["step"] == 14

    d, out = tmp_path / "ck", tmp_path / "run"
    killed = _ddp(d, 15, out, "--every", "3", "--kill-at", "12")
    assert [rc for rc, _, _ in killed] == [-9, -9], [e[-2000:] for _, _, e in killed]
    assert any(_events(killed, "kill")), killed  # (the first to die takes the other)
    # Rank 0 writes last.ckpt once a step is agreed, a little after every
    # rank committed it; a kill in between left none (it did, now and then,
    # here): the restart must find the checkpoints without it.
    if os.path.exists(d / "last.ckpt"):
        os.unlink(d / "last.ckpt")
    resumed = _ddp(d, 15, out, "--every", "3")
    _ok(resumed)
    # the newest step both ranks committed, agreed or not: 11 (epoch 3)
    restored = [s[0]["restored"] for s in _events(resumed, "start")]
    assert restored == [11, 11], restored
    assert all(s[0]["epoch"] >= 1 for s in _events(resumed, "start"))  # epoch 2 or 3 (from 1)
    for rank in (0, 1):
        a, b = _final(ref, rank), _final(out, rank)
        assert b["restored"] == restored[0]
        for k in ("params", "optim", "rng", "seen_tail", "global_step"):
            assert a[k] == b[k], (rank, k)
    assert _final(out, 0)["params"] == _final(out, 1)["params"]


@needs_dist
def test_ddp_train_time_interval_is_rank_0s_decision(tmp_path):
    """train_time_interval under DDP: rank 0's clock says the interval has
    passed at steps 2, 5, 8 (an injected clock, one second a look), rank 1's
    never does (frozen). Each checkpoint is collective, so rank 0's decision
    is broadcast: both ranks checkpoint steps 2, 5, 8 (without it rank 0
    would wait for rank 1 in the first checkpoint until the timeout)."""
    res = _ddp(tmp_path / "ck", 9, tmp_path / "run", "--interval-s", "2.5", "--fake-clock")
    _ok(res)
    for commits in _events(res, "commit"):
        assert [c["step"] for c in commits] == [2, 5, 8] and all(c["committed"] for c in commits)


@needs_dist
def test_ddp_refuses_a_sampler_lightning_wraps(tmp_path):
    """A torchdata RandomSampler under DDP: Lightning wraps it in a
    DistributedSamplerWrapper, which draws it anew each epoch from a
    generator no checkpoint holds. Refused before the first step, on every
    rank, with the fix."""
    res = _ddp(tmp_path / "ck", 4, tmp_path / "run", "--every", "2", "--loader", "torchdata")
    for rc, lines, err in res:
        assert rc != 0 and not any(line["event"] == "step" for line in lines)
        assert "DistributedSamplerWrapper" in err and "RandomSampler(dataset)" in err, err[-2000:]
