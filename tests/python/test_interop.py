"""Interop (#16): the DCP export in get_state_dict's layout, loaded by DCP's
own loader into a fresh model and optimizer with a strict set_state_dict;
tied weights exported under every name (DCP and safetensors, Python and
CLI); `nonstop export --include`."""
import json
import os
import subprocess
import warnings

import pytest
import torch
from torch import nn

import nonstop
from conftest import nonstop_cli


class TinyGPT(nn.Module):
    """A small GPT: token and position embeddings, two pre-norm blocks,
    lm_head tied to the token embedding."""

    def __init__(self, vocab=48, dim=16, ctx=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(2))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.lm_head(self.ln_f(h))


def _make(seed):
    torch.manual_seed(seed)
    m = TinyGPT()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    s = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
    return m, o, s


def _step(m, o, s, i):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randint(0, 48, (4, 8), generator=g)
    loss = nn.functional.cross_entropy(m(x).flatten(0, 1), x.roll(-1, 1).flatten())
    o.zero_grad()
    loss.backward()
    o.step()
    s.step()


def _trained(tmp_path, wrap=None):
    m, o, s = _make(0)
    d = str(tmp_path / "ckpt")
    ck = nonstop.Checkpointer(d, state={"model": wrap(m) if wrap else m, "optim": o,
                                        "sched": s}, every=1000)
    for i in range(3):
        _step(m, o, s, i)
    ck.save(3).wait()
    ck.close()
    return d, m, o, s


def _flat(sd, prefix=""):
    """DCP's key for each leaf tensor of a nested state dict."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def _assert_dcp_loads(exp, m, o, s):
    """The DCP export `exp` of the state (m, o, s): its tensor keys are
    exactly get_state_dict's (tied weights included), and a fresh model and
    optimizer loaded by dcp.load plus a strict set_state_dict equal it and
    train on bit-identically."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    # The export's tensor keys are exactly get_state_dict's, tied weights included.
    msd, osd = get_state_dict(m, o)
    assert "lm_head.weight" in msd and "tok.weight" in msd
    want = set(_flat({"model": msd, "optim": osd["state"]}, ""))
    got = set(dcp.FileSystemReader(exp).read_metadata().state_dict_metadata)
    got_tensors = {k for k in got if k.startswith(("model.", "optim.state."))}
    assert got_tensors == {k.replace("optim.", "optim.state.", 1) if k.startswith("optim.")
                           else k for k in want}, got_tensors ^ want

    # A fresh model and optimizer (other weights, no optimizer state yet),
    # loaded by DCP's own loader and a strict set_state_dict.
    m2, o2, s2 = _make(1)
    assert not torch.equal(m2.tok.weight, m.tok.weight)
    msd2, osd2 = get_state_dict(m2, o2)
    sd = {"model": msd2, "optim": osd2, "sched": s2.state_dict(),
          "nonstop.step": torch.tensor(-1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=exp)
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    s2.load_state_dict(sd["sched"])
    m2.load_state_dict(sd["model"], strict=True)  # every name, lm_head.weight too
    assert m2.lm_head.weight is m2.tok.weight  # still tied
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert o2.state_dict()["param_groups"] == o.state_dict()["param_groups"]
    for i, st in o.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, o2.state_dict()["state"][i][k]), (i, k)
    assert s2.state_dict() == s.state_dict()
    # and training goes on bit-identically
    for i in range(3, 5):
        _step(m, o, s, i)
        _step(m2, o2, s2, i)
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("wrap", [None, torch.compile], ids=["plain", "compiled"])
def test_dcp_export_is_get_state_dict_layout_and_loads_strictly(tmp_path, wrap):
    d, m, o, s = _trained(tmp_path, wrap)
    exp = str(tmp_path / "dcp")
    r = nonstop.export(d, exp, format="dcp")
    assert r["step"] == 3
    _assert_dcp_loads(exp, m, o, s)


@pytest.mark.parametrize("mode", ["multistep", "layerwise"])
def test_dcp_export_of_multistep_and_layerwise_is_get_state_dict_layout(tmp_path, mode):
    """The checkpoints of mode="multistep" (a window's reconstructed state)
    and mode="layerwise" (sealed by step()) record the parameter names too:
    the optimizer is exported by FQN, not by index."""
    if mode == "multistep" and not hasattr(nonstop._core, "Multistep"):
        pytest.skip("this build of nonstop._core has no Multistep")
    m, o, s = _make(0)
    d = str(tmp_path / "ckpt")
    # every=2, 4 steps: layerwise checkpoints steps 1 and 3; multistep's window
    # begun after step 1 is the checkpoint of step 2, persisted during step 3
    # (the window begun after step 3 is still open at the end: dropped).
    with nonstop.Checkpointer(d, state={"model": m, "optim": o, "sched": s}, every=2,
                              mode=mode, **({"parts": 2} if mode == "multistep" else {})) as ck:
        for i in range(4):
            _step(m, o, s, i)
            ck.step(i)
        ck.wait()
    exp = str(tmp_path / "dcp")
    r = nonstop.export(d, exp, format="dcp")
    assert r["step"] == (3 if mode == "layerwise" else 2), r
    # The state of that step, by plain training (both modes are bitwise equal to it).
    m_ref, o_ref, s_ref = _make(0)
    for i in range(r["step"] + 1):
        _step(m_ref, o_ref, s_ref, i)
    _assert_dcp_loads(exp, m_ref, o_ref, s_ref)


def test_safetensors_export_has_tied_weights_under_every_name(tmp_path):
    from safetensors.torch import load_file
    d, m, o, s = _trained(tmp_path)
    out = str(tmp_path / "model.safetensors")
    nonstop.export(d, out, include="model/*", strip="model/")
    sd = load_file(out)
    assert set(sd) == set(m.state_dict())
    fresh, _, _ = _make(1)
    fresh.load_state_dict(sd, strict=True)
    assert torch.equal(fresh.lm_head.weight, m.lm_head.weight)


_cli = nonstop_cli


@pytest.mark.skipif(_cli() is None, reason="the nonstop CLI is not built")
def test_cli_export_include_globs_and_tied_weights(tmp_path):
    from safetensors.torch import load_file
    d, m, o, s = _trained(tmp_path)

    def run(*args):
        return subprocess.run([_cli(), "export", d, *args], capture_output=True, text=True,
                              timeout=120)

    whole = str(tmp_path / "all.safetensors")
    r = run("-o", whole)
    assert r.returncode == 0, r.stderr
    sd = load_file(whole)
    # every tensor, the tied lm_head.weight under its own name too
    assert {f"model/{k}" for k in m.state_dict()} <= set(sd)
    assert torch.equal(sd["model/lm_head.weight"], m.lm_head.weight.detach())
    assert any(k.startswith("optim/state/") for k in sd)

    part = str(tmp_path / "part.safetensors")
    r = run("-o", part, "--include", "model/blocks.0.*", "--include", "*lm_head*")
    assert r.returncode == 0, r.stderr
    got = load_file(part)
    want = {f"model/{k}" for k in m.state_dict() if k.startswith("blocks.0.")}
    assert set(got) == want | {"model/lm_head.weight"}
    for k in got:
        assert torch.equal(got[k], sd[k]), k
    assert f": {len(got)} tensors," in r.stdout, r.stdout

    r = run("-o", part, "--include", "nothing/*")
    assert r.returncode == 2 and "matches --include" in r.stderr and r.stderr.count("\n") == 1
    r = run("-o", str(tmp_path / "x"), "--format", "dcp", "--include", "model/*")
    assert r.returncode == 2 and "--include" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.skipif(_cli() is None, reason="the nonstop CLI is not built")
def test_cli_inspect_is_a_summary(tmp_path):
    """A 0.66M-parameter model with RNG state: `inspect` prints a few KB
    (it printed 127 KB: every tensor table, the RNG records in hex);
    --full adds the tensor tables; --json keeps every detail."""
    import json
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(800, 800), nn.Linear(800, 25))
    assert sum(p.numel() for p in m.parameters()) == 660825
    o = torch.optim.AdamW(m.parameters())
    d = str(tmp_path / "ck")
    ck = nonstop.Checkpointer(d, state={"model": m, "optim": o}, every=1)
    for s in range(3):
        m(torch.randn(2, 800)).sum().backward()
        o.step()
        ck.step(s, metrics={"loss": 0.5})
    ck.close()

    def run(*args):
        r = subprocess.run([_cli(), "inspect", d, *args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = run()
    assert len(out) < 4096, len(out)
    assert "tensors by state: model 4 (2.5 MiB), optim 12 (5.0 MiB)" in out, out
    assert "dtypes: float32 16" in out
    assert "rng " in out and "torch " in out and '"loss":0.5' in out
    assert "committed (newest)" in out
    # no RNG bytes, no tensor table
    assert max(len(ln) for ln in out.splitlines()) < 200
    assert "optim/state/0/exp_avg" not in out
    full = run("--full")
    assert "optim/state/0/exp_avg" in full and len(full) < 16384
    assert max(len(ln) for ln in full.splitlines()) < 200
    j = json.loads(run("--json"))
    meta = j["files"][0]["checkpoints"][0]["meta"]
    assert isinstance(meta["rng"]["torch"], str) and len(meta["rng"]["torch"]) > 1000
    assert len(j["files"][0]["checkpoints"][0]["tensors"]) == 16


@pytest.mark.parametrize("names", [
    [1, 2], {"modules": ["model"]}, {"modules": {"model": 3}}, {"optimizers": []},
    {"optimizers": {"optim": {"module": "model"}}},
    {"optimizers": {"optim": {"module": "model", "params": [0, 1]}}}])
def test_malformed_names_in_the_metadata_are_one_line_errors(names):
    """The metadata's "names" comes from the file: a crafted one gives a
    one-line CorruptCheckpointError, not a raw AttributeError/IndexError
    (before the check, [1, 2] raised AttributeError: 'list' ... 'get')."""
    from nonstop import _dcp
    from nonstop.errors import CorruptCheckpointError
    meta = {"names": names, "state": {"x": 1}}
    with pytest.raises(CorruptCheckpointError) as e:
        _dcp.layout([{}], [meta], set())
    assert "\n" not in str(e.value) and "'names' is malformed" in str(e.value)


def test_optimizer_names_that_do_not_fit_the_state_leave_it_by_index():
    """The DCP export renames by C++ DcpRename (_dcp.layout); a value it does
    not fit comes back as it is."""
    from nonstop import _ext, _state
    names = _state.dumps({"optimizers": {"o": {"module": "m", "params": ["a.weight"]}}})
    value = {"state": {5: {"step": 1}}, "param_groups": [{"params": [0]}]}
    tree = _state.dumps(_state.flatten(value, "o", {}))
    assert _ext.core().dcp_rename("o", tree, names) == tree  # state index 5 has no name
    value["state"] = {0: {"step": 1}}
    renamed = _state.unflatten(json.loads(_ext.core().dcp_rename(
        "o", _state.dumps(_state.flatten(value, "o", {})), names)), {})
    assert renamed == {"state": {"a.weight": {"step": 1}}, "param_groups": [{"params": ["a.weight"]}]}


def test_dcp_export_of_a_zero_optimizer_is_consolidated_by_fqn(tmp_path):
    """DDP + ZeroRedundancyOptimizer on 2 gloo ranks (each saves its own
    shard): the DCP export consolidates the shards and names the state by
    parameter FQN, so a fresh plain model and AdamW load it with dcp.load
    and set_state_dict and equal ZeRO's own consolidated state_dict."""
    import json
    import sys
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from dist_launch import run_ranks
    d, ref = str(tmp_path / "ck"), str(tmp_path / "ref.safetensors")
    for rc, _, err in run_ranks(2, [os.path.join(here, "zero_export_train.py"), d, ref],
                                timeout=240):
        assert rc == 0, err[-3000:]
    exp = str(tmp_path / "dcp")
    assert nonstop.export(d, exp, format="dcp")["step"] == 2
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    o2 = torch.optim.AdamW(m2.parameters(), lr=1.0)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=2, gamma=0.5)
    msd, osd = get_state_dict(m2, o2)
    sd = {"model": msd, "optim": osd, "sched": s2.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=exp)
    assert set(sd["optim"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    s2.load_state_dict(sd["sched"])
    want = load_file(ref)
    with open(ref + ".json") as f:
        extra = json.load(f)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, want[f"model/{k}"]), k
    got = o2.state_dict()
    assert len(got["state"]) == 4
    for i, st in got["state"].items():
        for k, v in st.items():
            assert torch.equal(v, want[f"optim/{i}/{k}"]), (i, k)
    assert [{k: v for k, v in g.items() if k != "params"} for g in got["param_groups"]] == [
        {k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items()}
        for g in extra["groups"]]
    assert s2.state_dict() == extra["sched"]
