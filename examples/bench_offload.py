"""ZeRO offload benchmark on ONE GPU, side by side in one run: horovod_zero's offload (stage 2 with
the optimizer on the CPU, its CPU step overlapped with backward or serial after it; stage 3 with
parameters and optimizer on the CPU; stage 3 with the optimizer on NVMe) against DDP without
offload (the reference), DeepSpeed ZeRO-2/3 Offload and ZeRO-3 NVMe (its CPU Adam, libaio), and
FSDP2's CPUOffloadPolicy with torch's fused CPU AdamW; Llama-3.2-1B-shaped decoder, synthetic
tokens, bf16, AdamW lr 1e-4 wd 0.1. Each mode runs in a fresh subprocess, so that peak memory,
pinned host memory and DeepSpeed's global state do not leak between modes; each prints one JSON
line, and this parent prints the table: median step time, the mean over the timed steps back to
back up to the end of the last one's work (zero2-cpu-fwd's host step ends under the next forward:
the mean counts the last one; the peer ratio is of means), peak GPU memory (max_memory_allocated),
peak host RSS, disk bytes per step of the NVMe modes, and the disk floor of an NVMe step from the
O_DIRECT bandwidth of --nvme-path.

    python examples/bench_offload.py                  # ddp and the CPU-offload modes (or torchrun --nproc_per_node=1)
    python examples/bench_offload.py --modes zero3-nvme,ds3-nvme,disk-floor --nvme-path /local/dir
    python examples/bench_offload.py --layers 24      # probe a larger model by hand
    python examples/bench_offload.py --tiny           # smoke test, CPU too (offload peers skip there)
    PRESET=fast bash test/gpu/run_offload_bench.sh    # on the GPU machine, DeepSpeed included
"""

import argparse
import dataclasses
import gzip
import importlib.util
import json
import math
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from bench_timing import median_time, sync
from llama_model import LLAMA_1B, TINY, Decoder

RESULT_TAG = "BENCH_RESULT "
OURS_OPTIMIZER_BYTES = 12  # fp32 master, exp_avg, exp_avg_sq per parameter: read and written each NVMe step


@dataclasses.dataclass(frozen=True)
class Mode:
    system: str  # "ddp", "ours", "deepspeed", "fsdp2" or "disk"
    options: dict = dataclasses.field(default_factory=dict)  # our optimizer's kwargs, or DeepSpeed's zero_optimization
    nvme: bool = False


_CPU = {"device": "cpu", "pin_memory": True}
MODES = {  # in the table's order: each of ours beside its peers
    "ddp": Mode("ddp"),
    "zero2-cpu": Mode("ours", dict(stage=2, offload_optimizer="cpu", overlap_step=True)),
    # ... and the host step's end under the next forward, each module waiting for its own parameters.
    "zero2-cpu-fwd": Mode("ours", dict(stage=2, offload_optimizer="cpu", overlap_step=True, overlap_param_gather=True)),
    "zero2-cpu-serial": Mode("ours", dict(stage=2, offload_optimizer="cpu", overlap_step=False)),
    "ds2-offload": Mode("deepspeed", dict(stage=2, offload_optimizer=_CPU)),
    "zero3-cpu": Mode("ours", dict(stage=3, offload_params="cpu", offload_optimizer="cpu", overlap_step=True)),
    # ... and the host step's end under the next forward, each gather waiting for its own shards.
    "zero3-cpu-fwd": Mode("ours", dict(stage=3, offload_params="cpu", offload_optimizer="cpu", overlap_step=True,
                                       overlap_param_gather=True)),
    "ds3-offload": Mode("deepspeed", dict(stage=3, offload_param=_CPU, offload_optimizer=_CPU)),
    "fsdp2-cpu": Mode("fsdp2"),
    "zero3-nvme": Mode("ours", dict(stage=3, offload_optimizer="nvme"), nvme=True),
    "ds3-nvme": Mode("deepspeed", dict(stage=3, offload_optimizer={"device": "nvme", "pin_memory": True}), nvme=True),
    "disk-floor": Mode("disk", nvme=True),
}
# The peer each of ours is measured against: its ratio column.
PEER = {"zero2-cpu": "ds2-offload", "zero2-cpu-fwd": "ds2-offload", "zero2-cpu-serial": "ds2-offload",
        "zero3-cpu": "fsdp2-cpu", "zero3-cpu-fwd": "fsdp2-cpu", "zero3-nvme": "disk-floor"}
DEFAULT_MODES = "ddp,zero2-cpu-fwd,zero2-cpu,zero2-cpu-serial,ds2-offload,zero3-cpu-fwd,zero3-cpu,ds3-offload,fsdp2-cpu"


def mode_of(name):
    """A mode of MODES, or a variant of one: "zero2-cpu@VAR=value" runs zero2-cpu with VAR=value
    in its environment (several: "@A=1@B=2")."""
    return MODES[name.split("@")[0]]


def variant_env(name):
    pairs = name.split("@")[1:]
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise SystemExit(f"--modes {name}: write a variant as MODE@VAR=value")
    return dict(p.split("=", 1) for p in pairs)


class Skip(Exception):
    """A mode that cannot run here; its message says why."""


# ---------------------------------------------------------------- the model and its step

def model_cfg(args):
    cfg = dict(TINY if args.tiny else LLAMA_1B)
    if args.layers is not None:
        cfg["layers"] = args.layers
    if args.seq is not None:
        cfg["seq"] = args.seq
    return cfg


def count_params(cfg):
    with torch.device("meta"):
        return sum(p.numel() for p in Decoder(**cfg).parameters())  # the tied embedding once


def loss_fn(net, x, y):
    return F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())


def ddp_step(model, mode, dev, x, y, nvme_dir):
    net = torch.nn.parallel.DistributedDataParallel(model.to(dev))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.1)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = loss_fn(net, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def ours_step(model, mode, dev, x, y, nvme_dir):
    import horovod_zero.torch as hvd
    hvd.init()
    kwargs = dict(mode.options, nvme_path=nvme_dir) if mode.nvme else dict(mode.options)
    if next(model.parameters()).device != dev:
        kwargs["device"] = dev  # --init-device cpu: each parameter crosses as it is sharded
    try:
        opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1),
                                           model=model, param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                           **kwargs)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise Skip(f"the offload API is not on this branch ({e})") from e
        raise
    except (ValueError, RuntimeError) as e:
        if dev.type == "cpu":  # offload to the host from the host may be refused
            raise Skip(f"refused on CPU: {e}") from e
        raise

    step = train_step(model, opt, x, y)
    step.offload_stats = opt.offload_stats  # cumulative bytes moved by offload
    step.settle = opt.wait_for_params  # overlap_param_gather: the last step's host step ends
    return step


def deepspeed_step(model, mode, dev, x, y, nvme_dir):
    import deepspeed
    zero = dict(mode.options, overlap_comm=True, contiguous_gradients=True)
    if mode.nvme:
        zero["offload_optimizer"] = dict(zero["offload_optimizer"], nvme_path=nvme_dir)
    config = {"train_micro_batch_size_per_gpu": x.shape[0], "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "steps_per_print": 1 << 30, "zero_optimization": zero,
              # "AdamW" with the optimizer offloaded: DeepSpeedCPUAdam, its just-in-time op.
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step():
        engine.backward(loss_fn(engine, x, y))
        engine.step()
    return step


def phase(name):
    """A range in --trace's profile."""
    return torch.profiler.record_function("bench." + name)


def train_step(model, opt, x, y):
    """One training step of `model` stepped by `opt`, each phase a range in --trace's profile."""
    def step():
        with phase("forward"):
            loss = loss_fn(model, x, y)
        with phase("backward"):
            loss.backward()
        with phase("step"):
            opt.step()
            opt.zero_grad()
    return step


def fsdp2_step(model, mode, dev, x, y, nvme_dir):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    offload = CPUOffloadPolicy(pin_memory=True)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)  # on the CPU shards

    return train_step(model, opt, x, y)


STEPS = {"ddp": ddp_step, "ours": ours_step, "deepspeed": deepspeed_step, "fsdp2": fsdp2_step}


def check_runnable(mode, dev):
    if mode.system == "deepspeed":
        if dev.type != "cuda":
            raise Skip("DeepSpeed offload needs CUDA")
        if importlib.util.find_spec("deepspeed") is None:
            raise Skip("deepspeed is not importable: source test/gpu/deepspeed_env.sh "
                       "(after test/gpu/deepspeed_deps.sh), or pip install deepspeed")
    if mode.system == "fsdp2" and dev.type != "cuda":
        raise Skip("FSDP2's CPUOffloadPolicy needs CUDA")
    if mode.system == "ours" and importlib.util.find_spec("horovod_zero") is None:
        raise Skip("horovod_zero is not importable: bash examples/setup.sh, and the repository on PYTHONPATH")


# ---------------------------------------------------------------- what a child measures

def proc_io():
    """This process's bytes to and from the block layer (O_DIRECT included; page-cache hits not)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


def offload_stats(step):
    stats = getattr(step, "offload_stats", None)
    return dict(stats()) if stats is not None else None


def rss_peak_gib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def pinned_peak_gib():
    """Peak of torch's caching host allocator (pin_memory(), pinned empty()); memory pinned
    by other means (cudaHostRegister) is not in it."""
    try:
        return torch.cuda.host_memory_stats()["allocated_bytes.peak"] / 2**30
    except (AttributeError, KeyError, RuntimeError):
        return None


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def per_step(after, before, steps):
    if after is None or before is None:
        return None
    return {k: (after[k] - before[k]) / steps for k in after if isinstance(after[k], (int, float)) and k in before}


def measure(name, mode, args, dev, nvme_dir):
    check_runnable(mode, dev)
    cfg = model_cfg(args)
    if mode.system in ("ddp", "deepspeed", "fsdp2"):
        import torch.distributed as dist
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    torch.manual_seed(0)
    model = Decoder(**cfg).to(dev if args.init_device == "gpu" else "cpu")
    ids = torch.randint(0, cfg["vocab"], (args.micro_batch, cfg["seq"] + 1),
                        generator=torch.Generator().manual_seed(0)).to(dev)
    step = STEPS[mode.system](model, mode, dev, ids[:, :-1], ids[:, 1:], nvme_dir)
    steps, warmup = steps_of(name, args)
    # The training peak: construction's transient fp32 copies are not counted; lazy allocations are.
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    if hasattr(step, "settle"):
        step.settle()  # the timed window starts with no host step of a warm-up step left
    sync()
    ours = mode.system == "ours"
    io0, off0 = proc_io(), offload_stats(step) if ours else None
    t0 = time.perf_counter()
    t = median_time(step, steps, warmup=0)
    if hasattr(step, "settle"):
        step.settle()
        sync()
    window = time.perf_counter() - t0  # back to back, to the end of the last step's work
    io1, off1 = proc_io(), offload_stats(step) if ours else None
    if args.trace:
        trace_step(step, os.path.join(args.trace, "".join(c if c.isalnum() or c in "-_" else "_" for c in name)))
    return {"step_s": t, "mean_step_s": window / steps, "tokens_per_s": args.micro_batch * cfg["seq"] / t,
            "steps": steps, "warmup": warmup,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
            "rss_peak_gib": rss_peak_gib(), "pinned_peak_gib": pinned_peak_gib() if dev.type == "cuda" else None,
            "proc_io_per_step": per_step(io1, io0, steps), "offload_per_step": per_step(off1, off0, steps),
            "nvme_file_bytes": dir_bytes(nvme_dir) if mode.nvme else None, "threads": torch.get_num_threads()}


def trace_step(step, path):
    """Profiles two more steps; keeps of their trace what shows where the time goes: the GPU's
    kernels and copies, and the CPU ranges of the bench's phases and of horovod_zero."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):  # the second step's forward shows what waits for the first's host step
            step()
        if hasattr(step, "settle"):
            step.settle()
        sync()
    raw = path + ".raw.json"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    os.remove(raw)
    keep = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and (
        e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        or str(e.get("name", "")).startswith(("bench.", "hvd_zero.", "cudaStreamSynchronize", "cudaEventSynchronize")))]
    with gzip.open(path + ".trace.json.gz", "wt") as f:
        json.dump([{k: e[k] for k in ("name", "cat", "ts", "dur", "tid", "pid") if k in e} for e in keep], f)


def steps_of(name, args):
    nvme = mode_of(name).nvme
    return (args.steps if args.steps is not None else 3 if nvme else 5,
            args.warmup if args.warmup is not None else 1 if nvme else 2)


# ---------------------------------------------------------------- the disk floor

def _stream(path, nbytes, write, block):
    """One stream of O_DIRECT block-sized pwrites or preads; mmap gives the page-aligned buffer O_DIRECT needs."""
    buf = mmap.mmap(-1, block)
    if write:
        buf.write(os.urandom(block))  # incompressible
    fd = os.open(path, (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY) | os.O_DIRECT, 0o600)
    try:
        for off in range(0, nbytes, block):
            n = os.pwrite(fd, buf, off) if write else os.preadv(fd, [buf], off)
            if n != block:
                raise OSError(f"short {'write' if write else 'read'}: {n} of {block} bytes at {off} of {path}")
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def disk_bandwidth(directory, total, streams, block=1 << 20):
    """O_DIRECT write then read bandwidth (bytes/s) of `total` bytes over `streams` threads, a file each."""
    each = total // streams // block * block
    paths = [os.path.join(directory, f"floor_{streams}_{i}") for i in range(streams)]
    out = {}
    try:
        for write in (True, False):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(streams) as pool:
                list(pool.map(lambda p: _stream(p, each, write, block), paths))
            out["write" if write else "read"] = each * streams / (time.perf_counter() - t0)
    finally:
        for p in paths:
            if os.path.exists(p):
                os.remove(p)
    return out


def disk_floor(args, directory):
    try:
        bw = {s: disk_bandwidth(directory, args.disk_bytes, s) for s in (1, 4)}
    except OSError as e:
        raise Skip(f"O_DIRECT I/O failed in {directory} ({e}); give --nvme-path on a disk file system") from e
    n = count_params(model_cfg(args))
    read, write = max(b["read"] for b in bw.values()), max(b["write"] for b in bw.values())
    nbytes = OURS_OPTIMIZER_BYTES * n
    return {"bandwidth": {str(s): b for s, b in bw.items()}, "params": n,
            "step_s": nbytes / read + nbytes / write,  # serial: the floor the table's ratio uses
            "step_overlapped_s": max(nbytes / read, nbytes / write)}


# ---------------------------------------------------------------- the child: one mode

def child(name, args):
    mode = mode_of(name)
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    nvme_dir = args.mode_dir
    try:
        res = disk_floor(args, nvme_dir) if mode.system == "disk" else measure(name, mode, args, dev, nvme_dir)
        res["status"] = "ok"
    except Skip as e:
        res = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # the parent reports it; the traceback goes to the log
        traceback.print_exc()
        res = {"status": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    res["mode"] = name
    print(RESULT_TAG + json.dumps(res), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no teardown: a library's exit handlers (aio threads, process groups) must not hang the run


# ---------------------------------------------------------------- the parent: every mode, then the table

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env():
    """A world of one for the child, with its own rendezvous port: under torchrun, the agent's
    store would otherwise see every child's keys."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0", GROUP_WORLD_SIZE="1",
               ROLE_RANK="0", ROLE_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONUNBUFFERED="1")
    return env


def parse_timeouts(text):
    """"300" (every mode) or "300,ds3-nvme=330": seconds per mode."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, sec = item.rpartition("=")
        if name and name.split("@")[0] not in MODES:
            raise SystemExit(f"--timeout: unknown mode {name!r}; modes: {', '.join(MODES)}")
        out[name or "*"] = float(sec)
    return out


def run_child(name, args, argv, timeout):
    mode_dir = None
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", name]
    if mode_of(name).nvme:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        mode_dir = os.path.join(args.nvme_path, f"bench_offload_{safe}_{os.getpid()}")
        os.makedirs(mode_dir)
        cmd += ["--mode-dir", mode_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(child_env(), **variant_env(name)),
                            start_new_session=True)  # its own group: a timeout kills its compilers too
    found = []

    def pump():
        for line in proc.stdout:
            if line.startswith(RESULT_TAG):
                found.append(json.loads(line[len(RESULT_TAG):]))
            else:
                print(f"  [{name}] {line}", end="", flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(10)
    if mode_dir:
        shutil.rmtree(mode_dir, ignore_errors=True)
    if found:
        return found[-1]
    if proc.returncode == -signal.SIGKILL:
        return {"mode": name, "status": "timeout", "reason": f"killed after {timeout:.0f} s"}
    return {"mode": name, "status": "failed", "reason": f"exit status {proc.returncode}, no result (see its log)"}


def nvme_refusal(args, params):
    if not args.nvme_path:
        return "needs --nvme-path (a directory on a local disk)"
    os.makedirs(args.nvme_path, exist_ok=True)
    free = shutil.disk_usage(args.nvme_path).free
    need = max(16 * params * 1.1, args.disk_bytes * 1.1)  # DeepSpeed's swap files: 16 bytes per parameter
    if free < need:
        return f"{args.nvme_path} has {free / 2**30:.1f} GiB free, needs {need / 2**30:.1f} GiB"
    return None


def fmt(v, scale=1.0, spec=".2f"):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v * scale, spec)


def disk_cell(r):
    """Disk GB read/written per step: our own count where we have it, else /proc/self/io."""
    off, io = r.get("offload_per_step"), r.get("proc_io_per_step")
    if off and "disk_read_bytes" in off:
        return f"{off['disk_read_bytes'] / 1e9:.1f}/{off.get('disk_write_bytes', float('nan')) / 1e9:.1f}"
    if io and mode_of(r["mode"]).nvme:
        return f"{io['read'] / 1e9:.1f}/{io['write'] / 1e9:.1f}"
    return ""


def table(results):
    by = {r["mode"]: r for r in results}
    ref = by.get("ddp", {}).get("step_s")
    rows = ["| mode | step (ms) | mean (ms) | tokens/s | GPU peak (GiB) | host RSS peak (GiB) | torch pinned peak (GiB) "
            "| disk R/W per step (GB) | vs peer | vs ddp |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = r["mode"]
        if r["status"] != "ok":
            rows.append(f"| {name} | {r['status']}: {r.get('reason', '')} | | | | | | | | |")
            continue
        t, peer = r["step_s"], PEER.get(name.split("@")[0])
        mean = r.get("mean_step_s", t)
        peer_r = by.get(peer, {}) if peer else {}
        peer_t = peer_r.get("mean_step_s", peer_r.get("step_s"))
        vs_peer = f"{mean / peer_t:.2f}x {peer}" if peer_t else (f"n/a ({peer}: {peer_r.get('status', 'not run')})" if peer else "")
        if name == "disk-floor":
            rows.append(f"| disk-floor (ours' NVMe floor) | {t * 1e3:.0f} | | | | | | "
                        f"{OURS_OPTIMIZER_BYTES * r['params'] / 1e9:.1f}/{OURS_OPTIMIZER_BYTES * r['params'] / 1e9:.1f} | | |")
            continue
        rows.append(f"| {name} | {t * 1e3:.1f} | {mean * 1e3:.1f} | {r['tokens_per_s']:.0f} | {fmt(r['peak_gib'])} | "
                    f"{fmt(r['rss_peak_gib'])} | {fmt(r['pinned_peak_gib'])} | {disk_cell(r)} | {vs_peer} | "
                    f"{fmt(t / ref if ref else None)} |")
    return rows


def details(results):
    """Per-step transfer counts, and for the NVMe modes every disk count side by side (a cross-check)."""
    out = []
    for r in results:
        if r["status"] != "ok":
            continue
        if r["mode"] == "disk-floor":
            bw = r["bandwidth"]
            out.append("disk floor: O_DIRECT 1 MiB, " + "; ".join(
                f"{s} stream{'s' if s != '1' else ''} write {b['write'] / 1e9:.2f} GB/s read {b['read'] / 1e9:.2f} GB/s"
                for s, b in bw.items()) + f"; ours ({OURS_OPTIMIZER_BYTES} B/param read + {OURS_OPTIMIZER_BYTES} written, "
                f"{r['params'] / 1e6:.1f}M params): {r['step_s']:.2f} s/step serial, "
                f"{r['step_overlapped_s']:.2f} s with read and write overlapped")
            continue
        parts = []
        off = r.get("offload_per_step")
        if off is not None:
            parts.append("offload_stats per step: " + ", ".join(
                f"{k} {v / 1e9:.2f} GB" if k.endswith("_bytes") else f"{k} {v:g}" for k, v in sorted(off.items())))
        elif mode_of(r["mode"]).system == "ours":
            parts.append("offload_stats n/a")
        if mode_of(r["mode"]).nvme:
            io = r["proc_io_per_step"]
            parts.append(f"/proc/self/io per step: read {io['read'] / 1e9:.2f} GB, write {io['write'] / 1e9:.2f} GB")
            parts.append(f"files at the end {r['nvme_file_bytes'] / 1e9:.2f} GB")
        parts.append(f"{r['steps']} steps after {r['warmup']} warm-up, {r['threads']} CPU threads")
        out.append(f"{r['mode']}: " + "; ".join(parts))
    return out


def settings(args, cfg, params):
    """The run's header line, and the part of it a merged row must share to be compared."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (cpu)"
    ds_version = "not importable"
    if importlib.util.find_spec("deepspeed") is not None:
        from importlib.metadata import PackageNotFoundError, version
        try:
            ds_version = version("deepspeed")
        except PackageNotFoundError:
            ds_version = "importable"
    setup = (f"{gpu}, {'tiny' if args.tiny else 'Llama-3.2-1B-shaped'} model, {cfg['layers']} layers, "
             f"{params / 1e6:.1f}M params, micro-batch {args.micro_batch}, seq {cfg['seq']}")
    head = (f"== bench_offload: 1 GPU, {setup}, bf16, AdamW lr 1e-4 wd 0.1; {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, deepspeed {ds_version}; nvme path {args.nvme_path or 'none'}")
    return head, setup


def read_results(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_modes(names, args, argv, params, setup):
    timeouts = parse_timeouts(args.timeout)
    refusal = nvme_refusal(args, params) if any(mode_of(m).nvme for m in names) else None
    deadline = time.monotonic() + args.budget if args.budget else math.inf
    results = []
    for name in names:
        left = deadline - time.monotonic()
        if mode_of(name).nvme and refusal:
            res = {"mode": name, "status": "skipped", "reason": refusal}
        elif left < 30:
            res = {"mode": name, "status": "skipped", "reason": "no time left in --budget"}
        else:
            t0 = time.monotonic()
            res = run_child(name, args, argv, min(timeouts.get(name, timeouts.get("*", 300.0)), left - 10))
            res["wall_s"] = time.monotonic() - t0
        res["setup"] = setup
        print(f"  [{name}] {res['status']}{': ' + res['reason'] if res.get('reason') else ''}", flush=True)
        results.append(res)
    return results


def parent(args, argv):
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("bench_offload runs on one GPU in one process: torchrun --nproc_per_node=1, or plain python")
    names = [m for m in args.modes.split(",") if m]
    unknown = [m for m in names if m.split("@")[0] not in MODES]
    for m in names:
        variant_env(m)
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}; modes: {', '.join(MODES)}")
    if any(mode_of(m).nvme for m in names) and "disk-floor" not in names and not args.no_disk_floor:
        names.append("disk-floor")  # an NVMe mode's ratio is to the floor
    cfg = model_cfg(args)
    params = count_params(cfg)
    head, setup = settings(args, cfg, params)
    if not names:  # only --merge: the rows' own setups say what ran
        head = f"== bench_offload: the runs in {', '.join(args.merge)}"
    print(head, flush=True)
    merged = {}  # a mode run again replaces its earlier row
    for r in [r for path in args.merge for r in read_results(path)] + run_modes(names, args, argv, params, setup):
        merged[r["mode"]] = r
    results = sorted(merged.values(), key=lambda r: list(MODES).index(r["mode"].split("@")[0]))
    setups = sorted({r["setup"] for r in results if "setup" in r})
    lines = [head, *table(results), *details(results)]
    if len(setups) > 1 or not names:
        lines += ["setups of the rows:" if len(setups) == 1 else "note: the rows come from runs of different setups:",
                  *setups]
    print("\n" + "\n".join(lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in results))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help=f"comma-separated, of: {', '.join(MODES)}; MODE@VAR=value runs MODE with VAR=value set")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny 64)")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default 16): to shrink or grow the model")
    ap.add_argument("--init-device", choices=("gpu", "cpu"), default="gpu",
                    help="where the fp32 model is built before the mode wraps it: cpu for models whose fp32 "
                         "copy does not fit on the GPU (its host memory then counts in the RSS peak; ours wraps "
                         "it with device=)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a smoke test that runs on CPU too")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; NVMe modes 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; NVMe modes 1)")
    ap.add_argument("--nvme-path", default=None, help="a directory on the disk the NVMe modes swap to")
    ap.add_argument("--disk-bytes", type=int, default=2 << 30, help="bytes each way of the disk floor measurement")
    ap.add_argument("--no-disk-floor", action="store_true", help="do not add disk-floor to NVMe modes")
    ap.add_argument("--timeout", default="300", help='seconds per mode: "300", or "300,ds3-nvme=330"')
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run: later modes get what is left")
    ap.add_argument("--json", default=None, help="also write the modes' JSON lines here")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="profile two more steps of each mode; DIR/<mode>.trace.json.gz keeps its kernels, copies "
                         "and phase ranges")
    ap.add_argument("--merge", nargs="*", default=[], metavar="JSONL",
                    help="earlier runs' --json files, shown in the table first (with --modes '': only them)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args)
    else:
        parent(args, sys.argv[1:])


if __name__ == "__main__":
    main()
