"""A job's memory tier and a peer server over loopback TCP, in one process:
what test_peer_core.py and test_job_view.py both set up (the multi-host
wiring, with namespaces, is netns_hosts.py's).

    ck = memory_checkpointer(tmp_path, {"model": model}, monkeypatch)
    srv, ep = loopback_server(tmp_path, JOB, SECRET)   # ep: "127.0.0.1:PORT"
"""
import os

import nonstop
from nonstop import _core


def memory_checkpointer(tmp_path, state, monkeypatch, **kw):
    """A Checkpointer at tmp_path/job, every step, on the memory tier whose
    segment lives in tmp_path/shm-own (NONSTOP_SHM_DIR, for this test)."""
    monkeypatch.setenv("NONSTOP_SHM_DIR", str(tmp_path / "shm-own"))
    return nonstop.Checkpointer(str(tmp_path / "job"), state, every=1, tier="memory", **kw)


def loopback_server(tmp_path, job, secret):
    """A peer server for `job` on 127.0.0.1 (a free port) holding its
    replicas in tmp_path/shm-peer; returns it and its endpoint."""
    srv = _core.PeerServer(job, secret, bind_host="127.0.0.1",
                           dir=os.path.join(str(tmp_path), "shm-peer"), io_timeout_s=10.0)
    return srv, f"127.0.0.1:{srv.port}"
