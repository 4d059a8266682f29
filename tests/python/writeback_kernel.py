"""Failed writeback on a real kernel (issue 24), driven from one process.

ext4 on a loop device whose backing file fills a small tmpfs. A failure point
punches chosen blocks of the backing file (the slots a new checkpoint may
use, their tables, the superblock ring's pages, or the file system's free
space, where a keep= copy goes) and fills the tmpfs: the kernel's writeback
of those pages fails (the loop device answers EIO/ENOSPC), Linux marks them
clean, and they exist only in the page cache. A checkpoint is saved into
that, then the space comes back and a few more checkpoints are saved. Then a
power cut: the checkpointer closes, syncfs, umount (which evicts every page of
the file system from the cache, the clean-but-never-written ones included,
as drop_caches would, without emptying the whole machine's cache) and mount.
Every checkpoint the checkpointer reported committed that should still be
there (the newest one, and the keep= copies) must restore bit for bit.

    python writeback_kernel.py MOUNT BACKING FILLER MEDIUM POINTS OUT.json
    python writeback_kernel.py reuse MOUNT BACKING FILLER MEDIUM ROUNDS OUT.json

(the second: reuse_rounds, the first commit into slots whose writeback failed)

Run by test_writeback_kernel.py as root under a hard timeout, which sets up
and tears down the tmpfs, the loop device and the mount. NONSTOP_WB_SPARSE=1
(there) leaves the image sparse, so that new blocks fail too (a thin pool).
"""
import ctypes
import errno
import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys

import torch

import nonstop

PAGE = 4096
FS_IOC_FIEMAP = 0xC020660B
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)
KINDS = ("data", "table", "record", "keep", "all")
KEEP = 3  # every 3rd checkpoint is kept
# A small staging pool: the default one is prefaulted at every open (~1 s).
SMALL = {"staging_bytes": 4 << 20, "chunk_bytes": 256 << 10}


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(96 * 1024, generator=g),  # 384 KiB
            "b": torch.randn(1000, generator=g),
            "i": torch.randint(0, 1 << 30, (333,), generator=g, dtype=torch.int64)}


def fiemap(path: str) -> list:
    """[(logical, physical, length)] of `path`'s extents, in bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out, start = [], 0
        while True:
            n = 64
            buf = bytearray(32 + 56 * n)
            struct.pack_into("QQIIII", buf, 0, start, (1 << 64) - 1 - start, 1, 0, n, 0)
            fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
            got = struct.unpack_from("I", buf, 20)[0]
            last = False
            for i in range(got):
                lo, ph, ln = struct.unpack_from("QQQ", buf, 32 + 56 * i)
                flags = struct.unpack_from("I", buf, 32 + 56 * i + 40)[0]
                out.append((lo, ph, ln))
                last = last or bool(flags & 1)
            if got == 0 or last:
                return out
            start = out[-1][0] + out[-1][2]
    finally:
        os.close(fd)


def physical(extents: list, offset: int, length: int) -> list:
    """The device byte ranges under [offset, offset + length) of a file."""
    got = []
    for lo, ph, ln in extents:
        a, b = max(lo, offset), min(lo + ln, offset + length)
        if a < b:
            got.append((ph + a - lo, b - a))
    return got


def punch(backing: str, ranges: list) -> None:
    fd = os.open(backing, os.O_RDWR)
    try:
        for off, n in ranges:
            if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                               ctypes.c_long(off), ctypes.c_long(n)) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"punching {backing} at {off}+{n}: {os.strerror(e)}")
    finally:
        os.close(fd)


def fill(filler: str) -> None:
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 20, PAGE):
            block = b"\0" * chunk
            while True:
                try:
                    os.write(fd, block)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)


def slot_file_geometry(path: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(PAGE)
        ring_records, = struct.unpack_from("<I", head, 40)
        ring_offset, = struct.unpack_from("<Q", head, 48)
        slot_count, = struct.unpack_from("<I", head, 56)
        slots_offset, slot_bytes = struct.unpack_from("<QQ", head, 64)
        records = []
        for i in range(ring_records):
            f.seek(ring_offset + i * PAGE)
            r = f.read(128)
            if struct.unpack_from("<I", r, 0)[0] != 0x4352534E:
                continue
            counter, step, slot = struct.unpack_from("<QqI", r, 32)
            data_offset, data_bytes = struct.unpack_from("<QQ", r, 56)
            records.append({"entry": i, "counter": counter, "step": step, "slot": slot,
                            "data_bytes": data_bytes})
    return {"ring_offset": ring_offset, "ring_records": ring_records, "slot_count": slot_count,
            "slots_offset": slots_offset, "slot_bytes": slot_bytes, "records": records}


def free_space_ranges(mount: str) -> list:
    """Device ranges of (nearly all) the file system's free blocks: a ballast
    file takes them, says where they are, and gives them back."""
    ballast = os.path.join(mount, "ballast")
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        st = os.statvfs(mount)
        size = (st.f_bavail * st.f_frsize) - (1 << 20)
        if size > 0:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    got = [(ph, ln) for _, ph, ln in fiemap(ballast)]
    os.unlink(ballast)
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _libc.syncfs(fd)  # the blocks are free again once the unlink's transaction commits
    finally:
        os.close(fd)
    return got


def target_ranges(kind: str, ckdir: str, mount: str, latest_step: int) -> list:
    """The device ranges a failure point of `kind` makes fail: never those
    of the newest committed checkpoint or of the file's header."""
    slot_path = os.path.join(ckdir, "rank-00000.nsck")
    g = slot_file_geometry(slot_path)
    mine = [r for r in g["records"] if r["step"] == latest_step]
    newest = max(mine, key=lambda r: r["counter"])
    ext = fiemap(slot_path)
    ranges = []
    if kind in ("data", "table", "all"):
        for s in range(g["slot_count"]):
            if s == newest["slot"]:
                continue
            start = g["slots_offset"] + s * g["slot_bytes"]
            if kind in ("data", "all"):
                ranges += physical(ext, start, newest["data_bytes"])
            if kind in ("table", "all"):
                ranges += physical(ext, start + newest["data_bytes"],
                                   g["slot_bytes"] - newest["data_bytes"])
    if kind in ("record", "all"):
        for i in range(g["ring_records"]):
            if i != newest["entry"]:
                ranges += physical(ext, g["ring_offset"] + i * PAGE, PAGE)
    if kind in ("keep", "all"):
        ranges += free_space_ranges(mount)
    return ranges


def power_cut(mount: str) -> None:
    dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", mount], check=True,
                         capture_output=True, text=True).stdout.strip()
    fd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _libc.syncfs(fd)  # this file system only: the machine's others are not ours
    finally:
        os.close(fd)
    # umount evicts every page of this file system from the cache (what
    # drop_caches would do to it, without emptying the whole machine's):
    # the pages whose writeback failed, which Linux marked clean, go too.
    subprocess.run(["umount", mount], check=True)
    subprocess.run(["mount", dev, mount], check=True)


def check_kept(ckdir: str, kept: list) -> list:
    """Problems found with the keep= copies (empty when each loads bit for bit)."""
    problems = []
    for s in kept:
        try:
            loaded = nonstop.load(ckdir, step=s)
        except Exception as e:  # noqa: BLE001 - reported as a lost checkpoint
            problems.append(f"kept step {s}: {type(e).__name__}: {e}")
            continue
        want, st = state_for(s), loaded.state
        if any(not torch.equal(torch.as_tensor(st[k]), want[k]) for k in want):
            problems.append(f"kept step {s} loaded with different bytes")
    return problems


def reuse_rounds(mount: str, backing: str, filler: str, medium: str, rounds: int) -> list:
    """The first checkpoint committed into slots whose writeback failed.

    Each round starts a fresh job directory (a new slot file, its slots not
    yet written), commits step 0, makes every other slot's blocks fail,
    saves steps 1 and 2 (both fail: their pages stay cached, marked clean,
    never written), gives the space back, saves step 3 into one of those
    slots (it commits), and cuts the power: the restart must restore step 3
    bit for bit. On e778719 every round restored an older step ("tensor
    table checksum mismatch"): the page cache kept the failed pages with
    their blocks mapped, the rewrite reached the disk, but ext4 never marked
    the fallocated (unwritten) extent written, so it read back as zeros.
    """
    report = []
    for r in range(rounds):
        ckdir = os.path.join(mount, f"reuse-{r}")
        live = state_for(0)
        opts = dict(state=live, every=1, medium=medium, tier="disk", max_in_flight=2, **SMALL)
        ck = nonstop.Checkpointer(ckdir, **opts)
        ck.save(0)
        ck.wait()
        ranges = []
        for kind in ("data", "table", "record"):
            ranges += target_ranges(kind, ckdir, mount, 0)
        punch(backing, ranges)
        fill(filler)
        outcomes = []
        for step in (1, 2, 3):
            if step == 3:
                os.unlink(filler)  # the space comes back
            for k, v in state_for(step).items():
                live[k].copy_(v)
            try:
                h = ck.save(step)
                e = h.exception(timeout=60)
            except nonstop.CheckpointError as err:  # an earlier one's error
                e = err
            outcomes.append(None if e is None else str(e).splitlines()[0])
            try:
                ck.wait()
            except nonstop.CheckpointError:
                pass
        latest = ck.latest()
        ck.close()
        power_cut(mount)
        ck = nonstop.Checkpointer(ckdir, **opts)
        got = ck.restore()
        ck.close()
        want = state_for(3)
        problems = []
        if got != latest:
            problems.append(f"restore() gave step {got}, the newest committed was {latest}")
        elif any(not torch.equal(live[k], want[k]) for k in want):
            problems.append(f"step {latest} restored with different bytes")
        print(f"reuse round {r}: outcomes {outcomes}, latest {latest}, restored {got}, "
              f"problems {problems}", flush=True)
        report.append({"round": r, "outcomes": outcomes, "latest": latest, "restored": got,
                       "punched_bytes": sum(n for _, n in ranges), "problems": problems})
        shutil.rmtree(ckdir)
    return report


def main() -> int:
    import time
    t0 = time.perf_counter()
    if sys.argv[1] == "reuse":
        mount, backing, filler, medium, rounds, out = sys.argv[2:8]
        with open(out, "w") as f:
            json.dump(reuse_rounds(mount, backing, filler, medium, int(rounds)), f, indent=1)
        return 0
    mount, backing, filler, medium, points, out = sys.argv[1:7]
    points = int(points)
    ckdir = os.path.join(mount, "ck")
    live = state_for(0)
    ck = nonstop.Checkpointer(ckdir, state=live, every=1, medium=medium, tier="disk",
                              keep=KEEP, max_to_keep=3, max_in_flight=2, **SMALL)
    step, latest, kept, report = 0, None, [], []

    def save():
        """Starts a checkpoint of `step`: its handle, or the error an
        earlier checkpoint raised from save() (this one started anyway)."""
        nonlocal step
        for k, v in state_for(step).items():
            live[k].copy_(v)
        step += 1
        try:
            return ck.save(step - 1)
        except nonstop.CheckpointError as e:
            return e

    def outcome(h):
        """None when it committed, else its error (first line)."""
        e = h if isinstance(h, Exception) else h.exception(timeout=60)
        return None if e is None else (str(e).splitlines() or [type(e).__name__])[0]

    def drain():
        try:
            ck.wait()
        except nonstop.CheckpointError:  # the failed checkpoints' errors, once
            pass

    save()
    drain()
    latest = ck.latest()
    for p in range(points):
        kind = KINDS[p % len(KINDS)]
        tt = [time.perf_counter()]
        ranges = target_ranges(kind, ckdir, mount, latest)
        punch(backing, ranges)
        fill(filler)
        tt.append(time.perf_counter())
        hs = [save() for _ in range(2)]  # two in flight into the failing blocks
        drain()
        errs = [outcome(h) for h in hs]
        os.unlink(filler)  # the space comes back
        oks = []
        for _ in range(3):
            h = save()
            drain()
            oks.append(outcome(h))
        tt.append(time.perf_counter())
        committed_now = ck.latest()
        kept = sorted(r["step"] for r in nonstop.list(ckdir)
                      if r["where"] == "keep" and r["state"] == "committed")
        ck.close()
        tt.append(time.perf_counter())
        power_cut(mount)
        tt.append(time.perf_counter())
        problems = check_kept(ckdir, kept)
        # The restart: restore() must give the newest committed step, bit for bit.
        ck = nonstop.Checkpointer(ckdir, state=live, every=1, medium=medium, tier="disk",
                                  keep=KEEP, max_to_keep=3, max_in_flight=2, **SMALL)
        got = ck.restore()
        want = state_for(committed_now)
        if got != committed_now:
            problems.append(f"restore() gave step {got}, the newest committed was "
                            f"{committed_now}")
        elif any(not torch.equal(live[k], want[k]) for k in want):
            problems.append(f"step {committed_now} restored with different bytes")
        tt.append(time.perf_counter())
        print(f"{time.perf_counter() - t0:6.2f}s point {p} ({kind}): latest {committed_now}, "
              f"kept {kept}, failed {errs}, after {oks}, problems {problems}",
              [round(b - a, 2) for a, b in zip(tt, tt[1:])], flush=True)
        report.append({"point": p, "kind": kind, "punched_bytes": sum(n for _, n in ranges),
                       "failed": errs, "after": oks,
                       "latest": committed_now, "kept": kept, "problems": problems})
        latest = got
        step = (got if got is not None else -1) + 1
    ck.close()
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
