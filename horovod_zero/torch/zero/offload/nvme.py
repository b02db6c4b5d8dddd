"""NVMe offload: each rank's fp32 master shards and Adam moments live in files,
read and written with O_DIRECT through io_uring (``horovod_zero._core.AioFile``).
A step reads the state once and writes it once, by sub-group, pipelined: sub-group
k+1 is read while k is stepped and k-1 written. Gradients never go to disk.

[Note: NVMe swap files and crashes]
The swap files are scratch state of the running job, never a checkpoint (checkpoints
go through the optimizer's state_dict). Each rank's ``NvmeSwapper`` creates its own
directory ``<nvme_path>/hvdz-<host>-<pid>-rank<r>-<unique>/`` holding one file per
state tensor (``master.swp``, ``exp_avg.swp``, ``exp_avg_sq.swp``) and a marker
file, and holds an exclusive flock on that directory for as long as it lives. The
kernel drops the lock when the process ends, however it ends.

A crash or kill in the middle of a step leaves the directory behind, its files a mix
of the old and the new step with no record of which part is which: they are never
read again. ``close()``, garbage collection of the swapper and a normal interpreter
exit remove the directory. When a swapper is later created on the same nvme_path
(the job restarted, or another job), it looks at every ``hvdz-*`` directory there:
one whose lock nobody holds was left by a process that is gone, so it is reported
(a warning naming it) and removed, unread; one whose lock is held belongs to a live
job and is left alone. A directory holding files this module did not write is never
removed. To resume after a crash, load a checkpoint.
"""

import errno
import fcntl
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
import weakref
from typing import NamedTuple

import torch

from horovod_zero import _core

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
DEFAULT_SUB_GROUP_ELEMS = 1 << 24  # 64 MiB per state tensor per sub-group
_PIPELINE_DEPTH = 3  # staging slots: one being read, one stepped, one written
_MARKER = "HVDZ_SWAP"
_SUFFIX = ".swp"
_DIR_RE = re.compile(r"^hvdz-.+-\d+-rank\d+-[A-Za-z0-9_]+$")
_NEW_PREFIX = ".hvdz-new-"  # a directory being set up, not yet locked and renamed
_STALE_PREFIX = ".hvdz-stale-"  # a stale directory being removed
_GRACE_SECONDS = 60.0  # how old those two must be before a scan takes them for leftovers
_WHERE = "pick a directory on a local disk, e.g. an ext4 or xfs NVMe mount"


class SubGroup(NamedTuple):
    """Elements [lo, hi) of region `region` (one param group's flat fp32 buffer)."""
    region: int
    lo: int
    hi: int


def require_liburing():
    if not getattr(_core, "HAVE_LIBURING", False):
        raise RuntimeError(
            "offload_optimizer='nvme' needs horovod_zero built with liburing, and this build has none. Install it "
            "(Debian/Ubuntu: apt-get install liburing-dev) and rebuild (bash examples/setup.sh), or point the build "
            "at a copy with HVDZ_LIBURING_ROOT=<dir with include/liburing.h and lib/liburing.a> "
            "(test/gpu/liburing_deps.sh makes one).")


def _open_direct(path):
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)


def check_nvme_path(path):
    """Raises a ValueError that says what to do unless `path` is an existing directory
    this process can write, on a file system with direct I/O (O_DIRECT)."""
    require_liburing()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"nvme_path must be a directory path, got {type(path).__name__}.")
    p = os.fspath(path)
    if not os.path.exists(p):
        raise ValueError(f"nvme_path {p!r} does not exist: create it, or {_WHERE}.")
    if not os.path.isdir(p):
        raise ValueError(f"nvme_path {p!r} is not a directory: {_WHERE}.")
    probe = os.path.join(p, f".hvdz-probe-{socket.gethostname()}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.close(_open_direct(probe))
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ValueError(f"nvme_path {p!r} is not writable by this process ({os.strerror(e.errno)}): "
                             f"give it write permission, or {_WHERE}.") from e
        if e.errno == errno.EINVAL:
            raise ValueError(f"nvme_path {p!r} is on a file system without direct I/O (O_DIRECT), which NVMe "
                             f"offload needs (tmpfs on older kernels, some network file systems): {_WHERE}.") from e
        raise ValueError(f"Cannot create a file in nvme_path {p!r}: {e.strerror}; {_WHERE}.") from e
    finally:
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


def _lock(path):
    """An fd holding an exclusive flock on directory `path`, or None if someone holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def _only_ours(path):
    return all(n == _MARKER or n.endswith(_SUFFIX) for n in os.listdir(path))


def remove_stale_dirs(path):
    """Removes the swap directories under `path` that no live process holds (see
    [Note: NVMe swap files and crashes]), with a warning for each. Returns their paths."""
    removed = []
    for entry in os.scandir(path):
        name = entry.name
        if not entry.is_dir(follow_symlinks=False) or not (_DIR_RE.match(name) or name.startswith(_NEW_PREFIX)
                                                           or name.startswith(_STALE_PREFIX)):
            continue
        try:
            if not _DIR_RE.match(name) and time.time() - entry.stat().st_mtime < _GRACE_SECONDS:
                continue  # maybe being set up, or removed, right now by a process beside us
            if name.startswith(_STALE_PREFIX):  # a cleaner that died half-way
                shutil.rmtree(entry.path, ignore_errors=True)
                continue
            fd = _lock(entry.path)
        except FileNotFoundError:
            continue
        if fd is None:
            continue  # a live job's
        try:
            if not _only_ours(entry.path):
                warnings.warn(f"NVMe offload: {entry.path} looks like a swap directory left by a crashed job, but holds "
                              "files horovod_zero did not write; leaving it alone.")
                continue
            # Renamed first, so that of several processes cleaning at once one removes it.
            doomed = os.path.join(path, f"{_STALE_PREFIX}{socket.gethostname()}-{os.getpid()}-{time.time_ns()}")
            os.rename(entry.path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(entry.path)
            warnings.warn(f"NVMe offload: removed {entry.path}, swap files left by a job that ended without cleaning "
                          "up (a crash or a kill). They were scratch state and were not read.")
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed


def _make_locked_dir(path, rank):
    """Creates this rank's swap directory, locked before any other process can see
    it under its final name. Returns (path, lock fd)."""
    for _ in range(5):
        tmp = tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=path)
        try:
            fd = _lock(tmp)
        except FileNotFoundError:
            continue
        if fd is None:
            continue
        final = os.path.join(path, f"hvdz-{socket.gethostname()}-{os.getpid()}-rank{rank}-"
                                   f"{os.path.basename(tmp)[len(_NEW_PREFIX):]}")
        try:
            with open(os.path.join(tmp, _MARKER), "w") as f:
                f.write("horovod_zero NVMe offload swap files (scratch state; removed when the job ends)\n")
            os.rename(tmp, final)
            return final, fd
        except FileNotFoundError:  # another process judged it stale and removed it
            os.close(fd)
    raise RuntimeError(f"Could not create a swap directory in {path!r}: other processes kept removing it.")


def _aligned_empty(nelems, alignment, pin):
    """fp32 CPU tensor of `nelems` whose address is a multiple of `alignment`."""
    nbytes = nelems * 4
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if t.data_ptr() % alignment:
        t = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
        off = -t.data_ptr() % alignment
        t = t[off:off + nbytes]
    return t.view(torch.float32)


def _cleanup(owner_pid, files, lock_fd, directory):
    if os.getpid() != owner_pid:  # a forked child exiting: the directory is its parent's
        return
    try:
        for f in files:
            f.close()  # waits for what is in flight: the kernel may still use the staging buffers
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        os.close(lock_fd)


class NvmeSwapper:
    """One rank's optimizer state in files under `path`: for each name in `names`,
    one fp32 value per element of each region (`regions`: the element counts of the
    param groups' flat master buffers).

    Each file lays the regions out one after another, each padded to the direct-I/O
    alignment (`alignment`, at least 4096 bytes); nothing outside a region's padded
    extent is ever read or written. `sub_group_elems` is rounded down to a multiple
    of alignment / 4 (the sub-groups start on aligned offsets). Staging memory is
    3 sub-groups' worth for every name (`staging_bytes`), pinned when `pin_memory`
    (by default: when CUDA is available). Not thread-safe: one thread drives it.
    """

    def __init__(self, path, rank, regions, names=STATE_NAMES, sub_group_elems=DEFAULT_SUB_GROUP_ELEMS,
                 queue_depth=8, request_bytes=1 << 20, pin_memory=None, timeout_seconds=600.0):
        check_nvme_path(path)
        if int(rank) < 0:
            raise ValueError(f"rank must be >= 0, got {rank}.")
        self.regions = [int(n) for n in regions]
        if any(n < 0 for n in self.regions):
            raise ValueError(f"Region sizes must be >= 0 elements, got {self.regions}.")
        self.names = tuple(names)
        if not self.names or len(set(self.names)) != len(self.names) or not all(
                re.fullmatch(r"[A-Za-z0-9_]+", n) for n in self.names):
            raise ValueError(f"names must be distinct words (letters, digits, _), got {names!r}.")
        if sub_group_elems < 1:
            raise ValueError(f"sub_group_elems must be >= 1, got {sub_group_elems}.")
        self.removed_stale = remove_stale_dirs(os.fspath(path))
        self.directory, lock_fd = _make_locked_dir(os.fspath(path), int(rank))
        files = []
        self._finalizer = weakref.finalize(self, _cleanup, os.getpid(), files, lock_fd, self.directory)
        # The layout needs the file system's alignment, which a first open tells.
        probe = _core.AioFile(self._path(self.names[0]), 0, 1)
        self.alignment = probe.alignment
        probe.close()
        self._offsets, self._extents, offset = [], [], 0
        for n in self.regions:
            self._offsets.append(offset)
            self._extents.append(self._pad(4 * n))
            offset += self._extents[-1]
        self.file_bytes = offset
        for name in self.names:
            files.append(_core.AioFile(self._path(name), offset, queue_depth, request_bytes, timeout_seconds))
        self._files = dict(zip(self.names, files))
        unit = self.alignment // 4
        self.sub_group_elems = max(unit, sub_group_elems // unit * unit)
        slot = min(self.sub_group_elems, max(self._extents, default=0) // 4) or unit
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._staging = [{name: _aligned_empty(slot, self.alignment, pin) for name in self.names}
                         for _ in range(_PIPELINE_DEPTH)]
        self._slot_elems = slot

    # -- layout --------------------------------------------------------------------
    def _path(self, name):
        return os.path.join(self.directory, name + _SUFFIX)

    def _pad(self, nbytes):
        return -(-nbytes // self.alignment) * self.alignment

    @property
    def staging_bytes(self):
        """Host memory held for staging (3 sub-groups × len(names) × 4 bytes per element)."""
        return sum(t.untyped_storage().nbytes() for s in self._staging for t in s.values())

    @property
    def state_bytes(self):
        """Bytes one pass over all sub-groups reads, and writes: len(names) × 4 bytes per
        element, each region padded to the alignment."""
        return len(self.names) * self.file_bytes

    @property
    def bytes_read(self):
        return sum(f.bytes_read for f in self._files.values())

    @property
    def bytes_written(self):
        return sum(f.bytes_written for f in self._files.values())

    @property
    def transfers_in_flight(self):
        """Transfers started and not yet waited for (at most 2 per name between
        sub-groups of for_each: the next read and the last write)."""
        return sum(f.transfers_in_flight for f in self._files.values())

    def sub_groups(self):
        """Every region cut into SubGroup ranges of at most sub_group_elems elements."""
        return [SubGroup(r, lo, min(n, lo + self.sub_group_elems))
                for r, n in enumerate(self.regions) for lo in range(0, n, self.sub_group_elems)]

    def _span(self, g):
        """(file offset, bytes) of sub-group g's transfer: its tail padded to the alignment."""
        return self._offsets[g.region] + 4 * g.lo, self._pad(4 * g.hi) - 4 * g.lo

    # -- transfers -------------------------------------------------------------------
    def _check_open(self):
        if not self._finalizer.alive:
            raise ValueError("This NvmeSwapper is closed.")

    def _start(self, name, slot, g, write):
        offset, nbytes = self._span(g)
        buf = self._staging[slot][name][:nbytes // 4]
        f = self._files[name]
        return f, (f.write_async(buf, offset) if write else f.read_async(buf, offset))

    @classmethod
    def _wait(cls, tickets):
        tickets = list(tickets)
        for i, (f, t) in enumerate(tickets):
            try:
                f.wait(t)
            except BaseException:
                cls._drain([tickets[i:]])  # from i on: an interrupted wait leaves its transfer in flight
                raise

    @staticmethod
    def _drain(pending):
        """Waits for every transfer in `pending` (lists of tickets), errors or not: the
        staging buffers must be free before anything else uses them."""
        for tickets in pending:
            for f, t in tickets:
                try:
                    f.wait(t)
                except Exception:  # the error being raised already says what went wrong
                    pass

    def _region_tensor(self, region, name, t, role):
        self._check_open()
        if name not in self._files:
            raise ValueError(f"Unknown state name {name!r}; this swapper holds {self.names}.")
        if not 0 <= region < len(self.regions):
            raise ValueError(f"Region {region} does not exist; there are {len(self.regions)}.")
        if t.dtype != torch.float32 or t.numel() != self.regions[region] or not t.is_contiguous():
            raise ValueError(f"The {role} of region {region} must be a contiguous float32 tensor of "
                             f"{self.regions[region]} elements, got {t.dtype} {tuple(t.shape)}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}.")
        return t.view(-1)

    def write_region(self, region, name, src):
        """Writes `src` (float32, one value per element of the region, any device) as
        state `name` of `region`, through the staging buffers 3 chunks deep."""
        src = self._region_tensor(region, name, src, "source")
        chunks = [SubGroup(region, lo, min(lo + self._slot_elems, src.numel()))
                  for lo in range(0, src.numel(), self._slot_elems)]
        pending = {}
        try:
            for i, g in enumerate(chunks):
                slot = i % _PIPELINE_DEPTH
                self._wait(pending.pop(slot, ()))
                self._staging[slot][name][:g.hi - g.lo].copy_(src[g.lo:g.hi])
                pending[slot] = [self._start(name, slot, g, write=True)]
            for slot in list(pending):  # in the order they were started
                self._wait(pending.pop(slot))
        except BaseException:
            self._drain(pending.values())
            raise

    def read_region(self, region, name, dst):
        """Reads state `name` of `region` into `dst` (float32, one value per element,
        any device), 3 chunks in flight."""
        dst = self._region_tensor(region, name, dst, "destination")
        chunks = [SubGroup(region, lo, min(lo + self._slot_elems, dst.numel()))
                  for lo in range(0, dst.numel(), self._slot_elems)]
        pending = {}
        try:
            for i, g in enumerate(chunks[:_PIPELINE_DEPTH]):
                pending[i] = [self._start(name, i, g, write=False)]
            for i, g in enumerate(chunks):
                slot = i % _PIPELINE_DEPTH
                self._wait(pending.pop(slot))
                dst[g.lo:g.hi].copy_(self._staging[slot][name][:g.hi - g.lo])
                if i + _PIPELINE_DEPTH < len(chunks):
                    pending[slot] = [self._start(name, slot, chunks[i + _PIPELINE_DEPTH], write=False)]
        except BaseException:
            self._drain(pending.values())
            raise

    def _check_groups(self, groups):
        unit = self.alignment // 4
        for g in groups:
            r, lo, hi = g
            if not (0 <= r < len(self.regions) and 0 <= lo < hi <= self.regions[r] and lo % unit == 0
                    and hi - lo <= self.sub_group_elems):
                raise ValueError(f"Sub-group {tuple(g)} is not one of sub_groups(): it must lie in a region, start "
                                 f"on a multiple of {unit} elements and span at most {self.sub_group_elems}.")

    def for_each(self, sub_groups, fn):
        """For each sub-group k of `sub_groups` in order: reads every state name's values
        into staging, calls fn(k, {name: float32 CPU tensor of hi - lo elements}), which
        updates them in place, and writes them back. fn must be done with the views when
        it returns (no asynchronous copy from them still running): their memory is reused
        for later sub-groups. The read of k+1 is in flight while fn(k) runs, and the
        write of k-1 finishes meanwhile. If fn raises, sub-groups
        before k are written, k and later are not, and the error is raised once nothing
        is in flight."""
        self._check_open()
        groups = [SubGroup(*g) for g in sub_groups]
        self._check_groups(groups)
        reads, writes = {}, {}  # by staging slot

        def start(slot, g, write):
            return [self._start(name, slot, g, write) for name in self.names]

        try:
            if groups:
                reads[0] = start(0, groups[0], write=False)
            for k, g in enumerate(groups):
                slot = k % _PIPELINE_DEPTH
                self._wait(reads.pop(slot))
                if k + 1 < len(groups):
                    nxt = (k + 1) % _PIPELINE_DEPTH
                    self._wait(writes.pop(nxt, ()))  # sub-group k-2's write frees the slot
                    reads[nxt] = start(nxt, groups[k + 1], write=False)
                n = g.hi - g.lo
                fn(k, {name: self._staging[slot][name][:n] for name in self.names})
                writes[slot] = start(slot, g, write=True)
            for slot in list(writes):  # in the order they were started
                self._wait(writes.pop(slot))
        except BaseException:
            self._drain(list(reads.values()) + list(writes.values()))
            raise

    def close(self):
        """Waits for any transfer in flight, then removes the swap directory and releases
        its lock. Also done when the swapper is garbage-collected or the interpreter exits."""
        self._finalizer()
