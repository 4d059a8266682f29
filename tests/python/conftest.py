import os
import sys

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))


def real_engine_available() -> bool:
    """True when nonstop._core loads and its Engine can open a directory."""
    import tempfile

    import nonstop
    if nonstop._core is None or not hasattr(nonstop._core, "Engine"):
        return False
    try:
        with tempfile.TemporaryDirectory() as d:
            e = nonstop._core.Engine(os.path.join(d, "probe"))
            e.close()
        return True
    except Exception:  # an engine that is still a stub
        return False


@pytest.fixture
def fake_core(monkeypatch):
    import fake_core as fc
    import nonstop
    fc.DISK.clear()
    monkeypatch.setattr(nonstop, "_core", fc)
    yield fc
    fc.DISK.clear()


needs_engine = pytest.mark.skipif(
    not real_engine_available(),
    reason="the C++ Engine (include/nonstop/engine.h) has not landed in this build yet")


@pytest.fixture(params=["fake", "real"])
def core(request, monkeypatch):
    """Runs a test against fake_core (the laziest legal engine) and against
    the real C++ engine."""
    import nonstop
    if request.param == "fake":
        import fake_core as fc
        fc.DISK.clear()
        monkeypatch.setattr(nonstop, "_core", fc)
        yield fc
        fc.DISK.clear()
    else:
        if not real_engine_available():
            pytest.skip("the C++ Engine has not landed in this build yet")
        yield nonstop._core


def nonstop_cli():
    """The CLI to test: $NONSTOP_CLI, else `nonstop` on PATH, else the one
    next to this Python; None when there is none."""
    import shutil
    for c in (os.environ.get("NONSTOP_CLI", ""), shutil.which("nonstop") or "",
              os.path.join(os.path.dirname(sys.executable), "nonstop")):
        if c and os.access(c, os.X_OK):
            return c
    return None
