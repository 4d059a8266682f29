"""Exact data order across epochs (python/nonstop/_data.py,
docs/EXACT_RESUME.md): a loader whose restored order would differ from the
uninterrupted run's is refused with one line naming the fix, in a plain
Checkpointer, with Accelerate's prepared loader and in the Lightning
callback; the recipe the docs give is accepted. The kill-and-resume tests in
epoch 2 are test_accelerate.py and test_lightning.py (integration_harness.EPOCH2)."""
import pytest
import torch

import nonstop
from conftest import needs_engine

torchdata = pytest.importorskip("torchdata")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler  # noqa: E402,E501

pytestmark = needs_engine

DS = torch.utils.data.TensorDataset(torch.arange(12))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _loader(recipe):
    if recipe == "exact":
        return StatefulDataLoader(DS, batch_size=3, sampler=StatefulRandomSampler(DS, generator=_gen(7)),
                                  generator=_gen(8))
    if recipe == "e778719":  # the recipe documented at e778719
        return StatefulDataLoader(DS, batch_size=3,
                                  sampler=torch.utils.data.RandomSampler(DS, generator=_gen(7)),
                                  generator=_gen(8))
    if recipe == "shared":
        return StatefulDataLoader(DS, batch_size=3, shuffle=True, generator=_gen(8))
    if recipe == "no_generator":
        return StatefulDataLoader(DS, batch_size=3, sampler=StatefulRandomSampler(DS, generator=_gen(7)))
    if recipe == "sequential":
        return StatefulDataLoader(DS, batch_size=3, generator=_gen(8))
    raise AssertionError(recipe)


def _batches(loader, n, it=None):
    out = []
    it = iter(loader) if it is None else it
    while len(out) < n:
        try:
            out.append(next(it)[0].tolist())
        except StopIteration:
            it = iter(loader)
    return out, it


@pytest.mark.parametrize("recipe,exact", [("exact", True), ("sequential", True),
                                          ("e778719", False), ("shared", False)])
def test_what_a_restored_loader_yields_in_epoch_2(recipe, exact):
    """Why the refusals exist (torchdata's behaviour, no nonstop): the state
    taken mid-epoch 2 (4 batches per epoch, after 6), loaded into a new
    loader, yields the uninterrupted order only with the exact recipes."""
    ref = _loader(recipe)
    head, it = _batches(ref, 6)
    state = ref.state_dict()
    tail, _ = _batches(ref, 6, it)
    again = _loader(recipe)
    again.load_state_dict(state)
    got, _ = _batches(again, 6)
    assert (got == tail) is exact, (recipe, tail, got)


@pytest.mark.parametrize("recipe,says", [
    ("e778719", "restores the position of a torch.utils.data.sampler.RandomSampler"),
    ("shared", "the sampler draws from the loader's own generator"),
    ("no_generator", "has no generator="),
])
def test_a_loader_that_would_not_resume_exactly_is_refused(tmp_path, recipe, says):
    with pytest.raises(nonstop.CheckpointMismatchError) as e:
        nonstop.Checkpointer(str(tmp_path / "ck"), {"data": _loader(recipe)}, every=1)
    msg = str(e.value)
    assert "\n" not in msg and says in msg and "state['data']" in msg, msg
    assert "docs/EXACT_RESUME.md" in msg
    assert not (tmp_path / "ck").exists()  # refused before anything was created


@pytest.mark.parametrize("recipe", ["exact", "sequential"])
def test_the_exact_recipes_are_accepted(tmp_path, recipe):
    ckpt = nonstop.Checkpointer(str(tmp_path / "ck"), {"data": _loader(recipe)}, every=1)
    ckpt.close()


def test_a_sampler_in_lightnings_ddp_wrapper_is_refused_unless_sequential():
    """_data.check_loader finds Lightning's DistributedSamplerWrapper (by
    its class; what Lightning makes of a sampler other than torch's under
    DDP): around a random sampler it is refused, naming the inner sampler,
    even for a loader that keeps no state; around torch's SequentialSampler
    (an order of no epoch) it is accepted."""
    from nonstop import _data
    wrapper = pytest.importorskip("lightning.fabric.utilities.distributed").DistributedSamplerWrapper

    def loader(inner, cls=torch.utils.data.DataLoader):
        return cls(DS, batch_size=3, generator=_gen(8),
                   sampler=wrapper(inner, num_replicas=2, rank=0))

    for cls in (torch.utils.data.DataLoader, StatefulDataLoader):
        with pytest.raises(nonstop.CheckpointMismatchError,
                           match="wraps its RandomSampler in a DistributedSamplerWrapper"):
            _data.check_loader(loader(StatefulRandomSampler(DS, generator=_gen(7)), cls), "here")
        _data.check_loader(loader(torch.utils.data.SequentialSampler(DS), cls), "here")


def test_accelerate_prepared_loader_is_checked(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))
    bad = acc.prepare(_loader("e778719"))
    with pytest.raises(nonstop.CheckpointMismatchError, match="not its permutation"):
        nonstop.Checkpointer(str(tmp_path / "bad"), {"data": bad}, every=1)
    good = acc.prepare(_loader("exact"))
    nonstop.Checkpointer(str(tmp_path / "good"), {"data": good}, every=1).close()


def test_lightning_refuses_the_loader_before_the_first_step(tmp_path):
    L = pytest.importorskip("lightning")
    from nonstop.lightning import NonstopCheckpoint

    steps = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            return self.lin(batch[0].float().unsqueeze(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[NonstopCheckpoint(str(tmp_path / "ck"), every=1)],
                        default_root_dir=str(tmp_path))
    with pytest.raises(nonstop.CheckpointMismatchError, match="train dataloader 0: .*not its permutation"):
        trainer.fit(Module(), _loader("e778719"))
    assert steps == []
