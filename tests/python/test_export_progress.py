"""Long exports (#16): a tqdm progress bar like restore's (one helper,
_progress.py) for nonstop.export and `nonstop export`: off when stderr is not
a terminal, forced or disabled by an option (progress=, --progress,
--no-progress) or NONSTOP_PROGRESS. The Python safetensors export reads
through the one verified read path a window at a time (bounded memory),
and a damaged checkpoint still fails it in one line."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import nonstop  # noqa: E402
from nonstop import _export, _progress  # noqa: E402
from conftest import nonstop_cli  # noqa: E402


def _job(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    d = str(tmp_path / "ck")
    with nonstop.Checkpointer(d, state={"model": model, "optim": opt}, every=1000) as ck:
        ck.save(5).wait()
    return d, model, opt


def test_python_export_bar_forced_disabled_and_off_without_a_terminal(tmp_path, capsys,
                                                                      monkeypatch):
    from safetensors.torch import load_file
    d, model, opt = _job(tmp_path)
    monkeypatch.delenv("NONSTOP_PROGRESS", raising=False)
    # Several windows of the verified read path: the file is the same.
    monkeypatch.setattr(_export, "WINDOW_BYTES", 20_000)
    out = str(tmp_path / "a.safetensors")
    r = nonstop.export(d, out, progress=True)
    err = capsys.readouterr().err
    assert "nonstop export" in err and "100%" in err, err
    sd = load_file(out)
    assert r["tensors"] == len(sd) and r["step"] == 5
    for k, v in model.state_dict().items():
        assert torch.equal(sd[f"model/{k}"], v), k
    for pid, st in opt.state_dict()["state"].items():
        assert torch.equal(sd[f"optim/state/{pid}/exp_avg_sq"], st["exp_avg_sq"])
    # stderr is not a terminal here: no bar by default, none when disabled.
    for kwargs in ({}, {"progress": False}):
        nonstop.export(d, str(tmp_path / "b.safetensors"), **kwargs)
        assert "nonstop export" not in capsys.readouterr().err
    monkeypatch.setenv("NONSTOP_PROGRESS", "1")
    nonstop.export(d, str(tmp_path / "c.safetensors"))
    assert "nonstop export" in capsys.readouterr().err
    nonstop.export(d, str(tmp_path / "c.safetensors"), progress=False)  # the option wins
    assert "nonstop export" not in capsys.readouterr().err
    with pytest.raises(nonstop.CheckpointMismatchError, match="progress must be"):
        nonstop.export(d, str(tmp_path / "d.safetensors"), progress="yes")
    # DCP export: the same bar over its read.
    monkeypatch.delenv("NONSTOP_PROGRESS")
    nonstop.export(d, str(tmp_path / "dcp"), format="dcp", progress=True)
    assert "nonstop export" in capsys.readouterr().err


def test_the_bar_follows_the_terminal_and_the_size(monkeypatch):
    class Tty:
        def __init__(self, tty):
            self.tty, self.text = tty, []

        def isatty(self):
            return self.tty

        def write(self, s):
            self.text.append(s)

        def flush(self):
            pass
    monkeypatch.delenv("NONSTOP_PROGRESS", raising=False)
    for tty, total, shown in [(True, 1 << 30, True), (True, 1 << 20, False),
                              (False, 1 << 30, False)]:
        err = Tty(tty)
        monkeypatch.setattr(sys, "stderr", err)
        bar = _progress.Progress("nonstop export")
        bar(total // 2, total)
        bar(total, total)
        bar.close()
        assert ("nonstop export" in "".join(err.text)) == shown, (tty, total)


def test_a_damaged_checkpoint_is_not_exported_and_leaves_no_file(tmp_path, monkeypatch):
    d, _, _ = _job(tmp_path)
    monkeypatch.setattr(_export, "WINDOW_BYTES", 20_000)
    reader = nonstop._core.Reader(d, rank=0, verify_data=True)
    info = reader.checkpoints[reader.newest_valid]
    spec = max(info["tensors"], key=lambda t: t["nbytes"])
    path = os.path.join(d, nonstop._core.JobDir.slot_name(0))
    with open(path, "r+b") as f:  # one byte inside the biggest tensor's data
        f.seek(info["data_offset"] + spec["data_offset"] + spec["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    out = str(tmp_path / "x.safetensors")
    with pytest.raises(nonstop.CheckpointError) as e:
        nonstop.export(d, out, progress=False)
    assert "\n" not in str(e.value)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


_cli = nonstop_cli


@pytest.mark.skipif(_cli() is None, reason="the nonstop CLI is not built")
def test_cli_export_progress_flags(tmp_path):
    d, _, _ = _job(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "NONSTOP_PROGRESS"}
    env.setdefault("NONSTOP_PYTHON", sys.executable)

    def run(*args):
        p = subprocess.run([_cli(), "export", d, *args], capture_output=True, text=True,
                           timeout=300, env=env)
        assert p.returncode == 0, p.stderr
        return p.stderr
    assert "nonstop export: 100%" in run("-o", str(tmp_path / "a.safetensors"), "--progress")
    assert "nonstop export" not in run("-o", str(tmp_path / "b.safetensors"))
    assert "nonstop export" not in run("-o", str(tmp_path / "c.safetensors"), "--no-progress")
    assert "nonstop export" in run("-o", str(tmp_path / "dcp"), "--format", "dcp", "--progress")
    assert "nonstop export" not in run("-o", str(tmp_path / "dcp2"), "--format", "dcp")
