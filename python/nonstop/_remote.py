"""The remote tier's Python side: the obstore transport (put, get, list,
delete) handed to C++ as the distributed code hands it a Comm, and torch
adaptation of what C++ fetched. Everything else is C++'s, with the GIL
released (nonstop._core.RemoteTier, RemoteUploader, PathStore,
remote_restore.h, s3_request.h); docs/TIERS.md describes the tier.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
import warnings
import weakref
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Optional

from . import _ext
from .errors import (CheckpointError, CheckpointIOError, CheckpointMismatchError,
                     CorruptCheckpointError)

PART_BYTES = 8 << 20              # the transports' preferred crc unit and multipart chunk
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")  # scheme://


# ------------------------------------------------------------------ stores

class ObjectStore:
    """An S3 (or GCS/Azure) prefix through obstore. abort() (C++'s uploader
    closing past its deadline) stops a throttled upload, and every later one."""

    def __init__(self, url: str, options: dict):
        self._aborted = threading.Event()
        try:
            import obstore
            import obstore.store
        except ImportError as e:  # pragma: no cover - make build installs it
            raise CheckpointError(f"remote={url!r} needs the obstore package ({e})") from None
        self._ob = obstore
        c = _ext.core().store_options(url, options)  # C++: tier/s3_request.h SortStoreOptions
        self.concurrency, self.part_bytes, self._s3 = c["concurrency"], c["part_bytes"], c["s3"]
        self.s3 = self._s3 is not None  # a bucket remote_options create_bucket can create
        if self.s3:
            self.store = obstore.store.S3Store(
                c["bucket"], prefix=c["prefix"], client_options=c["client"],
                retry_config={"max_retries": 3, "retry_timeout": timedelta(seconds=30),
                              "backoff": {"init_backoff": timedelta(seconds=0.1),
                                          "max_backoff": timedelta(seconds=2), "base": 2}},
                **c["kw"])
        else:
            self.store = obstore.store.from_url(url, **c["kw"])
        self.url = url

    def abort(self) -> None:
        self._aborted.set()

    def create_bucket(self) -> bool:
        """remote_options={'create_bucket': True} (s3:// only): a CreateBucket
        request signed in C++ (obstore has none). True when made, False when
        these credentials own it already; else a one-line CheckpointIOError."""
        c = self._s3
        r = _ext.core().s3_create_bucket(self.url, c["endpoint"], c["bucket"], c["region"],
                                         c["key"], c["secret"], c["token"])  # else $AWS_*
        req = urllib.request.Request(r["url"], data=r["body"], method="PUT", headers=r["headers"])
        try:
            with urllib.request.urlopen(req, timeout=c["timeout"]) as got:
                got.read()
            return True
        except urllib.error.HTTPError as e:
            return _ext.core().s3_create_bucket_answer(r["what"], e.code, e.read(4096))
        except (urllib.error.URLError, OSError) as e:  # its first line says it
            why = (str(e).strip() or type(e).__name__).splitlines()[0].strip()
            raise CheckpointIOError(f"{r['what']}: the store is unreachable ({r['base']}): "
                                    f"{why}") from None

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
            ex = self._ob.exceptions  # the kind and line: C++ (tier/s3_request.h)
            kind, why = _ext.core().store_failure(
                str(e).strip() or type(e).__name__, isinstance(e, ex.PermissionDeniedError),
                isinstance(e, getattr(ex, "UnauthenticatedError", ())))
            err = CheckpointIOError(f"{self.url}: {what}: {why}")
            err.kind = kind  # RemoteTier WaitingHelps: whether waiting can help
            raise err from None

    def put_file(self, key: str, src, name: str, bps: Optional[float] = None) -> None:
        """Uploads file `name` of the _core.Directory `src`, opened through the
        seam (O_NOFOLLOW: a link planted at the staged name is refused) and
        read without the GIL; bps: at most that many bytes a second
        (tier/pacer.h) until abort() stops them."""
        with src.open(name, bps=bps or 0, abort=self._aborted) as f:
            self._io(f"uploading {key}", self._ob.put, self.store, key, f,
                     chunk_size=self.part_bytes, max_concurrency=self.concurrency)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._io(f"writing {key}", self._ob.put, self.store, key, data)

    def get_bytes(self, key: str, limit: int) -> Optional[bytes]:
        try:  # its size first: a hostile object is refused before it is read
            meta = self._io(f"reading {key}", self._ob.head, self.store, key)
            if meta["size"] > limit:
                raise CorruptCheckpointError(f"{self.url}/{key} is {meta['size']} bytes, "
                                             f"more than a nonstop document ({limit})")
            return bytes(self._io(f"reading {key}",
                                  lambda: self._ob.get(self.store, key).bytes()))
        except FileNotFoundError:  # missing (or gone between the two calls)
            return None

    def get_chunks(self, key: str):
        """(size, iterator of buffers); FileNotFoundError when missing."""
        res = self._io(f"reading {key}", self._ob.get, self.store, key)
        it = iter(res.stream(min_chunk_size=self.part_bytes))
        return res.meta["size"], iter(lambda: self._io(f"reading {key}", next, it, None), None)

    def list(self, prefix: str = "") -> list:
        return self._io("listing", lambda: [(m["path"], m["size"]) for batch in
                                            self._ob.list(self.store, prefix or None)
                                            for m in batch])

    def delete(self, keys: list) -> None:
        if keys:
            self._io("deleting", self._ob.delete, self.store, keys)


def open_store(url: str, options: Optional[dict]):
    """The transport of `url`: an ObjectStore, or for file:// and a plain
    path the C++ PathStore (tier/path_transport.h: through the Env seam,
    relative to directory fds, links refused; no Python runs per byte)."""
    url = os.fspath(url)
    if _URL.match(url) and not url.startswith("file://"):
        return ObjectStore(url, options or {})
    return _ext.core().PathStore(url[len("file://"):] if url.startswith("file://") else url,
                                 int((options or {}).get("part_bytes", PART_BYTES)))


# ------------------------------------------------------- fetched parts

@contextlib.contextmanager
def temp_dir():
    """A new private directory for fetched parts (tempfile.mkdtemp: a fresh
    random name, mode 0700), removed at the end through the seam (links
    removed, never followed; best effort: a failure leaves it there)."""
    path = tempfile.mkdtemp(prefix="nonstop-remote-")
    try:
        yield path
    finally:
        parent, name = os.path.split(os.path.abspath(path))
        try:
            _ext.core().Directory(parent).remove_tree(name)
        except CheckpointError:
            pass


# --------------------------------------------------------------- uploader

_RUNTIME_STARTED = False


def _start_runtime_niced(nice: int) -> None:
    """obstore's worker threads, made at its first use in the process,
    inherit that thread's CPU priority: usually training's (restore() first).
    Used first here from a thread at `nice` (an in-memory store: no I/O),
    they run the uploads at nice +`nice` for the process's life."""
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
        self.up = None     # the upload thread (_core.RemoteUploader), from the first save
        self.final = None  # its stats once closed
        self.engine = None
        self.restored_from: Optional[str] = None
        # The job's identity on the remote (its JOB document): remote_options'
        # "job", else the local directory's absolute path (a replaced node
        # runs the same job in the same directory).
        self.job = str(self.options.get("job") or os.path.abspath(ckpt.dir))
        self.claimed = False
        # remote_every=n: every n-th checkpoint, none skipped; None: the newest.
        self.every = _ext.core().check_remote_every(self.options.get("every"), ckpt.world_size)
        if self.options.get("create_bucket") not in (None, False, True):
            raise CheckpointMismatchError("remote_options create_bucket must be True or False")
        if self.options.get("create_bucket") and not getattr(self.store, "s3", False):
            raise CheckpointMismatchError(
                f"remote_options create_bucket is for s3:// URLs, not the path {url!r}")

    def _claim(self) -> None:
        if not self.claimed and self.ckpt.rank == 0:
            if self.options.get("create_bucket"):
                self.store.create_bucket()  # before the JOB document is written
            # another job's prefix is refused (IncompatibleCheckpointError) unless adopt
            _ext.core().RemoteTier(self.store).claim(self.job, bool(self.options.get("adopt")),
                                                     time.time())
        self.claimed = True

    def _target(self):
        """The uploader's `newest` (C++ calls it with the GIL for that call
        alone): (counter, step) of the engine's newest committed checkpoint,
        or the ranks' newest agreed one of this run (an older record may
        name an abandoned future); None."""
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
        if self.up is not None:
            self.up.before_save()

    def started(self, counter: Optional[int] = None, step: Optional[int] = None) -> None:
        """After each save() (its engine counter and step): the first starts
        the upload thread; with remote_every, a selected one is queued."""
        if self.up is None:
            self._claim()
            self.engine = self.ckpt.session.engine
            c = self.ckpt  # the options are read in C++ (C++ decides everything else)
            self.up = _ext.core().RemoteUploader.from_options(
                _ext.core().RemoteTier(self.store), self._target, c.dir, c.rank, c.world_size,
                self.options, self.every or 0, int(c.keep or 0), int(c.max_to_keep or 0), self.job)
            # at exit (or when dropped unclosed) the thread stops before the interpreter does
            weakref.finalize(self, self.up.close, False)
        if counter is not None:
            self.up.started(int(counter), int(step))

    def stats(self) -> dict:
        s = {"uploaded_step": None, "uploading_step": None} if self.up is None else dict(
            self.final if self.final is not None else self.up.stats())
        s.update(url=self.store.url, restored_from=self.restored_from)
        return s

    def close(self, wait: bool = True) -> None:
        """Uploads the newest checkpoint still to upload (wait=True, within
        close_timeout_s), then stops the thread; a failure is a warning."""
        if self.up is None or self.final is not None:
            return
        err = self.up.close(wait)
        self.final = self.up.stats()
        if err is not None:
            warnings.warn(f"nonstop: {err}", stacklevel=2)

    # -- restore

    def restore(self, step: Optional[int]):
        """A LoadedCheckpoint from the remote when the plan puts a remote
        checkpoint first, else None (the local directory). The loop and, with
        ranks, the agreement are C++'s (tier/remote_restore.h); Python reads
        into torch what it fetched."""
        c, d = self.ckpt, self.ckpt.session.dist
        pf = getattr(getattr(d, "peers", None), "prefetched", None)  # the peer tier's replica
        if d is None:
            try:
                self._claim()  # another job's prefix is refused before anything is read
            except (OSError, CheckpointIOError):
                pass  # the store is down: the restore says so
        loaded = self.core().restore_remote(
            _ext.core().RemoteTier(self.store), c.dir, c.rank, step,
            [] if pf is None else [dict(pf, where="peer")], c.dir,  # a local candidate
            lambda p: self.read(p, c.rank, None, c.world_size, as_numpy=False),
            world=None if d is None else d.world, gather=None if d is None else d.comm().gather)
        if loaded is None:
            return None
        self.restored_from = f"{self.store.url}/{_ext.core().remote_layout.step_dir(loaded.step)}"
        if d is None:
            return loaded
        full = d.assemble(loaded.tensors, loaded.info, loaded.meta)
        d.engine = engine = self.ckpt.session.engine
        d.lineage = d.new_lineage()
        cand = engine.candidate()
        if cand is not None:
            engine.drop_candidate(cand[0])
        return self.loaded_cls(loaded.step, loaded.counter, full, loaded.meta, loaded.info,
                               loaded.path)


def is_remote(path, options: Optional[dict] = None) -> bool:
    """A URL (any scheme://), a path given with remote_options, or a plain
    directory used as a remote (step-N directories, no slot file)."""
    path = os.fspath(path)
    return (options is not None or bool(_URL.match(path))
            or _ext.core().remote_layout.looks_like_remote_root(path))


def load(url: str, step: Optional[int], rank: int, options: Optional[dict], read,
         as_numpy: bool):
    """nonstop.load() of a remote: the step C++ RestoreFromRemote fetches
    (and verifies) into a temporary directory, read from there."""
    core, store = _ext.core(), open_store(url, options or {})
    with temp_dir() as tmp:
        loaded = core.restore_remote(core.RemoteTier(store), "", rank, step, [], tmp,
                                     lambda d: read(d, rank, None, None, as_numpy), load=True)
    loaded.path = f"{store.url}/{core.remote_layout.part_key(loaded.step, rank)}"
    return loaded
