"""Friction (#26): stats() after close(), integration options checked when
the integration is made, `verify --step N` of an overwritten step, the
package's own interpreter for the commands that run Python, no stray public
names, no torch.distributed.optim import in one process."""
import os
import subprocess
import sys

import pytest
import torch

import nonstop
from conftest import needs_engine, nonstop_cli

pytestmark = needs_engine


def test_stats_after_close_are_the_last_stats(tmp_path):
    w = torch.ones(1000)
    ck = nonstop.Checkpointer(str(tmp_path / "ck"), {"w": w}, every=1)
    for s in range(3):
        ck.step(s)
    ck.close()
    st = ck.stats()
    # every checkpoint finished: committed, or superseded by a newer one
    assert st["started"] == 3 and st["saves"] == 3, st
    assert st["committed"] + st["superseded"] == 3 and st["committed"] >= 1, st
    st["started"] = -1  # a copy: the next call is not changed
    assert ck.stats()["started"] == 3
    with pytest.raises(nonstop.CheckpointError, match="closed"):
        ck.save(9)


def test_no_torch_distributed_optim_import_in_one_process(tmp_path):
    code = ("import sys, torch, nonstop\n"
            f"c = nonstop.Checkpointer({str(tmp_path / 'ck')!r}, "
            "{'m': torch.nn.Linear(2, 2)}, every=1)\n"
            "c.close()\n"
            "print('torch.distributed.optim' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_package_exports_no_typing_names():
    assert not hasattr(nonstop, "Optional")
    assert all(hasattr(nonstop, n) for n in nonstop.__all__)


def test_lightning_options_are_checked_when_the_callback_is_made(tmp_path):
    pytest.importorskip("lightning")
    from nonstop.lightning import NonstopCheckpoint
    with pytest.raises(nonstop.CheckpointMismatchError, match=r"unknown option max_in_fligth= "
                       r"\(did you mean max_in_flight=\?\)"):
        NonstopCheckpoint(str(tmp_path), every=2, max_in_fligth=2)
    with pytest.raises(nonstop.CheckpointMismatchError, match="best must be"):
        NonstopCheckpoint(str(tmp_path), every=2, best=("loss", "lowest", 1))
    with pytest.raises(nonstop.CheckpointMismatchError, match="mode must be 'min' or 'max'"):
        NonstopCheckpoint(str(tmp_path), every=2, mode="layerwise")
    with pytest.raises(nonstop.CheckpointMismatchError, match="sets state= itself"):
        NonstopCheckpoint(str(tmp_path), every=2, state={})
    NonstopCheckpoint(str(tmp_path), every=2, keep=3, max_in_flight=1)


def test_hf_options_are_checked_when_the_callback_is_made(tmp_path):
    pytest.importorskip("transformers")
    from nonstop.hf import NonstopCallback
    with pytest.raises(nonstop.CheckpointMismatchError, match=r"unknown option kep= "
                       r"\(did you mean keep=\?\)"):
        NonstopCallback(str(tmp_path), every=2, kep=3)
    with pytest.raises(nonstop.CheckpointMismatchError, match="tier must be"):
        NonstopCallback(str(tmp_path), every=2, tier="ram")
    NonstopCallback(str(tmp_path), every=2, keep=3)


def _cli():
    cli = nonstop_cli()
    if cli is None:
        pytest.skip("the nonstop CLI is not built")
    return cli


def test_verify_of_an_overwritten_step_says_so_with_its_own_exit_code(tmp_path):
    d = str(tmp_path / "ck")
    w = torch.zeros(1000)
    with nonstop.Checkpointer(d, {"w": w}, every=1, max_in_flight=1) as ck:
        for s in range(6):
            w.add_(1)
            ck.save(s).wait()
    steps = {c["step"] for c in nonstop.list(d)}
    r = subprocess.run([_cli(), "verify", d, "--step", "5"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and 5 in steps, r.stderr
    gone = [s for s in range(5) if s not in steps]
    outcomes = {}
    for s in gone:
        r = subprocess.run([_cli(), "verify", d, "--step", str(s)], capture_output=True,
                           text=True, timeout=60)
        outcomes[s] = (r.returncode, r.stderr.strip())
    # a step whose commit record is still in the ring, its slot reused
    over = {s: o for s, o in outcomes.items() if "overwritten" in o[1]}
    assert over, outcomes
    for code, err in over.values():
        assert code == 4 and "damaged" not in err and err.count("\n") == 0, err


def _no_python3_on_path(tmp_path):
    """PATH with a python3 that fails loudly, and no NONSTOP_PYTHON."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\necho 'the python3 on PATH ran' >&2\nexit 97\n")
    (fake / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "NONSTOP_PYTHON"}
    env["PATH"] = f"{fake}:{env.get('PATH', '')}"
    return env


def test_export_dcp_runs_the_package_interpreter_not_python3_from_path(tmp_path):
    cli = _cli()
    if not os.access(os.path.join(os.path.dirname(cli), "python"), os.X_OK):
        pytest.skip("the CLI has no python beside it (not a virtual environment's)")
    d = str(tmp_path / "ck")
    with nonstop.Checkpointer(d, {"m": torch.nn.Linear(2, 2)}, every=1) as ck:
        ck.save(0).wait()
    r = subprocess.run([cli, "export", d, "-o", str(tmp_path / "dcp"), "--format", "dcp"],
                       capture_output=True, text=True, timeout=120, env=_no_python3_on_path(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "python3 on PATH" not in r.stderr
    assert os.path.exists(tmp_path / "dcp" / ".metadata")


def test_simulate_plot_runs_the_package_interpreter_not_python3_from_path(tmp_path):
    pytest.importorskip("matplotlib")
    cli = _cli()
    if not os.access(os.path.join(os.path.dirname(cli), "python"), os.X_OK):
        pytest.skip("the CLI has no python beside it (not a virtual environment's)")
    trace = os.path.join(os.path.dirname(__file__), "..", "data", "gcp_a100_spot_trace.csv")
    out = str(tmp_path / "goodput.png")
    r = subprocess.run([cli, "simulate", "--trace", trace, "--plot", out], capture_output=True,
                       text=True, timeout=120, env=_no_python3_on_path(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "python3 on PATH" not in r.stderr
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
