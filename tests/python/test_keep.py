"""keep=k: every k-th checkpoint is kept forever in DIR/keep/step-N/."""
import os

import pytest

torch = pytest.importorskip("torch")
import nonstop  # noqa: E402


def test_every_kth_checkpoint_is_kept_and_loadable(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = {}
    with nonstop.Checkpointer(str(tmp_path / "ck"), state={"model": model}, every=1, keep=2,
                              rng=False) as ckpt:
        for step in range(6):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            weights[step] = model.weight.detach().clone()
            ckpt.step(step)
            ckpt.wait()
    keep_dir = tmp_path / "ck" / "keep"
    kept = sorted(os.listdir(keep_dir))
    assert len(kept) == 3, kept  # counters 2, 4, 6 of six checkpoints
    for name in kept:
        step = int(name.split("-")[1])
        loaded = nonstop.load(str(keep_dir / name))
        assert loaded.step == step
        assert torch.equal(loaded.tensors["model/weight"], weights[step])


def test_keep_rejects_nonsense(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(nonstop.CheckpointError, match="keep must be"):
        nonstop.Checkpointer(str(tmp_path / "ck"), state={"model": model}, keep=0)
