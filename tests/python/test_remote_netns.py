"""Node loss across hosts: a 2-node DDP job (gloo), each node a network
namespace made here (tests/python/netns_hosts.py: ip netns, veth pairs on a
bridge, a private /24), each with its own local and memory directories, and
one SeaweedFS on a third "storage host" namespace on the same bridge. Node
B is killed and its local and memory directories wiped; the job restarts and both ranks resume the same step from the remote tier, and
the final state is bitwise equal to an uninterrupted run. B is lost twice
in one job: during an upload (the step it was uploading is never chosen),
then after one.

Needs root (CI runs as root); otherwise skipped with a one-line reason. The
namespaces, veths and bridge are removed at the end, also on failure.

Why the store has a namespace of its own: in the clean-clone CI run of
session 4 the server was bound to the bridge address in the root namespace,
and the host's firewall dropped new connections arriving on the bridge
(INPUT), so both ranks failed to list the store after 20 s of retries, while
the ranks' own gloo traffic (namespace to namespace, bridged) flowed. Node to
node and node to store now both cross the bridge only; the root namespace
(this test) only opens connections outward, whose replies any stateful
firewall lets in. Reproduced here with an nftables rule that drops new
connections from the bridge on INPUT: the old layout failed exactly as in
CI, this one passes."""
import json
import os
import signal
import sys
import time

import pytest

import netns_hosts
from conftest import needs_engine
from nonstop import _ext, _remote
from s3_server import SeaweedS3

pytestmark = [needs_engine, pytest.mark.timeout(480)]

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "remote_ddp_train.py")


@pytest.fixture
def net(tmp_path):
    """Node A and node B (hosts 0 and 1) and the storage host."""
    with netns_hosts.hosts(2, tmp_path / "hosts", store=True) as hs:
        yield hs


@pytest.fixture
def s3_on_bridge(net, tmp_path):
    srv = SeaweedS3(tmp_path / "seaweedfs", host=net.store_addr, netns=net.store_ns)
    srv.start()
    try:
        net.reachable(net.store_addr, srv.ports["s3"])
        yield srv
    finally:
        srv.stop()


T0 = time.monotonic()


def _log(what: str) -> None:
    """A timestamped phase line (pytest shows it when a case fails: where it stood)."""
    print(f"[{time.monotonic() - T0:7.1f} s] {what}", flush=True)


def _launch(net, port, dirs, url, opts, steps, every, out, step_s, blob):
    return netns_hosts.start_ranks(
        net, [0, 1], lambda rank: [TRAIN, dirs[rank], url, json.dumps(opts), str(steps),
                                   str(every), out, "--step-s", str(step_s), "--blob", str(blob)],
        f"{out}.log", port=port)


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


def _wait(procs, out, timeout):
    netns_hosts.wait_ranks(procs, timeout, f"{out}.log")


def _progress(out, rank):
    try:
        with open(f"{out}.progress-{rank}.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _result(out, rank):
    with open(f"{out}.rank-{rank}.json") as f:
        return json.load(f)


STEPS, EVERY, BLOB = 60, 5, 1 << 21   # the blob: 8 MiB of state, 4 MiB per rank


_port = netns_hosts.free_port


def _reference(net, tmp_path, s3):
    out = str(tmp_path / "ref")
    dirs = [os.path.join(h.disk, "ref") for h in net]
    _log("reference: launch")
    procs = _launch(net, _port(), dirs, s3.url("ref"), s3.options, STEPS, EVERY, out, 0.0, BLOB)
    _wait(procs, out, 240)
    _log("reference: done")
    return [_result(out, r) for r in range(2)]


# close() uploads the newest checkpoint (4 MiB a rank here): seconds. Before
# the rank-R.skip signal it could wait commit_timeout_s (120 s) per step that
# rank 0 led after node B's slot ring had moved on (148 s for the reference
# run, once, with the old code).
CLOSE_S = 30


def _lose_node_b(net, procs, store, out, when, after_step):
    """Trains until the moment `when` ("during_upload": node B is uploading
    a step newer than every committed one; "after_upload": a step newer than
    `after_step` is committed and B has trained 3 steps past it), then loses
    node B (its process SIGKILLed, its disk and memory directories wiped: a
    replaced node starts empty); node A's process fails on its peer. Returns (the committed remote
    steps, the step B was uploading or None)."""
    busy = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), f"{when}: a rank died before the kill"
            steps = [s for s, _ in _ext.core().RemoteTier(store).committed_steps()]
            pb = _progress(out, 1)
            if steps and pb and steps[0] > after_step:
                if when == "after_upload" and pb["step"] >= steps[0] + 3:
                    break
                up = pb["remote"].get("uploading_step")
                if when == "during_upload" and up is not None and up > steps[0]:
                    busy = up
                    break
            time.sleep(0.05)
        else:
            raise AssertionError(f"{when}: never reached the point to kill node B")
        _log(f"{when}: kill node B (uploading {busy}, committed {steps})")
        net[1].lose()
        time.sleep(0.5)
    finally:
        _kill(procs)
    committed = [s for s, _ in _ext.core().RemoteTier(store).committed_steps()]
    assert committed and committed[0] > after_step
    assert busy not in committed  # B's part never arrived: that step is never chosen
    for r in range(2):
        if os.path.exists(f"{out}.progress-{r}.json"):
            os.unlink(f"{out}.progress-{r}.json")
    return committed, busy


def test_node_b_lost_during_then_after_upload_resumes_bitwise(net, s3_on_bridge, tmp_path):
    """One job loses node B twice: first while B uploads a step (its part
    never arrives: that step is not committed, not chosen), then after an
    upload. Each time both ranks resume the newest committed remote step, and
    the final state is bitwise equal to an uninterrupted run.

    The kill during an upload hung in the clean-clone CI run of session 3:
    the restarted job trained past the step rank 0 led before node B looked,
    so B's slot ring no longer held it, and rank 0 waited commit_timeout_s
    (120 s) for B's manifest at close(), then again for the next step. B now
    says so (rank-R.skip) and rank 0 leads a newer step at once."""
    s3 = s3_on_bridge
    ref = _reference(net, tmp_path, s3)
    assert ref[0]["params"] == ref[1]["params"]  # DDP: replicas agree
    assert max(r["close_s"] for r in ref) < CLOSE_S, ref
    url = s3.url("job")
    opts = dict(s3.options, retry_max_s=1.0, bandwidth_bps=2e6)  # 4 MiB part: ~2 s an upload
    store = _remote.open_store(url, s3.options)
    out = str(tmp_path / "run")
    dirs = [os.path.join(h.disk, "job") for h in net]

    _log("run 1: launch")
    procs = _launch(net, _port(), dirs, url, opts, STEPS, EVERY, out, 0.15, BLOB)
    committed, _ = _lose_node_b(net, procs, store, out, "during_upload", -1)

    _log("run 2 (node B replaced): launch")
    procs = _launch(net, _port(), dirs, url, opts, STEPS, EVERY, out, 0.15, BLOB)
    first = committed[0]
    deadline = time.monotonic() + 120
    while not all(_progress(out, r) for r in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            "run 2 never trained a step"
        time.sleep(0.05)
    assert [_progress(out, r)["restored"] for r in range(2)] == [first, first]
    committed, _ = _lose_node_b(net, procs, store, out, "after_upload", first)

    _log("run 3 (node B replaced again): launch")
    procs = _launch(net, _port(), dirs, url, opts, STEPS, EVERY, out, 0.0, BLOB)
    _wait(procs, out, 120)
    _log("run 3: done")
    got = [_result(out, r) for r in range(2)]
    assert got[0]["restored"] == got[1]["restored"] == committed[0]
    assert got[1]["restored_from"].endswith(_ext.core().remote_layout.step_dir(committed[0]))
    assert max(r["close_s"] for r in got) < CLOSE_S, got
    for r in range(2):
        assert got[r]["params"] == ref[r]["params"]
        assert got[r]["optim"] == ref[r]["optim"]
        assert got[r]["blob"] == ref[r]["blob"]
