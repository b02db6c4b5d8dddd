"""O_DIRECT write and read bandwidth of a directory through horovod_zero's AioFile
(io_uring), with 1, 4 and 8 requests in flight: the disk floor of NVMe offload,
whose step reads and writes its state once each.

    python examples/bench_disk.py /mnt/nvme [--size-gib 4] [--depths 1,4,8] [--request-mib 1]

Writes one file of --size-gib in the directory, times writing it (and fsync), then
reading it back, for each queue depth; removes the file. Prints GB/s (1e9 bytes/s).
measure() is for other benchmarks to call.
"""

import argparse
import os
import time

from horovod_zero import _core
from horovod_zero.torch.zero.offload.nvme import _aligned_empty, check_nvme_path

_BUFFER_BYTES = 64 << 20  # one buffer, written from (read into) over and over
_TRANSFERS_AHEAD = 4  # transfers of _BUFFER_BYTES given to the file at once


def _stream(f, buf, total, write):
    """Moves `total` bytes between `buf` and the file, keeping _TRANSFERS_AHEAD
    buffer-sized transfers queued (their contents do not matter here)."""
    step = buf.numel() * 4
    tickets = []
    for offset in range(0, total, step):
        n = min(step, total - offset) // 4
        tickets.append(f.write_async(buf[:n], offset) if write else f.read_async(buf[:n], offset))
        if len(tickets) == _TRANSFERS_AHEAD:
            f.wait(tickets.pop(0))
    for t in tickets:
        f.wait(t)


def measure(directory, size_bytes, queue_depth, request_bytes=1 << 20):
    """(write GB/s, read GB/s) of `size_bytes` through one file with `queue_depth`
    requests of `request_bytes` in flight. The write time includes an fsync."""
    path = os.path.join(directory, f".hvdz-bench-disk-{os.getpid()}.swp")
    f = _core.AioFile(path, size_bytes, queue_depth, request_bytes)
    try:
        size = size_bytes // f.alignment * f.alignment
        buf = _aligned_empty(min(_BUFFER_BYTES, size) // 4, f.alignment, pin=False)
        buf.fill_(1.0)
        _stream(f, buf, min(size, 64 << 20), write=True)  # warm up: allocate extents, start the ring
        t0 = time.perf_counter()
        _stream(f, buf, size, write=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t1 = time.perf_counter()
        _stream(f, buf, size, write=False)
        t2 = time.perf_counter()
        return size / (t1 - t0) / 1e9, size / (t2 - t1) / 1e9
    finally:
        f.close()
        os.unlink(path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--depths", default="1,4,8", help="queue depths, comma-separated")
    p.add_argument("--request-mib", type=float, default=1.0)
    a = p.parse_args()
    check_nvme_path(a.directory)
    size = int(a.size_gib * (1 << 30))
    req = int(a.request_mib * (1 << 20))
    print(f"O_DIRECT through io_uring, {a.directory}: {size / 2**30:.2f} GiB, {req >> 10} KiB requests")
    for d in (int(x) for x in a.depths.split(",")):
        w, r = measure(a.directory, size, d, req)
        print(f"queue depth {d:2d}: write {w:6.2f} GB/s   read {r:6.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
