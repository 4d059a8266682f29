"""The remote tier's Python side: the transports and torch adaptation only.
Committed checkpoints are copied to an object store (S3 and what obstore
speaks) or a plain path (a shared file system), and fetched back by a node
that lost its local directory. See docs/TIERS.md.

Everything that names, decides, orders, filters or verifies is C++'s:
src/jobdir/remote_layout.h (every object's name and document, the commit
rule, retention; nonstop._core.remote_layout), src/tier/remote_tier.h
(nonstop._core.RemoteTier: listing, fetch and its checks, an upload and
its commit, a follower's pick, retention, the JOB claim), src/tier/
uploader.h (the upload thread), src/tier/remote_restore.h (a restore's
plan across the local and the remote tier, verified, and the ranks'
agreement on a step), each with the GIL released. This module hands C++ a
transport (ObjectStore over obstore, PathStore over the Env seam: put,
get, list, delete, throttling), as the distributed code hands it a Comm,
and reads into torch what the plan names. Nothing here speaks S3 but the
CreateBucket request obstore has no call for.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import tempfile
import threading
import time
import warnings
import weakref
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timedelta, timezone
from typing import Optional

from . import _ext
from .errors import (CheckpointError, CheckpointIOError, CheckpointMismatchError,
                     CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError)

PART_BYTES = 8 << 20              # the transports' preferred crc unit and multipart chunk


def _rl():
    """nonstop._core.remote_layout (src/jobdir/remote_layout.h)."""
    return _ext.core().remote_layout


# ------------------------------------------------------------------ stores

def _first_line(e: BaseException) -> str:
    """obstore's messages run to many lines (a debug dump): the first says it."""
    text = str(e).strip()
    return text.splitlines()[0].strip() if text else type(e).__name__

# What a failed store call says, by kind (ObjectStore._io): one line each,
# never the raw response, never the cloud metadata address the client
# tried for credentials when none were given.
_NO_BUCKET = ("bucket_missing", "the bucket does not exist (404 on the bucket): create it "
              "(or pass remote_options={'create_bucket': True}), or fix the bucket name "
              "in the URL")
_DENIED = ("access_denied", "access denied (403): the credentials (remote_options key=/secret=, "
           "or the environment's) were refused or lack permission on this bucket and prefix")
_NO_CREDENTIALS = ("no_credentials", "no credentials: give remote_options key= and secret= "
                   "(or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")


def _classify(e: BaseException, exceptions) -> tuple:
    """(kind, one line) of an obstore failure: bucket_missing, access_denied,
    no_credentials, unreachable, or other."""
    text = str(e)
    if "169.254.169.254" in text or "/latest/api/token" in text or isinstance(
            e, getattr(exceptions, "UnauthenticatedError", ())):
        return _NO_CREDENTIALS
    if isinstance(e, exceptions.PermissionDeniedError) or re.search(
            r"\b403 Forbidden\b|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch", text):
        return _DENIED
    if "NoSuchBucket" in text or (re.search(r"\b404 Not Found\b", text) and re.search(
            r"list request|performing PUT|put request", text, re.I)):
        return _NO_BUCKET  # a listing or a write answered 404: no bucket there
    if re.search(r"error sending request|connect|timed? ?out|dns error|Connection refused",
                 text, re.I):
        m = re.search(r"(https?://[^/\s]+)", text)
        where = f" ({m.group(1)})" if m else ""
        return ("unreachable", f"the store is unreachable{where}: no answer after the "
                f"client's retries")
    return ("other", _first_line(e))


def _seconds(v) -> float:
    """A client option's duration ('5s', '500ms', '2min', or a number) in seconds."""
    m = re.match(r"^\s*([0-9.]+)\s*(ms|s|min|m)?\s*$", str(v))
    if not m:
        return 60.0
    return float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "min": 60.0, "m": 60.0,
                                None: 1.0}[m.group(2)]


class _Throttle:
    """A file reader that keeps to `bps` bytes per second (the optional
    bandwidth limit of uploads); it stops once `abort` is set."""

    def __init__(self, f, bps: float, abort: threading.Event):
        self.f, self.bps, self.t0, self.n = f, float(bps), time.monotonic(), 0
        self.abort = abort

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.n += len(data)
        ahead = self.n / self.bps - (time.monotonic() - self.t0)
        if ahead > 0 and self.abort.wait(ahead):
            raise CheckpointError("upload aborted (close_timeout_s passed)")
        return data

    def seek(self, *a):
        return self.f.seek(*a)

    def tell(self):
        return self.f.tell()


class _Store:
    """What both transports share: abort() (C++'s uploader closing past its
    deadline) stops a throttled upload, and every later one."""

    def __init__(self):
        self._aborted = threading.Event()

    def abort(self) -> None:
        self._aborted.set()

    def _reader(self, f, bps: Optional[float]):
        return _Throttle(f, bps, self._aborted) if bps else f


class ObjectStore(_Store):
    """An S3 (or GCS/Azure) prefix through obstore."""

    def __init__(self, url: str, options: dict):
        super().__init__()
        try:
            import obstore
            import obstore.store
        except ImportError as e:  # pragma: no cover - make build installs it
            raise CheckpointError(f"remote={url!r} needs the obstore package ({e})") from None
        self._ob = obstore
        opts = dict(options or {})
        self.concurrency = int(opts.pop("max_concurrency", 8))
        self.part_bytes = int(opts.pop("part_bytes", PART_BYTES))
        for k in _TIER_OPTIONS:
            opts.pop(k, None)
        m = re.match(r"^s3://([^/]+)/?(.*)$", url)
        if m:
            bucket, prefix = m.group(1), m.group(2).strip("/")
            endpoint = opts.pop("endpoint", None) or opts.pop("endpoint_url", None) or (
                opts.get("client_kwargs", {}) or {}).get("endpoint_url")
            opts.pop("client_kwargs", None)
            # create_bucket (remote_options): what the CreateBucket request needs
            self._s3 = {"bucket": bucket, "endpoint": endpoint, "key": opts.get("key"),
                        "secret": opts.get("secret"), "token": opts.get("token"),
                        "region": opts.get("region"),
                        "timeout": _seconds(opts.get("connect_timeout", "5s")) +
                        _seconds(opts.get("timeout", "60s"))}
            kw = {}
            for src, dst in (("key", "access_key_id"), ("secret", "secret_access_key"),
                             ("token", "session_token"), ("region", "region")):
                if opts.get(src) is not None:
                    kw[dst] = opts.pop(src)
            client = {"timeout": str(opts.pop("timeout", "60s")),
                      "connect_timeout": str(opts.pop("connect_timeout", "5s"))}
            if endpoint:
                kw["endpoint"] = endpoint
                client["allow_http"] = endpoint.startswith("http://")
            kw.update(opts)
            self.store = obstore.store.S3Store(
                bucket, prefix=prefix or None, client_options=client,
                retry_config={"max_retries": 3, "retry_timeout": timedelta(seconds=30),
                              "backoff": {"init_backoff": timedelta(seconds=0.1),
                                          "max_backoff": timedelta(seconds=2), "base": 2}},
                **kw)
        else:
            self._s3 = None
            self.store = obstore.store.from_url(url, **opts)
        self.url = url

    @property
    def s3(self) -> bool:
        """An s3:// URL (a bucket remote_options create_bucket can create)."""
        return self._s3 is not None

    def create_bucket(self) -> bool:
        """remote_options={'create_bucket': True}: an S3 CreateBucket request
        (path style, signed with AWS Signature V4; obstore has no call for
        it). True when made, False when it was there already (owned by these
        credentials); anything else is a one-line CheckpointIOError."""
        c = self._s3
        if c is None:
            raise CheckpointMismatchError(
                f"remote_options create_bucket is for s3:// URLs, not {self.url!r}")
        env = os.environ
        key = c["key"] or env.get("AWS_ACCESS_KEY_ID")
        secret = c["secret"] or env.get("AWS_SECRET_ACCESS_KEY")
        token = c["token"] or (None if c["key"] else env.get("AWS_SESSION_TOKEN"))
        region = c["region"] or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") \
            or "us-east-1"
        what = f"{self.url}: creating bucket {c['bucket']!r}"
        if not key or not secret:
            raise CheckpointIOError(f"{what}: {_NO_CREDENTIALS[1]}")
        base = (c["endpoint"] or f"https://s3.{region}.amazonaws.com").rstrip("/")
        url = f"{base}/{urllib.parse.quote(c['bucket'])}"
        body = b"" if region == "us-east-1" else (
            '<CreateBucketConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<LocationConstraint>{region}</LocationConstraint>"
            "</CreateBucketConfiguration>").encode()
        amz = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        parts = urllib.parse.urlsplit(url)
        digest = hashlib.sha256(body).hexdigest()
        headers = {"host": parts.netloc, "x-amz-content-sha256": digest, "x-amz-date": amz}
        if token:
            headers["x-amz-security-token"] = token
        signed = ";".join(sorted(headers))
        canonical = "\n".join(["PUT", parts.path, "",
                               "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
                               signed, digest])
        scope = f"{amz[:8]}/{region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        k = ("AWS4" + secret).encode()
        for part in (amz[:8], region, "s3", "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        sig = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={key}/{scope}, "
                                    f"SignedHeaders={signed}, Signature={sig}")
        req = urllib.request.Request(url, data=body, method="PUT",
                                     headers={k: v for k, v in headers.items() if k != "host"})
        try:
            with urllib.request.urlopen(req, timeout=c["timeout"]) as r:
                r.read()
            return True
        except urllib.error.HTTPError as e:
            text = e.read(4096).decode("utf-8", "replace")
            if e.code == 409 and "BucketAlreadyOwnedByYou" in text:
                return False
            if e.code == 409:
                raise CheckpointIOError(f"{what}: the name is taken (409 BucketAlreadyExists): "
                                        f"choose another bucket name") from None
            if e.code == 403:
                raise CheckpointIOError(f"{what}: {_DENIED[1]}") from None
            m = re.search(r"<Code>([^<]{1,64})</Code>", text)
            raise CheckpointIOError(f"{what}: HTTP {e.code}"
                                    f"{' ' + m.group(1) if m else ''}") from None
        except (urllib.error.URLError, OSError) as e:
            raise CheckpointIOError(f"{what}: the store is unreachable ({base}): "
                                    f"{_first_line(e)}") from None

    def _io(self, what: str, fn, *args, **kw):
        """Runs one obstore call. A missing object is FileNotFoundError; any
        other failure (the server down, a dead connection past the client's
        timeouts and retries, a refusal) is CheckpointIOError with one line."""
        try:
            return fn(*args, **kw)
        except FileNotFoundError:
            raise
        except self._ob.exceptions.NotFoundError:
            raise FileNotFoundError(f"{self.url}: {what}: not found") from None
        except self._ob.exceptions.BaseError as e:
            kind, why = _classify(e, self._ob.exceptions)
            err = CheckpointIOError(f"{self.url}: {what}: {why}")
            err.kind = kind  # Tier._unlisted: whether waiting can help
            raise err from None

    def put_file(self, key: str, src, name: str, bps: Optional[float] = None) -> None:
        """Uploads file `name` of the _core.Directory `src`. The file is opened
        through the seam (O_NOFOLLOW relative to the directory fd): obstore
        reads it through a FileReader whose reads fill the buffer with the
        GIL released (it never opens a path itself, so a link planted at the
        staged name is refused, never followed)."""
        with src.open(name) as f:
            self._io(f"uploading {key}", self._ob.put, self.store, key,
                     self._reader(f, bps),
                     chunk_size=self.part_bytes, max_concurrency=self.concurrency)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._io(f"writing {key}", self._ob.put, self.store, key, data)

    def get_bytes(self, key: str, limit: int) -> Optional[bytes]:
        try:
            meta = self._io(f"reading {key}", self._ob.head, self.store, key)
        except FileNotFoundError:
            return None
        if meta["size"] > limit:
            raise CorruptCheckpointError(f"{self.url}/{key} is {meta['size']} bytes, "
                                         f"more than a nonstop document ({limit})")
        try:
            return bytes(self._io(f"reading {key}",
                                  lambda: self._ob.get(self.store, key).bytes()))
        except FileNotFoundError:
            return None

    def get_chunks(self, key: str):
        """(size, iterator of buffers); FileNotFoundError when missing."""
        res = self._io(f"reading {key}", self._ob.get, self.store, key)
        stream = res.stream(min_chunk_size=self.part_bytes)

        def chunks():
            it = iter(stream)
            while True:
                buf = self._io(f"reading {key}", next, it, None)
                if buf is None:
                    return
                yield buf
        return res.meta["size"], chunks()

    def list(self, prefix: str = "") -> list:
        def run():
            out = []
            for batch in self._ob.list(self.store, prefix or None):
                out.extend((m["path"], m["size"]) for m in batch)
            return out
        return self._io("listing", run)

    def delete(self, keys: list) -> None:
        if keys:
            self._io("deleting", self._ob.delete, self.store, keys)


class PathStore(_Store):
    """A directory (a shared file system) as the remote: each object a file,
    written under a temp name, fsynced, renamed, directory fsynced. Every
    file and directory operation goes through the Env seam (_core.Directory,
    relative to directory fds, O_NOFOLLOW): a symlink anywhere under the root
    is refused or removed as a link, never followed."""

    def __init__(self, root: str, options: dict):
        super().__init__()
        self.root = os.path.abspath(root)
        self.part_bytes = int((options or {}).get("part_bytes", PART_BYTES))
        self.url = self.root

    def _p(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _dir(self, key: str, create: bool = True):
        """(the _core.Directory holding `key`, its last name); with create,
        the directories are made when missing, else FileNotFoundError."""
        names = key.split("/")
        d = _ext.core().Directory(self.root, create=create)
        for name in names[:-1]:
            d = d.subdir(name, create=create)
        return d, names[-1]

    def put_file(self, key: str, src, name: str, bps: Optional[float] = None) -> None:
        d, dest = self._dir(key)
        tmp = dest + ".tmp"
        d.unlink(tmp, missing_ok=True)  # a stale temp of a writer that died
        # created O_EXCL|O_NOFOLLOW; commit: fsync, rename over dest, directory fsync
        with src.open(name) as f, d.create(tmp) as out:
            rd = self._reader(f, bps)
            while True:
                buf = rd.read(self.part_bytes)
                if not buf:
                    break
                out.write(buf)
            out.commit(dest)

    def put_bytes(self, key: str, data: bytes) -> None:
        d, name = self._dir(key)
        d.write_atomic(name, bytes(data))

    def get_bytes(self, key: str, limit: int) -> Optional[bytes]:
        try:
            d, name = self._dir(key, create=False)
            return d.read(name, limit)  # None when missing; larger than limit: refused
        except FileNotFoundError:
            return None
        except CorruptCheckpointError:
            raise CorruptCheckpointError(f"{self._p(key)} is more than a nonstop document "
                                         f"({limit} bytes)") from None
        except IncompatibleCheckpointError as e:  # a symlink (or not a file): never followed
            raise CorruptCheckpointError(str(e)) from None

    def get_chunks(self, key: str):
        """(size, iterator of buffers); FileNotFoundError when missing."""
        try:
            d, name = self._dir(key, create=False)
            f = d.open(name)
        except IncompatibleCheckpointError as e:  # a symlink (or not a file): never followed
            raise CorruptCheckpointError(str(e)) from None
        size = f.size

        def chunks():
            with f:
                while True:
                    buf = f.read(self.part_bytes)
                    if not buf:
                        return
                    yield buf
        return size, chunks()

    def list(self, prefix: str = "") -> list:
        """(key, size) of every file under the root (or `prefix`), temps
        excluded; directories are walked through the seam, symlinks skipped."""
        try:
            d = _ext.core().Directory(self.root) if not prefix else self._dir(prefix + "/x", False)[0]
        except FileNotFoundError:
            return []
        out = []

        def walk(d, rel, depth):
            if depth > 8:  # the layout nests two levels: deeper is not ours
                return
            for name, kind in d.list():
                key = f"{rel}/{name}" if rel else name
                if kind == "dir":
                    try:
                        walk(d.subdir(name), key, depth + 1)
                    except FileNotFoundError:  # removed meanwhile
                        pass
                elif kind == "file" and not name.endswith(".tmp"):
                    st = d.stat(name)
                    if st is not None and st[0] == "file":
                        out.append((key, st[1]))
        walk(d, prefix.strip("/"), 0)
        return out

    def delete(self, keys: list) -> None:
        dirs = {}
        for k in keys:
            try:
                d, name = self._dir(k, create=False)
            except (FileNotFoundError, IncompatibleCheckpointError):  # gone, or a link: not ours
                continue
            d.unlink(name, missing_ok=True)
            d.sync()
            dirs[k.rsplit("/", 1)[0] if "/" in k else ""] = True
        for rel in dirs:  # a step directory left empty goes too
            if not rel:
                continue
            try:
                parent, name = self._dir(rel, create=False)
                parent.remove_dir(name)
            except (FileNotFoundError, CheckpointError):
                pass  # not empty (or gone): left for a later round


# Options of the tier itself (the rest go to the client).
_TIER_OPTIONS = ("max_to_keep", "bandwidth_bps", "close_timeout_s", "poll_s",
                 "commit_timeout_s", "retry_max_s", "nice", "job", "adopt", "every",
                 "create_bucket", "note_manifest")


def open_store(url: str, options: Optional[dict]):
    url = os.fspath(url)
    if re.match(r"^[a-z][a-z0-9+.-]*://", url) and not url.startswith("file://"):
        return ObjectStore(url, options or {})
    return PathStore(url[len("file://"):] if url.startswith("file://") else url, options or {})


# --------------------------------------------------------------- reading
# Everything but the bytes is C++'s (tier/remote_tier.h): which steps are
# committed, what a fetch verifies, retention, the job's claim. The store
# is handed to it as its transport.

def _tier(store):
    """The C++ remote tier over `store` (its transport)."""
    return _ext.core().RemoteTier(store)


def claim(store, job: str, adopt: bool) -> None:
    """This job owns the prefix: a prefix without a JOB document is claimed;
    one of another job is refused (IncompatibleCheckpointError) unless
    `adopt` (remote_options={"adopt": True}), which takes it over."""
    _tier(store).claim(job, bool(adopt), time.time())


def committed_steps(store, tier=None) -> list:
    """[(step, marker)] of the steps with a COMMITTED marker, newest first
    (a marker that does not parse is skipped with a warning)."""
    steps, damaged = (tier or _tier(store)).committed_steps()
    for e in damaged:
        warnings.warn(f"nonstop: remote: {e}; skipped", stacklevel=2)
    return steps


def fetch(store, step: int, rank: int, local_dir: str) -> str:
    """Downloads rank `rank`'s part of committed remote step `step` into
    local_dir/remote/step-N/rank-R.nsck (C++ verifies the size and every
    part's crc32 against the manifest while writing, then fsync and rename).
    Returns the one-slot job directory. Raises CorruptCheckpointError (a
    missing or damaged part, a manifest of another lineage) or OSError."""
    return _tier(store).fetch(int(step), int(rank), os.fspath(local_dir))


def temp_dir() -> str:
    """A new private directory for fetched parts: tempfile.mkdtemp makes it
    exclusively (a fresh random name, mode 0700); every file in it is then
    written and removed through the seam (fetch, remove_temp_dir)."""
    return tempfile.mkdtemp(prefix="nonstop-remote-")


def remove_temp_dir(path: str) -> None:
    """Removes a temp_dir() and everything in it through the seam (each
    subdirectory opened O_NOFOLLOW relative to its parent; links removed,
    never followed). Best effort: a failure leaves it in the temp folder."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        _ext.core().Directory(parent).remove_tree(name)
    except CheckpointError:
        pass


# -------------------------------------------------------------- retention

def retain(store, max_to_keep: int, keep: Optional[int], keep_max: Optional[int],
           tier=None) -> int:
    """Retention of the remote (rank 0, after each commit; the rules are
    remote_layout.h StepsToDelete and DeleteBatches: the newest max_to_keep
    committed steps stay, with keep=k also the steps whose counter is a
    multiple of k, the newest keep_max of them; nothing goes before a newer
    step is committed; a step goes marker first, then its manifests and
    notes, then its parts). Returns how many steps it deleted. `tier`: the
    uploader's RemoteTier (it caches the markers' counters between calls)."""
    return (tier or _tier(store)).retain(int(max_to_keep), int(keep or 0), int(keep_max or 0))


# --------------------------------------------------------------- uploader

_RUNTIME_STARTED = False


def _start_runtime_niced(nice: int) -> None:
    """obstore runs its transfers on a runtime of worker threads made the
    first time it is used in the process; they inherit that thread's CPU
    priority. The first use is usually restore() on the training thread, so
    the upload's HTTP work would run at training's priority. Used once here
    first, from a thread at `nice` (a call on an in-memory store: no I/O,
    milliseconds), the workers run at nice +`nice` for the process's life."""
    global _RUNTIME_STARTED
    if _RUNTIME_STARTED or nice <= 0:
        return
    _RUNTIME_STARTED = True

    def start():
        _ext.core().lower_thread_priority(nice)
        try:
            import obstore
            import obstore.store
            list(obstore.list(obstore.store.MemoryStore()))
        except Exception:  # noqa: BLE001 -- best effort: the priority stays as it is
            pass
    t = threading.Thread(target=start, name="nonstop-obstore-start", daemon=True)
    t.start()
    t.join(10)


class Uploader:
    """One rank's background uploads: the C++ thread (tier/uploader.h,
    _core.RemoteUploader) over the store. `target()` returns the newest
    checkpoint to upload as (counter, step) or None: the newest committed
    one (one process) or the newest globally agreed one; C++ calls it (with
    the GIL for that call alone) and decides everything else: which one goes
    next (every=n: each selected one in order), the backoff, retention, the
    close timeout, the counters, the thread's priority."""

    def __init__(self, store, dir: str, rank: int, world: int, target, core=None, keep=None,
                 options: Optional[dict] = None, keep_max: Optional[int] = None,
                 every: Optional[int] = None, job: str = ""):
        o = options or {}
        if int(o.get("max_to_keep", 2)) < 1:
            raise CheckpointMismatchError("remote_options max_to_keep must be at least 1")
        self.store = store
        self.up = _ext.core().RemoteUploader(
            _tier(store), target, dir, rank, world, every=every or 0,
            max_to_keep=int(o.get("max_to_keep", 2)), keep_every=int(keep or 0),
            keep_max=int(keep_max or 0), bps=o.get("bandwidth_bps"),
            poll_s=float(o.get("poll_s", 0.05)),
            commit_timeout_s=float(o.get("commit_timeout_s", 120.0)),
            retry_max_s=float(o.get("retry_max_s", 10.0)),
            close_timeout_s=float(o.get("close_timeout_s", 600.0)), nice=int(o.get("nice", 10)),
            job=job, note_manifest=bool(o.get("note_manifest", True)))
        # at exit (or when dropped unclosed) the thread stops before the interpreter does
        self._exit = weakref.finalize(self, self.up.close, False)
        self.rank, self.final = rank, None

    @property
    def stats(self) -> dict:
        return self.final if self.final is not None else self.up.stats()

    def snapshot(self) -> dict:
        s = dict(self.stats)
        s.update(url=self.store.url)
        return s

    def close(self, wait: bool = True) -> None:
        """Uploads the newest checkpoint still to upload (wait=True, within
        close_timeout_s), then stops the thread; a failure is a warning."""
        if self.final is not None:
            return
        err = self.up.close(wait)
        self.final = self.up.stats()
        if err is not None:
            warnings.warn(f"nonstop: {err}", stacklevel=3)


# ------------------------------------------------------------- restoring

def _listing(tier, world: Optional[int] = None) -> list:
    """The remote's committed steps as a restore plan takes them: [[step,
    counter]] (the COMMITTED marker's counter), newest first; JSON, so that
    rank 0 can hand its listing to the other ranks. `world`: only steps of
    that world size (another one's parts are resharded, not restored:
    _peer.py)."""
    return [[s, int(m.get("counter") or 0)] for s, m in committed_steps(None, tier)
            if world is None or int(m.get("world_size") or 1) == world]


# ------------------------------------------------------------------ tier

def check_every(every, world_size: int) -> Optional[int]:
    """remote_every: None, or an int >= 1 (one process only)."""
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise CheckpointMismatchError(
            f"remote_every must be an int >= 1 (1: every checkpoint, n: every n-th), "
            f"got {every!r}")
    if world_size > 1:
        raise CheckpointMismatchError(
            "remote_every is for one process: with several ranks the newest checkpoint "
            "every rank holds is uploaded (leave remote_every out)")
    return every


class Tier:
    """The remote tier of one Checkpointer (its `remote=` argument). The
    Checkpointer hands in what it owns (the engine, its reader), so this
    module imports nothing of the front end."""

    def __init__(self, ckpt, url, options: Optional[dict], core, read, loaded_cls):
        if options is not None and not isinstance(options, dict):
            raise CheckpointMismatchError("remote_options must be a dict")
        self.ckpt, self.core, self.read, self.loaded_cls = ckpt, core, read, loaded_cls
        self.options = dict(options or {})
        self.store = open_store(url, self.options)
        if isinstance(self.store, ObjectStore):  # before restore() uses obstore on this thread
            _start_runtime_niced(int(self.options.get("nice", 10)))
        self.uploader: Optional[Uploader] = None
        self.engine = None
        self.restored_from: Optional[str] = None
        # The job's identity on the remote (its JOB document): remote_options'
        # "job", else the local directory's absolute path (a replaced node
        # runs the same job in the same directory).
        self.job = str(self.options.get("job") or os.path.abspath(ckpt.dir))
        self.claimed = False
        # remote_every=n (remote_options "every"): every n-th checkpoint (its
        # counter a multiple of n) is uploaded, in order, none skipped for a
        # newer one; the next save() waits until each is copied out of the
        # ring (before_save). None: the newest committed one whenever the
        # uploader is free (older ones are skipped).
        self.every = check_every(self.options.get("every"), ckpt.world_size)
        if self.options.get("create_bucket") not in (None, False, True):
            raise CheckpointMismatchError("remote_options create_bucket must be True or False")
        if self.options.get("create_bucket") and not getattr(self.store, "s3", False):
            raise CheckpointMismatchError(
                f"remote_options create_bucket is for s3:// URLs, not the path {url!r}")

    def _claim(self) -> None:
        if not self.claimed and self.ckpt.rank == 0 and self.options.get("create_bucket"):
            self.store.create_bucket()  # before the JOB document is written
        if not self.claimed and self.ckpt.rank == 0:
            claim(self.store, self.job, bool(self.options.get("adopt")))
        self.claimed = True

    def _target(self):
        """The newest checkpoint to upload (the uploader's `newest`): the
        engine's newest committed one, or the ranks' newest agreed one of
        this run (an older record may name an abandoned future)."""
        dist = self.ckpt.session.dist
        engine = self.engine  # held here: close() clears the Checkpointer's first
        if engine is None or getattr(engine, "closed", False):
            return None
        if dist is not None:
            a = dist.agreed
            if a is None or a.get("lineage") != dist.lineage:
                return None
            return int(a["counter"]), int(a["step"])
        got = engine.latest()
        return None if got is None else (int(got[0]), int(got[1]))

    def before_save(self) -> None:
        """remote_every: before a checkpoint starts (and may reuse a ring
        slot), every selected one is copied out of the ring (C++; bounded by
        commit_timeout_s: one that never commits is given up)."""
        if self.uploader is not None:
            self.uploader.up.before_save()

    def started(self, counter: Optional[int] = None, step: Optional[int] = None) -> None:
        """After each save() (its engine counter and step): the first starts
        the upload thread; with remote_every, a selected one is queued."""
        if self.uploader is None:
            self._claim()
            self.engine = self.ckpt.session.engine
            self.uploader = Uploader(self.store, self.ckpt.dir, self.ckpt.rank,
                                     self.ckpt.world_size, self._target,
                                     keep=self.ckpt.keep, options=self.options,
                                     keep_max=self.ckpt.max_to_keep, every=self.every,
                                     job=self.job)
        if counter is not None:
            self.uploader.up.started(int(counter), int(step))

    def stats(self) -> dict:
        s = self.uploader.snapshot() if self.uploader is not None else {
            "url": self.store.url, "uploaded_step": None, "uploading_step": None}
        s["restored_from"] = self.restored_from
        return s

    def close(self, wait: bool = True) -> None:
        if self.uploader is not None:
            self.uploader.close(wait)

    # -- restore

    def _plan(self, listing, step: Optional[int], exclude=()) -> dict:
        """This rank's restore plan (C++, tier/remote_restore.h): its job
        directory's candidates and lineage, the peer tier's replica fetched
        for it, and the remote's committed `listing` ([[step, counter]];
        None: not listed), ordered by the planner; a local newest that the
        remote holds too is verified first."""
        peers = getattr(self.ckpt.session.dist, "peers", None)
        pf = peers.prefetched if peers is not None else None
        extra = [] if pf is None else [{"step": pf["step"], "counter": pf["counter"],
                                        "where": "peer"}]
        return self.core().plan_remote_restore(self.ckpt.dir, self.ckpt.rank, listing, step=step,
                                               extra=extra, exclude=list(exclude),
                                               where=self.store.url)

    def _try(self, step: int):
        """(LoadedCheckpoint, None) or (None, one-line error) for remote step."""
        try:
            d = fetch(self.store, step, self.ckpt.rank, self.ckpt.dir)
            loaded = self.read(d, self.ckpt.rank, None, self.ckpt.world_size, as_numpy=False)
            if loaded is None or loaded.step != step:
                raise CorruptCheckpointError(f"{d} holds no committed checkpoint of step {step}")
            return loaded, None
        except (CheckpointError, OSError) as e:
            return None, str(e)

    def restore(self, step: Optional[int]):
        """A LoadedCheckpoint from the remote when the plan puts a remote
        checkpoint first (newer by counter than every local one, the same
        checkpoint where the local copy fails to verify, or `step` only
        remote); None to restore from the local directory."""
        if self.ckpt.session.dist is not None:
            return self._restore_dist(step)
        try:
            self._claim()  # another job's prefix is refused before anything is read
        except (OSError, CheckpointIOError):
            pass  # the store is down: _unlisted below says so
        local = self._plan(None, step)
        newest = local["local_newest"]
        if step is not None and local["local_has_step"]:
            return None
        try:
            listing = _listing(_tier(self.store))
        except (CheckpointError, OSError) as e:
            self._unlisted(e, newest is None or step is not None, newest)
            return None
        errors, failed = [], []
        while True:
            order = self._plan(listing, step, failed)["order"]
            if not order:
                break
            s, counter, source = order[0]
            if source != "remote":
                return None  # the local path reads (and verifies) it
            loaded, err = self._try(s)
            if loaded is not None:
                self.restored_from = f"{self.store.url}/{_rl().step_dir(s)}"
                return loaded
            errors.append(err)
            failed.append(counter)
            warnings.warn(f"nonstop: remote step {s}: {err}; falling back", stacklevel=3)
        if errors and newest is None:
            raise CorruptCheckpointError(f"no remote checkpoint in {self.store.url} verifies: "
                                         f"{errors[0]}")
        return None

    def _unlisted(self, e, nothing_local: bool, newest) -> None:
        """The remote cannot be listed at restore (down, unreachable, refused:
        obstore's timeouts and retries bound how long that takes). With a
        local step to resume, a warning and the local path; with none, an
        error rather than a silent start from scratch (a replaced node must
        not restart the job at step 0 while the remote holds its state)."""
        msg = f"the remote tier {self.store.url} cannot be listed ({_first_line(e)})"
        if nothing_local:
            if getattr(e, "kind", None) in ("bucket_missing", "access_denied", "no_credentials"):
                # waiting will not help: say what to fix
                raise CheckpointIOError(
                    f"{msg}; {self.ckpt.dir} holds no local checkpoint to restore instead: "
                    f"fix the remote (or drop remote=)") from None
            raise CheckpointIOError(
                f"{msg} and {self.ckpt.dir} holds no local checkpoint to restore instead; "
                f"restore() again once the store is reachable (or drop remote=)") from None
        warnings.warn(f"nonstop: {msg}; restoring the newest local checkpoint (step {newest})",
                      stacklevel=4)

    def _restore_dist(self, step: Optional[int]):
        # JSON over the gloo group (_Comm.gather), never all_gather_object or
        # broadcast_object_list: those unpickle what the peers send. Rank 0
        # lists the remote; each rank plans (C++) and the ranks gather the
        # plans; C++ agrees on the steps (common_restore_steps), rank 0's order.
        d = self.ckpt.session.dist
        comm = d.comm()
        listing = None
        if d.rank == 0:
            try:
                listing = _listing(_tier(self.store), world=d.world)
            except (CheckpointError, OSError) as e:  # the store is down: said on every rank
                listing = _first_line(e)
        listing = comm.gather(listing)[0]  # rank 0's listing, on every rank
        agree = self.core().common_restore_steps
        if isinstance(listing, str):
            common = agree(comm.gather(self._plan(None, step)["order"]))
            self._unlisted(listing, not common, common[0][0] if common else None)
            return None
        every = comm.gather(self._plan(listing, step)["order"])
        errors = []
        for s, all_local in agree(every):
            if all_local:
                return None  # every rank's local copy: the local path reads it (recover)
            loaded, err = self._try(s)
            errs = comm.gather(err)
            bad = [(r, e) for r, e in enumerate(errs) if e is not None]
            if bad:
                where = "; ".join(f"rank {r}: {e}" for r, e in bad)
                errors.append(where)
                warnings.warn(f"nonstop: remote step {s} fails on {where}; falling back",
                              stacklevel=3)
                continue
            full = d.assemble(loaded.tensors, loaded.info, loaded.meta)
            engine = self.ckpt.session.engine
            d.engine = engine
            d.lineage = d.new_lineage()
            cand = engine.candidate()
            if cand is not None:
                engine.drop_candidate(cand[0])
            self.restored_from = f"{self.store.url}/{_rl().step_dir(s)}"
            return self.loaded_cls(loaded.step, loaded.counter, full, loaded.meta, loaded.info,
                                   loaded.path)
        if errors and not any(row[2] == "local" for e in every for row in e):
            raise CorruptCheckpointError(f"no remote checkpoint in {self.store.url} verifies on "
                                         f"every rank: {errors[0]}")
        return None


def is_remote(path, options: Optional[dict] = None) -> bool:
    """A URL (any scheme://), a path given with remote_options, or a plain
    directory used as a remote (step-N directories, no slot file)."""
    path = os.fspath(path)
    return (options is not None or bool(re.match(r"^[a-z][a-z0-9+.-]*://", path))
            or _rl().looks_like_remote_root(path))


def list_steps(url, options: Optional[dict] = None, rank: int = 0) -> list:
    """nonstop.list() of a remote: one row per step directory, newest first,
    in the shape of a local listing (where="remote"; bytes: rank `rank`'s
    part). A step without a marker is "uncommitted": an upload under way or
    given up, never read. Nothing is downloaded but the markers."""
    store = open_store(os.fspath(url), options or {})
    tier = _tier(store)
    rows = []
    job = ""  # the prefix's identity (its JOB document), as a local listing's "job"
    try:
        job = tier.job() or ""
    except CorruptCheckpointError as e:
        warnings.warn(f"nonstop: remote: {e}", stacklevel=2)
    for h in tier.list(rank):
        step, m, state = h["step"], h["marker"], h["state"]
        if h["reason"]:
            warnings.warn(f"nonstop: remote: {h['reason']}; skipped", stacklevel=2)
        reason = h["note"]  # C++ (RemoteTier::List): why rank `rank` cannot read it
        rows.append({"step": step, "counter": None if m is None else m["counter"],
                     "where": "remote", "path": f"{store.url}/{_rl().part_key(step, rank)}",
                     "state": state, "reason": reason,
                     "time": None if m is None else m["unix_s"],
                     "bytes": h["bytes"], "metrics": {},
                     # the tiers holding it (one format with a local listing, _manage)
                     "tiers": ([{"tier": "remote", "where": store.url, "recorded": False}]
                               if state == "committed" and not reason else []),
                     "job": job,
                     "world_size": None if m is None else m["world_size"]})
    return rows


def load(url: str, step: Optional[int], rank: int, options: Optional[dict], read,
         as_numpy: bool):
    """nonstop.load() of a remote URL (or, with remote_options, a remote
    path): the newest committed remote step that verifies (or `step`),
    fetched into a temporary directory and read from there."""
    store = open_store(url, options or {})
    # the planner's order of the committed steps (by counter: a checkpoint, not a step number)
    steps = [s for s, _, _ in _ext.core().plan_remote_restore(
        "", rank, _listing(_tier(store)), step=step)["order"]]
    if not steps:
        raise CheckpointNotFoundError(
            f"no committed remote checkpoint{'' if step is None else ' at step ' + str(step)} "
            f"in {store.url}")
    errors = []
    for s in steps:
        tmp = temp_dir()
        try:
            d = fetch(store, s, rank, tmp)
            loaded = read(d, rank, None, None, as_numpy)
            if loaded is not None:
                loaded.path = f"{store.url}/{_rl().part_key(s, rank)}"
                return loaded
        except (CheckpointError, OSError) as e:
            errors.append(str(e))
            warnings.warn(f"nonstop: remote step {s}: {e}; falling back", stacklevel=3)
        finally:
            remove_temp_dir(tmp)
    raise CorruptCheckpointError(f"no remote checkpoint in {store.url} verifies: {errors[0]}")
