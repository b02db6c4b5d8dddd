"""Checkpoint benchmark, side by side in one run on the Llama-3.2-1B-shaped decoder after
one training step (so the optimizer holds its state): horovod_zero stage 3's sharded
DCP save and load, its asynchronous save (the time the step waits, then the whole),
its consolidated save and load through rank 0, and FSDP2's dcp.save / dcp.load of
get_state_dict. Each line: wall time (slowest rank), the bytes on disk, and the host
memory the call added at its peak (sampled RSS, largest over ranks).

    torchrun --nproc_per_node=2 examples/bench_checkpoint.py --dir /tmp/ckpt
    torchrun --nproc_per_node=2 examples/bench_checkpoint.py --tiny --dir /tmp/ckpt   # CPU smoke test
"""

import argparse
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import horovod_zero.torch as hvd
from bench_timing import sync
from llama_model import LLAMA_1B, TINY, Decoder


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """Peak resident memory above the level at entry, sampled every 5 ms."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.added = max(self.peak, _rss()) - self.base


def timed(fn):
    """(seconds on the slowest rank, GiB of host memory added at the peak, largest over ranks)."""
    sync()
    hvd.allreduce(torch.zeros(1), name="bench.ckpt.barrier")
    with RssPeak() as rss:
        t0 = time.perf_counter()
        fn()
        sync()
        t = time.perf_counter() - t0
    out = hvd.allreduce(torch.tensor([t, rss.added / 2**30]), op=hvd.Max, name="bench.ckpt.max")
    return out[0].item(), out[1].item()


def disk_gib(path):
    """The checkpoint's size (rank 0, which prints it; the others may have moved on)."""
    if hvd.rank() != 0:
        return 0.0
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**30
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**30


def clear(path):
    hvd.allreduce(torch.zeros(1), name="bench.ckpt.measured")
    if hvd.rank() == 0:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else (os.path.exists(path) and os.remove(path))
    hvd.allreduce(torch.zeros(1), name="bench.ckpt.cleared")


def one_step(model, opt, cfg, dev):
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()


def ours(cfg, dev, where, lines):
    torch.manual_seed(0)
    model = Decoder(**cfg).to(dev)
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, stage=3,
                                       param_dtype=torch.bfloat16 if dev.type == "cuda" else None)
    one_step(model, opt, cfg, dev)
    path = os.path.join(where, "ours_dcp")
    t, mem = timed(lambda: hvd.zero.save_checkpoint(path, model, opt))
    lines.append(("horovod_zero stage 3, DCP save", t, disk_gib(path), mem))
    t, mem = timed(lambda: hvd.zero.load_checkpoint(path, model, opt))
    lines.append(("horovod_zero stage 3, DCP load", t, disk_gib(path), mem))
    clear(path)
    handle = []
    t, mem = timed(lambda: handle.append(hvd.zero.async_save_checkpoint(path, model, opt)))
    t_wait, _ = timed(handle[0].wait)
    lines.append(("horovod_zero stage 3, async DCP save: step blocked", t, disk_gib(path), mem))
    lines.append(("horovod_zero stage 3, async DCP save: until written", t + t_wait, disk_gib(path), mem))
    clear(path)
    path = os.path.join(where, "ours_consolidated.pt")
    t, mem = timed(lambda: hvd.zero.save_checkpoint(path, model, opt, format="consolidated"))
    lines.append(("horovod_zero stage 3, consolidated save (rank 0)", t, disk_gib(path), mem))
    t, mem = timed(lambda: hvd.zero.load_checkpoint(path, model, opt))
    lines.append(("horovod_zero stage 3, consolidated load (rank 0)", t, disk_gib(path), mem))
    clear(path)


def fsdp2(cfg, dev, where, lines):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = Decoder(**cfg).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dev.type == "cuda" else None)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    one_step(model, opt, cfg, dev)
    path = os.path.join(where, "fsdp2_dcp")

    def save():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def load():
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    t, mem = timed(save)
    lines.append(("FSDP2, dcp.save of get_state_dict", t, disk_gib(path), mem))
    t, mem = timed(load)
    lines.append(("FSDP2, dcp.load + set_state_dict", t, disk_gib(path), mem))
    clear(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dir", default="/tmp/hvdz_ckpt_bench", help="where the checkpoints go (deleted after)")
    ap.add_argument("--modes", default="ours,fsdp2")
    args = ap.parse_args()
    hvd.init()
    dev = hvd.device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    if hvd.rank() == 0:
        os.makedirs(args.dir, exist_ok=True)
    cfg = TINY if args.tiny else LLAMA_1B
    lines = []
    for mode in args.modes.split(","):
        {"ours": ours, "fsdp2": fsdp2}[mode](cfg, dev, args.dir, lines)
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if hvd.rank() == 0:
        print(f"== bench_checkpoint: {hvd.size()} ranks, "
              f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
              f"{'tiny' if args.tiny else 'Llama-3.2-1B-shaped'} model after one AdamW step, files in {args.dir}")
        for name, t, gib, mem in lines:
            print(f"{name:55s} {t:8.2f} s  {gib:7.2f} GiB on disk  host +{mem:6.2f} GiB")
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
