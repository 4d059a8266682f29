"""mode="layerwise" (LightCheck): the optimizer runs in backward, each
parameter's copy starts right after its update, and the next update of a
parameter waits for that parameter's copy alone.

* the update arithmetic is the wrapped optimizer's: a layer-wise AdamW run
  ends bitwise equal to a normal one (with and without gradient clipping);
* every tensor in the checkpoint of step s holds its step-s value (compared
  with reference snapshots taken synchronously at step s), for every copy
  strategy and random in-flight limits and chunk sizes;
* a real kill -9 at a random step, then a restart, finishes bit-identically
  to an uninterrupted run (crash_harness.py: every subprocess has a hard
  timeout).
"""
import random
import time

import pytest
import torch
from conftest import needs_engine

import crash_harness as ch
import nonstop
import tiny

KILL_STEPS = 20


def run_normal(steps, clip=None):
    model, opt, sched = tiny.make()
    for s in range(steps):
        train_step(model, opt, sched, s, clip)
    return model, opt


def train_step(model, opt, sched, step, clip=None):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 32, (8, 4), generator=g)
    y = torch.randint(0, 32, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    sched.step()
    return loss.item()


def assert_same_state(a, b):
    sa, sb = tiny.state_bytes(*a), tiny.state_bytes(*b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k] == sb[k], f"{k} differs"


@needs_engine
@pytest.mark.parametrize("copy,every", [("host", 1), ("host", 3), ("direct", 2), ("device", 1)])
def test_layerwise_adamw_is_bitwise_equal_to_normal_adamw(tmp_path, copy, every):
    steps = 12
    ref = run_normal(steps)
    model, opt, sched = tiny.make()
    with nonstop.Checkpointer(str(tmp_path / "ck"), {"model": model, "optim": opt,
                                                     "sched": sched}, every=every,
                              mode="layerwise", copy=copy, medium="buffered") as ck:
        for s in range(steps):
            train_step(model, opt, sched, s)  # the loop is unchanged
            ck.step(s)
        ck.wait()
        assert ck.latest() == max(s for s in range(steps) if (s + 1) % every == 0)
        stats = ck.stats()
    assert stats["failed"] == 0 and stats["committed"] >= 1
    assert_same_state(ref, (model, opt))
    # The newest checkpoint restores into a fresh model and equals the live state then.
    loaded = nonstop.load(str(tmp_path / "ck"))
    assert loaded.step == stats["recent"][-1]["step"]


@needs_engine
def test_layerwise_with_gradient_clipping_is_bitwise_equal(tmp_path):
    steps = 8
    ref = run_normal(steps, clip=0.05)
    model, opt, sched = tiny.make()
    with nonstop.Checkpointer(str(tmp_path / "ck"), {"model": model, "optim": opt},
                              every=2, mode="layerwise", clip_grad_norm=0.05,
                              medium="buffered") as ck:
        for s in range(steps):
            train_step(model, opt, sched, s)  # no manual clipping: the option does it
            ck.step(s)
    assert_same_state(ref, (model, opt))


class MLP(torch.nn.Module):
    """Big enough that parameters span several chunks and copies take time."""

    def __init__(self, dim=512, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def flat_state(model, opt):
    out = {}
    for k, v in model.state_dict().items():
        out[f"model/{k}"] = v.detach().clone()
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/state/{pid}/{k}"] = v.detach().clone()
    return out


@needs_engine
@pytest.mark.parametrize("seed", range(4))
def test_every_tensor_of_a_checkpoint_holds_its_step_value(tmp_path, seed):
    rnd = random.Random(seed)
    copy = ["host", "direct", "device", "host"][seed]
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    every = rnd.choice([1, 2])
    refs = {}
    d = str(tmp_path / "ck")
    # A small staging pool on a real file: copies lag behind the training
    # thread (staging waits), so a missing wait would show.
    chunk = 4096 * rnd.choice([4, 16])
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=every, mode="layerwise",
                              copy=copy, max_in_flight=rnd.choice([1, 2, 3]), chunk_bytes=chunk,
                              staging_bytes=8 * chunk, writers=2,
                              medium=["buffered", "buffered", "mmap", "pmem"][seed],
                              rng=False) as ck:
        for s in range(10):
            x = torch.randn(16, 512)
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if (s + 1) % every == 0:
                refs[s] = flat_state(model, opt)  # synchronous reference
            ck.step(s)
            if rnd.random() < 0.3:
                time.sleep(rnd.random() * 0.01)
        ck.wait()
    reader = nonstop._core.Reader(d)
    checked = 0
    for c in reader.checkpoints:
        if not c["committed"]:
            continue
        loaded = nonstop.load(d, step=c["step"])
        ref = refs[c["step"]]
        for name, t in ref.items():
            got = loaded.tensors[name]
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                f"{name} of the checkpoint of step {c['step']}"
        checked += 1
    assert checked >= 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run with a normal optimizer (no checkpointer)."""
    return ch.reference(tmp_path_factory, KILL_STEPS)


@needs_engine
@pytest.mark.parametrize("seed", range(3))
def test_layerwise_kill_at_random_step_then_resume_bit_identically(reference, tmp_path, seed):
    rnd = random.Random(seed)
    every = rnd.choice([1, 3])
    copy = ["host", "direct", "device"][seed]
    kill_after = rnd.randrange(every + 1, KILL_STEPS - 2)
    d, final = str(tmp_path / "ck"), str(tmp_path / "final")
    restored = ch.kill_then_resume(d, KILL_STEPS, every, final, kill_after,
                                   kill_delay=rnd.choice([0.0, 0.003, 0.02]), pace=0.05,
                                   options={"mode": "layerwise", "copy": copy})
    assert restored is not None and restored < kill_after
    # The rest equal as values: optimizer.state_dict()["state"] lists the
    # parameters in the order their state was created, which is backward
    # order under layerwise (load_state_dict does not depend on it).
    ch.assert_same_final(reference, final, ordered=False)
