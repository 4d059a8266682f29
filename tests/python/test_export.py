"""One export API (#26): `include` is a glob (or list of globs) over the
stored names, names kept, in Python as on the command line, and a non-match
is an error in both; `strip` removes a prefix in both; a 2-rank directory is
exported consolidated (each tensor whole) in both, and loads with
load_state_dict(strict=True) into the unwrapped model."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import nonstop
from conftest import needs_engine, nonstop_cli

pytestmark = needs_engine
HERE = os.path.dirname(os.path.abspath(__file__))


def _one_rank(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).sum().backward()
    o.step()
    d = str(tmp_path / "ck")
    with nonstop.Checkpointer(d, {"model": m, "optim": o}, every=1) as ck:
        ck.save(0).wait()
    return d, m


def _cli(*args):
    cli = nonstop_cli()
    if cli is None:
        pytest.skip("the nonstop CLI is not built")
    return subprocess.run([cli, "export", *args], capture_output=True, text=True, timeout=120)


def test_include_is_the_same_glob_in_python_and_the_cli(tmp_path):
    d, m = _one_rank(tmp_path)
    py, cl = str(tmp_path / "py.safetensors"), str(tmp_path / "cli.safetensors")
    nonstop.export(d, py, include="model/*")
    r = _cli(d, "-o", cl, "--include", "model/*")
    assert r.returncode == 0, r.stderr
    a, b = load_file(py), load_file(cl)
    assert set(a) == set(b) == {f"model/{k}" for k in m.state_dict()}
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a list of globs, as --include repeated
    nonstop.export(d, py, include=["model/0.*", "optim/state/0/*"])
    r = _cli(d, "-o", cl, "--include", "model/0.*", "--include", "optim/state/0/*")
    assert r.returncode == 0, r.stderr
    a, b = load_file(py), load_file(cl)
    assert set(a) == set(b) and "model/0.weight" in a and "optim/state/0/exp_avg" in a
    assert not any(k.startswith("model/2.") for k in a)


def test_a_non_matching_include_is_an_error_in_both(tmp_path):
    d, _ = _one_rank(tmp_path)
    out = tmp_path / "x.safetensors"
    # the meaning e778719 gave include= in Python (a state key, prefix
    # stripped): an error naming the glob now, not an empty file
    with pytest.raises(nonstop.CheckpointMismatchError, match=r"no tensor .* matches "
                       r"include=\['model'\].*'model/\*'"):
        nonstop.export(d, str(out), include="model")
    assert not out.exists()
    r = _cli(d, "-o", str(out), "--include", "model")
    assert r.returncode == 2 and "matches --include" in r.stderr
    assert not out.exists()


def test_strip_gives_the_model_its_own_names_in_both(tmp_path):
    d, m = _one_rank(tmp_path)
    py, cl = str(tmp_path / "py.safetensors"), str(tmp_path / "cli.safetensors")
    nonstop.export(d, py, include="model/*", strip="model/")
    r = _cli(d, "-o", cl, "--include", "model/*", "--strip", "model/")
    assert r.returncode == 0, r.stderr
    for f in (py, cl):
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        fresh.load_state_dict(load_file(f), strict=True)
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                     m.state_dict().values()))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    sys.path.insert(0, HERE)
    from dist_launch import run_ranks
    tmp = tmp_path_factory.mktemp("ranks")
    d, ref = str(tmp / "ck"), str(tmp / "ref.safetensors")
    for rc, _, err in run_ranks(2, [os.path.join(HERE, "export_ranks_train.py"), d, ref],
                                timeout=120):
        assert rc == 0, err[-3000:]
    return d, ref


def test_a_two_rank_export_is_consolidated_and_loads_strictly(tmp_path, two_ranks):
    from export_ranks_train import model
    d, ref = two_ranks
    want = load_file(ref)
    # the big weight is cut into shares: one rank alone holds half of it
    shares = [s for s in nonstop.load(d, rank=0).tensors if s == "model/module.0.weight"]
    assert shares and nonstop.load(d, rank=0).tensors[shares[0]].numel() < 64 * 48
    py, cl = str(tmp_path / "py.safetensors"), str(tmp_path / "cli.safetensors")
    r = nonstop.export(d, py, include="model/*", strip="model/")
    assert r["step"] == 2
    c = _cli(d, "-o", cl, "--include", "model/*", "--strip", "model/")
    assert c.returncode == 0, c.stderr
    for f in (py, cl):
        got = load_file(f)
        fresh = model()
        fresh.load_state_dict(got, strict=True)  # DDP's module. prefix gone, every tensor whole
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, want[k]), (f, k)
    # everything, optimizer state by parameter name
    every = str(tmp_path / "all.safetensors")
    nonstop.export(d, every)
    got = load_file(every)
    assert got["optim/state/0.weight/exp_avg"].shape == (48, 64)
    with pytest.raises(nonstop.CheckpointMismatchError, match="drop rank="):
        nonstop.export(d, every, rank=1)
