"""NVMe offload's swapper (horovod_zero/torch/zero/offload/nvme.py) and the AioFile
under it: round trips at odd sizes, the pipelined for_each against the same maths
on in-memory tensors, exact disk byte counts, the staging bound, refusals of bad
paths and tensors, and the directories crashed jobs leave behind."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import warnings

import pytest
import torch

from horovod_zero import _core
from horovod_zero.torch.zero.offload import nvme

needs_liburing = pytest.mark.skipif(not getattr(_core, "HAVE_LIBURING", False),
                                    reason="this build has no liburing (no NVMe offload)")
NAMES = nvme.STATE_NAMES


def swap_dirs(path):
    return sorted(n for n in os.listdir(path) if n.startswith("hvdz-"))


def pad4k(nbytes):
    return -(-nbytes // 4096) * 4096


@needs_liburing
def test_aiofile_round_trips_and_counts_bytes(tmp_path):
    f = _core.AioFile(str(tmp_path / "f.swp"), 3 << 20, queue_depth=2, request_bytes=8192)
    assert f.alignment >= 4096 and f.size >= 3 << 20
    a = f.alignment
    g = torch.Generator().manual_seed(0)
    total = 0
    for offset, nbytes in [(0, a), (a, 5 * a), (16 * a, (2 << 20) + a)]:
        src = nvme._aligned_empty(nbytes // 4, a, pin=False)
        src.copy_(torch.randn(nbytes // 4, generator=g))
        dst = nvme._aligned_empty(nbytes // 4, a, pin=False).zero_()
        f.wait(f.write_async(src, offset))
        f.wait(f.read_async(dst, offset))
        assert torch.equal(src, dst)
        total += nbytes
    assert (f.bytes_written, f.bytes_read, f.transfers_in_flight) == (total, total, 0)
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.read_async(dst, 0)


@needs_liburing
def test_aiofile_refuses_bad_tensors_offsets_and_tickets(tmp_path):
    f = _core.AioFile(str(tmp_path / "f.swp"), 1 << 20)
    buf = nvme._aligned_empty(4096, f.alignment, pin=False)
    with pytest.raises(ValueError, match="buffer address is not a multiple of 4096"):
        f.write_async(buf[1:1025], 0)
    with pytest.raises(ValueError, match="length 4000 is not"):
        f.write_async(buf[:1000], 0)
    with pytest.raises(ValueError, match="not contiguous"):
        f.write_async(buf.view(2, 2048).t(), 0)
    with pytest.raises(ValueError, match="offset 100 is not"):
        f.read_async(buf[:1024], 100)
    with pytest.raises(ValueError, match="end past the file"):
        f.read_async(buf[:1024], 1 << 20)
    with pytest.raises(ValueError, match="already waited"):
        f.wait(12345)
    assert f.bytes_written + f.bytes_read == 0
    f.close()


@needs_liburing
def test_regions_round_trip_at_odd_sizes(tmp_path):
    regions = [5000, 1, 3 * 4096 + 7, 0, (1 << 18) + 3]
    sw = nvme.NvmeSwapper(str(tmp_path), rank=0, regions=regions, sub_group_elems=5000, pin_memory=False)
    assert sw.sub_group_elems == 4096  # rounded down to whole 4 KiB pages of fp32
    g = torch.Generator().manual_seed(1)
    data = {(r, name): torch.randn(n, generator=g) for r, n in enumerate(regions) for name in NAMES}
    for (r, name), t in data.items():
        sw.write_region(r, name, t)
    padded = sum(pad4k(4 * n) for n in regions)
    assert sw.state_bytes == len(NAMES) * padded
    assert sw.bytes_written == sw.state_bytes  # every region once, tails padded, nothing more
    # Read back in another order: neighbours' padded tails must not have clobbered anything.
    for (r, name), t in reversed(list(data.items())):
        out = torch.full_like(t, float("nan"))
        sw.read_region(r, name, out)
        assert torch.equal(out, t), (r, name)
    assert sw.bytes_read == sw.state_bytes
    with pytest.raises(ValueError, match="contiguous float32 tensor of 5000 elements"):
        sw.write_region(0, "master", torch.zeros(5000, dtype=torch.float64))
    with pytest.raises(ValueError, match="Unknown state name 'momentum'"):
        sw.read_region(0, "momentum", torch.zeros(5000))
    sw.close()


def stand_in_step(k, views):
    """Stands for the optimizer step: depends on k so that a view given for the wrong
    sub-group shows."""
    m, a, s = views["master"], views["exp_avg"], views["exp_avg_sq"]
    m.add_(1.0 + 0.01 * k)
    a.mul_(0.9).add_(m)
    s.mul_(0.99).addcmul_(m, m, value=0.01)


@needs_liburing
def test_for_each_matches_in_memory_reference(tmp_path):
    regions = [3 * 4096 + 5, 10000, 4096]
    sw = nvme.NvmeSwapper(str(tmp_path), rank=1, regions=regions, sub_group_elems=4096, pin_memory=False)
    groups = sw.sub_groups()
    assert groups == [(0, 0, 4096), (0, 4096, 8192), (0, 8192, 12288), (0, 12288, 12293),
                      (1, 0, 4096), (1, 4096, 8192), (1, 8192, 10000), (2, 0, 4096)]
    g = torch.Generator().manual_seed(2)
    ref = {name: [torch.randn(n, generator=g) for n in regions] for name in NAMES}
    for name in NAMES:
        for r in range(len(regions)):
            sw.write_region(r, name, ref[name][r])
    staging = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for s in sw._staging for t in s.values()]
    assert sw.staging_bytes <= 3 * sw.sub_group_elems * len(NAMES) * 4 + 3 * len(NAMES) * sw.alignment
    in_flight, seen = [], []

    def fn(k, views):
        assert set(views) == set(NAMES)
        for v in views.values():
            assert v.dtype == torch.float32 and v.numel() == groups[k].hi - groups[k].lo
            assert any(lo <= v.data_ptr() < hi for lo, hi in staging)  # no memory beyond staging
        in_flight.append(sw.transfers_in_flight)
        seen.append(k)
        stand_in_step(k, views)

    for _ in range(3):
        read0, written0 = sw.bytes_read, sw.bytes_written
        in_flight.clear()
        seen.clear()
        sw.for_each(groups, fn)
        # Each state tensor read once and written once: 4 bytes an element, tails padded
        # to 4 KiB (12293 and 10000 elements: 49172 and 40000 bytes, padded to 53248 and 40960).
        assert sw.bytes_read - read0 == sw.state_bytes == len(NAMES) * (53248 + 40960 + 16384)
        assert sw.bytes_written - written0 == sw.state_bytes
        # The next read is in flight during fn(k), and the write of k-1 (then k-2 too, at the end).
        n = len(NAMES)
        assert seen == list(range(len(groups)))
        assert in_flight == [n] + [2 * n] * (len(groups) - 1)
        assert sw.transfers_in_flight == 0
        for k, (r, lo, hi) in enumerate(groups):
            stand_in_step(k, {name: ref[name][r][lo:hi] for name in NAMES})
    for name in NAMES:
        for r, n in enumerate(regions):
            out = torch.empty(n)
            sw.read_region(r, name, out)
            assert torch.equal(out, ref[name][r]), (name, r)
    sw.close()


@needs_liburing
def test_for_each_error_in_fn_keeps_earlier_sub_groups_and_drains(tmp_path):
    sw = nvme.NvmeSwapper(str(tmp_path), rank=0, regions=[5 * 4096], sub_group_elems=4096, pin_memory=False)
    for name in NAMES:
        sw.write_region(0, name, torch.zeros(5 * 4096))

    def fn(k, views):
        if k == 2:
            raise KeyError("step failed")
        views["master"].fill_(k + 1)

    with pytest.raises(KeyError, match="step failed"):
        sw.for_each(sw.sub_groups(), fn)
    assert sw.transfers_in_flight == 0
    out = torch.empty(5 * 4096)
    sw.read_region(0, "master", out)
    assert torch.equal(out, torch.tensor([1.0] * 4096 + [2.0] * 4096 + [0.0] * 3 * 4096))
    with pytest.raises(ValueError, match="start on a multiple of 1024"):
        sw.for_each([(0, 10, 20)], fn)
    with pytest.raises(ValueError, match="span at most 4096"):
        sw.for_each([(0, 0, 8192)], fn)
    sw.close()


@needs_liburing
def test_close_and_garbage_collection_remove_the_files(tmp_path):
    sw = nvme.NvmeSwapper(str(tmp_path), rank=3, regions=[100], sub_group_elems=4096, pin_memory=False)
    d = sw.directory
    assert os.path.basename(d).startswith("hvdz-") and "-rank3-" in d
    assert sorted(os.listdir(d)) == ["HVDZ_SWAP", "exp_avg.swp", "exp_avg_sq.swp", "master.swp"]
    sw.close()
    assert not os.path.exists(d)
    with pytest.raises(ValueError, match="closed"):
        sw.for_each(sw.sub_groups(), stand_in_step)
    sw.close()  # again: nothing to do
    sw = nvme.NvmeSwapper(str(tmp_path), rank=0, regions=[100], pin_memory=False)
    d = sw.directory
    del sw
    assert not os.path.exists(d)
    assert swap_dirs(tmp_path) == []


@needs_liburing
def test_check_nvme_path_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist: create it, or pick a directory on a local disk"):
        nvme.check_nvme_path(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        nvme.check_nvme_path(str(tmp_path / "file"))
    with pytest.raises(TypeError, match="must be a directory path"):
        nvme.check_nvme_path(3)
    # A read-only directory that an unprivileged user can reach (pytest's tmp_path is not).
    top = tempfile.mkdtemp(prefix="hvdz-test-ro-")
    try:
        os.chmod(top, 0o755)
        ro = os.path.join(top, "ro")
        os.mkdir(ro, 0o555)
        if os.geteuid() == 0:  # root writes anywhere: check as nobody
            os.seteuid(65534)
        try:
            with pytest.raises(ValueError, match="is not writable by this process .*Permission denied"):
                nvme.check_nvme_path(ro)
        finally:
            if os.getuid() == 0:
                os.seteuid(0)
    finally:
        shutil.rmtree(top)
    nvme.check_nvme_path(str(tmp_path))  # fine, and leaves nothing behind
    assert os.listdir(tmp_path) == ["file"]

    def no_direct_io(path):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)

    monkeypatch.setattr(nvme, "_open_direct", no_direct_io)
    with pytest.raises(ValueError, match="without direct I/O .O_DIRECT.*ext4 or xfs"):
        nvme.check_nvme_path(str(tmp_path))
    monkeypatch.setattr(_core, "HAVE_LIBURING", False)
    with pytest.raises(RuntimeError, match="apt-get install liburing-dev"):
        nvme.NvmeSwapper(str(tmp_path), rank=0, regions=[1])


def test_without_liburing_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(_core, "HAVE_LIBURING", False, raising=False)
    with pytest.raises(RuntimeError, match="needs horovod_zero built with liburing.*HVDZ_LIBURING_ROOT"):
        nvme.check_nvme_path("/tmp")


CHILD = textwrap.dedent("""
    import sys, torch
    from horovod_zero.torch.zero.offload import nvme
    sw = nvme.NvmeSwapper(sys.argv[1], rank=5, regions=[8192], sub_group_elems=4096, pin_memory=False)
    sw.write_region(0, "master", torch.ones(8192))
    print(sw.directory, flush=True)
    sys.stdin.readline()  # hold the lock until told, or until killed
""")


@needs_liburing
def test_crashed_jobs_directory_is_reported_and_removed_never_read(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        live = child.stdout.readline().strip()
        assert os.path.isdir(live), live
        # A live job's directory (its lock held) is left alone.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sw = nvme.NvmeSwapper(str(tmp_path), rank=5, regions=[8192], pin_memory=False)
        assert sw.removed_stale == [] and os.path.isdir(live)
        sw.close()
        child.send_signal(signal.SIGKILL)  # a crash: no cleanup runs
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert os.path.isdir(live)  # the leftovers: files of a job that is gone
    # A directory that looks like ours but holds someone else's file stays.
    foreign = tmp_path / "hvdz-otherhost-7-rank0-abc"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning) as record:
        sw = nvme.NvmeSwapper(str(tmp_path), rank=5, regions=[8192], pin_memory=False)
    messages = [str(w.message) for w in record]
    assert any(f"removed {live}" in m and "crash or a kill" in m for m in messages), messages
    assert any("holds files horovod_zero did not write; leaving it alone" in m for m in messages), messages
    assert sw.removed_stale == [live] and not os.path.exists(live)
    assert (foreign / "notes.txt").exists()
    # The new swapper starts from its own files, not the dead job's ones.
    out = torch.empty(8192)
    sw.read_region(0, "master", out)
    assert torch.equal(out, torch.zeros(8192))
    sw.close()


@needs_liburing
def test_half_made_and_half_removed_directories_are_cleaned_once_old(tmp_path):
    old_new, fresh_new, old_stale = tmp_path / ".hvdz-new-a1", tmp_path / ".hvdz-new-b2", tmp_path / ".hvdz-stale-c3"
    for d in (old_new, fresh_new, old_stale):
        d.mkdir()
        (d / "master.swp").write_bytes(b"\0" * 4096)
    for d in (old_new, old_stale):
        os.utime(d, (0, 0))  # long ago: their processes are gone
    with pytest.warns(UserWarning, match="a crash or a kill"):
        removed = nvme.remove_stale_dirs(str(tmp_path))
    assert removed == [str(old_new)]
    assert sorted(os.listdir(tmp_path)) == [".hvdz-new-b2"]  # may be a process setting up right now
