"""An in-memory stand-in for nonstop._core (Engine and Reader), for testing
the Python front end's logic on its own.

It is deliberately the laziest engine the contract allows: tensors not
marked copy_at_checkpoint are copied only when the caller next waits
(wait_copied, wait_committed, register, checkpoint, close). A front end that
forgets a wait, or fails to mark a tensor changed outside optimizer.step(),
therefore saves the wrong values, and the tests see it.
"""
import ctypes
import os

from nonstop.errors import CheckpointMismatchError, CorruptCheckpointError

DISK = {}  # dir -> list of committed checkpoints, oldest first


def __getattr__(name):
    """JobDir (the directory's layout, set-aside, agreed records) is the real
    extension's: the fake engine writes nothing to disk, so the real JobDir
    finds nothing to act on. Schedule (when a checkpoint is due) is pure
    arithmetic, the real rule, and plan (the recovery planner) is pure too.
    Nothing else is taken from the extension (the front end must see what
    this stand-in lacks, e.g. restore)."""
    if name not in ("JobDir", "Schedule", "plan"):
        raise AttributeError(name)
    import importlib
    real = importlib.import_module("nonstop._core")
    return getattr(real, name)


class Engine:
    def __init__(self, dir, rank=0, world_size=1, max_in_flight=2, writers=0, staging_bytes=0,
                 chunk_bytes=0, copy_threads=1, medium="auto", extra_slots=0, keep_every=0,
                 small_initial_staging=False):
        if keep_every:
            raise NotImplementedError("the fake engine does not keep checkpoints (keep=)")
        self.dir, self.rank, self.world_size = dir, rank, world_size
        os.makedirs(dir, exist_ok=True)
        self.refs = []
        self.pending = None
        self.closed = False
        self.counter = max((c["counter"] for c in DISK.get(dir, [])), default=0)
        self.calls = []

    def register(self, tensors):
        self._finish()
        names = [t[0] for t in tensors]
        if len(set(names)) != len(names):
            raise CheckpointMismatchError("duplicate tensor names")
        self.refs = list(tensors)
        self.calls.append("register")

    def checkpoint(self, step, meta_json):
        self._finish()
        self.counter += 1
        ck = {"counter": self.counter, "step": step, "meta_json": meta_json.encode(),
              "world_size": self.world_size, "data": {}, "tensors": [], "damaged": False}
        for name, dtype, shape, nbytes, ptr, kind, index, stream, copy_now in self.refs:
            ck["tensors"].append({"name": name, "dtype": dtype, "shape": list(shape),
                                  "nbytes": nbytes})
            if copy_now:
                ck["data"][name] = ctypes.string_at(ptr, nbytes)
        self.pending = ck
        self.calls.append("checkpoint")
        return self.counter

    def _finish(self):
        if self.pending is None:
            return
        ck, self.pending = self.pending, None
        for name, dtype, shape, nbytes, ptr, kind, index, stream, copy_now in self.refs:
            if name not in ck["data"]:
                ck["data"][name] = ctypes.string_at(ptr, nbytes)
        DISK.setdefault(self.dir, []).append(ck)
        open(os.path.join(self.dir, f"rank-{self.rank:05d}.nsck"), "a").close()

    def wait_copied(self):
        self.calls.append("wait_copied")
        self._finish()

    def wait_committed(self, counter=0):
        self._finish()

    def latest(self):
        ck = DISK.get(self.dir)
        return (ck[-1]["counter"], ck[-1]["step"]) if ck else None

    def stats(self):
        return {"started": self.counter, "in_flight": int(self.pending is not None)}

    def close(self):
        self._finish()
        self.closed = True


class Reader:
    def __init__(self, dir, rank=0, verify_data=True):
        self.path = os.path.join(dir, f"rank-{rank:05d}.nsck")
        ckpts = list(reversed(DISK.get(dir, [])))
        self.world_size = ckpts[0]["world_size"] if ckpts else 1
        self._ckpts = ckpts
        self.skipped = [f"checkpoint {c['counter']} (step {c['step']}): damaged"
                        for c in ckpts if c["damaged"] and verify_data]
        good = [i for i, c in enumerate(ckpts) if not (c["damaged"] and verify_data)]
        self.newest_valid = good[0] if good else -1
        self.verify = verify_data

    @property
    def geometry(self):
        return {"slots": 3, "slot_bytes": 0, "rank": 0, "world_size": self.world_size}

    @property
    def checkpoints(self):
        return [{"counter": c["counter"], "step": c["step"], "meta_json": c["meta_json"],
                 "world_size": c["world_size"], "tensors": c["tensors"],
                 "committed": not (c["damaged"] and self.verify),
                 "reason": "damaged" if c["damaged"] else ""} for c in self._ckpts]

    def read_tensor(self, checkpoint, tensor, dst, nbytes, verify=True):
        c = self._ckpts[checkpoint]
        name = c["tensors"][tensor]["name"]
        if c["damaged"] and verify:
            raise CorruptCheckpointError(f"tensor {name!r}: crc mismatch")
        ctypes.memmove(dst, c["data"][name], nbytes)
