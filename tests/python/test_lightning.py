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
            # Whenever last.ckpt exists, the step it names is committed on disk.
            m = read_marker(str(tmp_path / "ck" / "last.ckpt"))
            if m is not None:
                got = nonstop.load(str(tmp_path / "ck" / "nonstop"), step=m["step"])
                assert got.step == m["step"]
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


def test_docs_example_runs_and_resumes(tmp_path):
    import nonstop
    from integration_harness import run_doc_example
    from nonstop.lightning import read_marker
    run_doc_example("LIGHTNING.md", tmp_path, runs=2)  # the second run resumes at the end
    m = read_marker(str(tmp_path / "runs/lightning/last.ckpt"))
    assert m["step"] == 19
    assert nonstop.load(str(tmp_path / "runs/lightning/nonstop")).step == 19


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
