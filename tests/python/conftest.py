import json
import os
import resource
import sys
import time

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


# The slowest cases of CI's rehearsals (seconds, `--durations`, session 16),
# by test function: they are handed out first, longest first, and the
# quick ones fill in at the end, so neither worker is left running a
# 20-40 s case alone while the other has nothing to do (xdist hands out
# tests in collection order, a group first, and keeps up to three queued
# per worker). Only the order changes; every case still runs. A case not
# listed counts as quick; a stale number costs balance, nothing else.
SLOW_FIRST = {
    "test_restart_with_another_world_size_reshards_from_peers_memory": 82,
    "test_doc_blocks_run_as_written": 34,
    "test_host_lost_restores_from_partner_memory_or_falls_back": 50,
    "test_ddp_two_ranks_kill_resume_slow_rank_corrupt_and_dcp": 43,
    "test_node_b_lost_during_then_after_upload_resumes_bitwise": 42,
    "test_zero1_four_ranks_kill_resume": 38,
    "test_cli_verify_inspect_export_a_remote_url": 31,
    "test_ddp_batchnorm_buffers_kill_resume": 29,
    "test_ddp_killed_in_epoch_3_resumes_bitwise_and_top_k_is_rank_0s": 28,
    "test_reshard_zero1_2_to_4_to_2_and_to_one_process": 27,
    "test_fsdp2_kill_resume_corrupt_dcp_and_reshard": 27,
    "test_reshard_ddp_2_to_4_to_2_and_to_one_process": 24,
    "test_lightning_killed_in_epoch_2_resumes_exactly": 23,
    "test_hf_kill_and_resume_is_exact": 22,
    "test_trainer_two_ranks_sigkill_resumes_bitwise": 20,
    "test_two_ranks_killed_restart_from_memory_or_all_from_disk": 20,
    "test_ranks_never_restore_an_abandoned_future_from_the_remote": 15,
    "test_ranks_agree_on_the_lineages_newest_not_the_highest_step": 15,
    "test_kill_mid_window_and_resume_is_bitwise": 15,
    "test_layerwise_ddp_sigkill_resumes_bit_identically": 15,
    "test_layerwise_ddp_with_clipping_is_bitwise_equal": 15,
    "test_multistep_killed_restarts_from_memory_bit_identically": 15,
    "test_agreement_keeps_up_with_a_checkpoint_every_step_on_out_of_phase_ranks": 15,
    "test_a_script_that_never_closes_exits_cleanly_with_checkpoints_in_flight": 14,
    "test_server_stopped_during_upload_then_restarted": 14,
    "test_ddp_refuses_a_sampler_lightning_wraps": 13,
    "test_kill_in_the_middle_of_a_checkpoint_many_times": 13,
    "test_trainer_two_ranks_retention_and_load_best_model_at_end": 13,
    "test_sigkill_during_deletion_leaves_whole_copies_or_none": 13,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = XDIST_GROUPS.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    # A stable sort: the rest keep their order (and a group its tests').
    items.sort(key=lambda item: -SLOW_FIRST.get(getattr(item, "originalname", item.name), 0))


def _cpu_s() -> float:
    """User + system CPU seconds of this process and of its children that
    have been waited for (their own waited-for children included)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With NONSTOP_TEST_CPU_LOG=FILE, appends one JSON line a test: its id,
    the xdist worker, start and end (epoch seconds) and the CPU seconds it
    and its children used (setup, call and teardown). On a loaded machine
    the CPU seconds, not the wall time, compare two versions of a test; the
    start and end give each worker's timeline (docs/TESTING.md)."""
    path = os.environ.get("NONSTOP_TEST_CPU_LOG")
    if not path:
        yield
        return
    t0, c0 = time.time(), _cpu_s()
    yield
    line = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"),
            "start": round(t0, 3), "end": round(time.time(), 3), "cpu_s": round(_cpu_s() - c0, 3)}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
