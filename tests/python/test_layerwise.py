"""mode="layerwise" (LightCheck): the optimizer runs in backward, each
parameter's copy starts right after its update, and the next update of a
parameter waits for that parameter's copy alone.

* the update arithmetic is the wrapped optimizer's: a layer-wise AdamW run
  ends bitwise equal to a normal one (with and without gradient clipping);
* every tensor in the checkpoint of step s holds its step-s value (compared
  with reference snapshots taken synchronously at step s), for every copy
  strategy and random in-flight limits and chunk sizes;
* a real kill -9 at a random step, then a restart, finishes bit-identically
  to an uninterrupted run. Every subprocess has a hard timeout.
"""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import needs_engine
from safetensors.torch import load_file

import nonstop
import tiny
from nonstop import _state

HERE = os.path.dirname(__file__)
TIMEOUT = 120
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


CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    sys.path.insert(0, {here!r})
    import nonstop, tiny
    from nonstop import _state

    torch.set_num_threads(1)
    d, steps, every, final, copy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    model, opt, sched = tiny.make()
    train = {{"tokens": 0}}
    start, ckpt = 0, None
    if d != "-":
        ckpt = nonstop.Checkpointer(d, {{"model": model, "optim": opt, "sched": sched, "train": train}},
                                    every=every, mode="layerwise", copy=copy)
        r = ckpt.restore()
        start = 0 if r is None else r + 1
        print(json.dumps({{"event": "start", "restored": r}}), flush=True)
    for s in range(start, steps):
        tiny.train_step(model, opt, sched, s)
        train["tokens"] += 32
        if ckpt is not None:
            ckpt.step(s)
        print(json.dumps({{"event": "step", "step": s}}), flush=True)
        time.sleep(0.05)
    if ckpt is not None:
        ckpt.close()
    tensors = {{}}
    tree = {{"model": _state.flatten(model.state_dict(), "model", tensors),
            "optim": _state.flatten(opt.state_dict(), "optim", tensors),
            "sched": _state.flatten(sched.state_dict(), "sched", tensors), "train": train}}
    from safetensors.torch import save_file
    save_file({{k: v.contiguous() for k, v in tensors.items()}}, final + ".safetensors")
    with open(final + ".json", "w") as f:
        f.write(_state.dumps(tree))
    print(json.dumps({{"event": "done"}}), flush=True)
""")


def run_child(script, args, kill_after_steps=None, kill_delay=0.0):
    p = subprocess.Popen([sys.executable, script, *map(str, args)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + TIMEOUT
    events = []
    try:
        for line in p.stdout:
            events.append(json.loads(line))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args} ran past {TIMEOUT} s")
            done = sum(e["event"] == "step" for e in events)
            if kill_after_steps is not None and done == kill_after_steps:
                if kill_delay:
                    time.sleep(kill_delay)
                p.send_signal(signal.SIGKILL)
                break
        rc = p.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    if kill_after_steps is None:
        assert rc == 0, f"{args} exited with {rc}"
    else:
        assert rc == -signal.SIGKILL
    return events


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    path = tmp_path_factory.mktemp("child") / "layerwise_train.py"
    path.write_text(CHILD.format(here=HERE))
    return str(path)


@pytest.fixture(scope="module")
def reference(child, tmp_path_factory):
    """An uninterrupted run with a normal optimizer (no checkpointer)."""
    final = str(tmp_path_factory.mktemp("ref") / "final")
    run_child(child, ["-", KILL_STEPS, 1, final, "host"])
    return final


@needs_engine
@pytest.mark.parametrize("seed", range(3))
def test_layerwise_kill_at_random_step_then_resume_bit_identically(child, reference, tmp_path,
                                                                    seed):
    steps, ref = KILL_STEPS, reference
    rnd = random.Random(seed)
    every = rnd.choice([1, 3])
    copy = ["host", "direct", "device"][seed]
    kill_after = rnd.randrange(every + 1, steps - 2)
    d, final = str(tmp_path / "ck"), str(tmp_path / "final")
    run_child(child, [d, steps, every, final, copy], kill_after_steps=kill_after,
              kill_delay=rnd.choice([0.0, 0.003, 0.02]))
    events = run_child(child, [d, steps, every, final, copy])
    restored = events[0]["restored"]
    assert restored is not None and restored < kill_after
    ta, tb = load_file(ref + ".safetensors"), load_file(final + ".safetensors")
    assert set(ta) == set(tb)
    for k in ta:
        assert torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)), k
    # The rest equal as values: optimizer.state_dict()["state"] lists the
    # parameters in the order their state was created, which is backward
    # order under layerwise (load_state_dict does not depend on it).
    with open(ref + ".json") as f1, open(final + ".json") as f2:
        assert _unordered(_state.loads(f1.read())) == _unordered(_state.loads(f2.read()))


def _unordered(tree):
    """The tree with every {"__dict__": [[key, value], ...]} sorted by key."""
    if isinstance(tree, list):
        return [_unordered(v) for v in tree]
    if isinstance(tree, dict):
        if set(tree) == {"__dict__"} and isinstance(tree["__dict__"], list):
            return {"__dict__": sorted(([repr(k), _unordered(v)] for k, v in tree["__dict__"]),
                                       key=lambda kv: kv[0])}
        return {k: _unordered(v) for k, v in tree.items()}
    return tree
