"""A distributed rank whose training loop ends in an engine error that
nobody catches (no close()) exits cleanly: the error's traceback ending in
its one line, exit status 1, never "terminate called without an active
exception" (SIGABRT, -6).

The crash it guards against: the agreement thread (a daemon thread,
_distributed.py) was ended by the finalizing interpreter when it returned
from a call that had released the GIL (torch's Work.wait in all_gather, the
engine's write_agreed), from inside pybind11's gil_scoped_release
destructor: std::terminate. Rank 1 lingers at exit (exit_error_train.py
--linger-s) so that rank 0 finalizes while rank 1's thread still gathers,
and rank 1 finalizes after its partner is gone: before the fix one of the
two aborted in every run here. Every run is under a hard timeout
(dist_launch.run_ranks)."""
import os
import sys

import pytest
import torch

from conftest import needs_engine

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from dist_launch import run_ranks  # noqa: E402

pytestmark = [needs_engine,
              pytest.mark.skipif(not torch.distributed.is_available(),
                                 reason="torch built without torch.distributed")]


@pytest.mark.parametrize("tiers", [
    ["--tier", "disk"],
    # the memory tier, a peer replica on the other rank, a file:// remote store
    ["--tier", "memory", "--replicas", "1", "--remote", "file"],
], ids=["disk", "memory-peer-remote"])
def test_uncaught_engine_error_exits_with_its_line_and_status_1(tmp_path, tiers):
    res = run_ranks(2, [os.path.join(HERE, "exit_error_train.py"), str(tmp_path), *tiers,
                        "--linger-s", "1.5"], timeout=120)
    for rank, (rc, lines, err) in enumerate(res):
        assert "terminate called" not in err, (rank, err[-3000:])
        assert rc == 1, (rank, rc, err[-3000:])
        started = [line for line in lines if line["event"] == "training"]
        assert started and not any(line["event"] == "no error" for line in lines), lines
        if "--replicas" in tiers:  # the peer and remote tiers were running
            assert started[0]["peer_replicas"] == 1 and started[0]["remote"], started
        last = err.strip().splitlines()[-1]
        assert "CheckpointIOError: keeping step 3 in " in last and "Not a directory" in last, \
            (rank, err[-3000:])
