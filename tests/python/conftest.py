import os
import sys

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))


# What torch.distributed and the launchers read from the environment.
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "GROUP_RANK", "NODE_RANK", "OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def no_distributed_state_left_behind():
    """Each test ends with no process group and the distributed environment
    it started with. A framework run in this process can leave both behind:
    Lightning's Trainer with a distributed strategy (test_lightning's
    FSDPOnCPU, refused in setup) makes a one-rank gloo group whose TCPStore
    stays listening on MASTER_PORT, and sets MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK and NODE_RANK in os.environ. Every child a later test of the
    same pytest worker started inherited them: a single-process
    Accelerator(cpu=True) or transformers' TrainingArguments saw LOCAL_RANK,
    made a one-rank group on that MASTER_PORT and died with EADDRINUSE
    (session 15: test_accelerate's kill/resume job, the HF and ACCELERATE
    doc blocks; which tests shared a worker decided it)."""
    before = {k: os.environ.get(k) for k in DIST_ENV}
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
def spy_engine(monkeypatch):
    """The real engine, subclassed: each instance records its keyword
    arguments (`kwargs`) and its calls (`calls`); a test may wrap a method
    (`before_wait_copied`). Yields the subclass."""
    import nonstop
    if not real_engine_available():
        pytest.skip("the C++ Engine has not landed in this build yet")
    real = nonstop._core.Engine

    class Spy(real):
        instances: list = []
        before_wait_copied = None

        def __init__(self, dir, **kw):
            super().__init__(dir, **kw)
            self.kwargs = dict(kw)
            self.calls = []
            Spy.instances.append(self)

        def wait_copied(self):
            self.calls.append("wait_copied")
            if Spy.before_wait_copied is not None:
                Spy.before_wait_copied()
            return super().wait_copied()

    monkeypatch.setattr(nonstop._core, "Engine", Spy)
    yield Spy


@pytest.fixture
def load_state_dict_calls(monkeypatch):
    """A list that records the class name of every module whose
    load_state_dict is called from now on (the real method still runs)."""
    import torch
    calls = []
    plain = torch.nn.Module.load_state_dict

    def counted(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return plain(self, *args, **kwargs)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", counted)
    return calls


needs_engine = pytest.mark.skipif(
    not real_engine_available(),
    reason="the C++ Engine (include/nonstop/engine.h) has not landed in this build yet")


@pytest.fixture
def core():
    """The real C++ engine (nonstop._core)."""
    import nonstop
    if not real_engine_available():
        pytest.skip("the C++ Engine has not landed in this build yet")
    yield nonstop._core


def warned(rec) -> str:
    """The messages of the warnings a pytest.warns(...) block recorded, one a
    line: the message of an assertion about which step a fallback chose, so
    that a failure says why each newer checkpoint was passed over."""
    return "warnings: " + ("".join(f"\n  {w.category.__name__}: {w.message}" for w in rec)
                           or "none")


def nonstop_cli():
    """The CLI to test: $NONSTOP_CLI, else `nonstop` on PATH, else the one
    next to this Python; None when there is none."""
    import shutil
    for c in (os.environ.get("NONSTOP_CLI", ""), shutil.which("nonstop") or "",
              os.path.join(os.path.dirname(sys.executable), "nonstop")):
        if c and os.access(c, os.X_OK):
            return c
    return None


# pytest-xdist (`-n 2 --dist loadgroup`): tests that share a machine-wide
# resource run on one worker, one after the other. Network namespaces: the
# hosts' subnets and bridge names come from the pid (netns_hosts.Hosts), and
# two bridges on one /24 would break both tests. Loop devices and mounts: the
# writeback test takes a loop device and mounts file systems.
XDIST_GROUPS = {"test_peer_tier.py": "netns", "test_peer_reshard.py": "netns",
                "test_remote_netns.py": "netns", "test_writeback_kernel.py": "mounts"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = XDIST_GROUPS.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
