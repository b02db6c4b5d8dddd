"""ZeRO benchmark, side by side in one run: horovod_zero stages 1, 2 and 3 against DDP
(bf16 autocast), FSDP2 (fully_shard per block, MixedPrecisionPolicy(bf16, --reduce-dtype);
reshard_after_forward=False as ZeRO-2's peer, True as ZeRO-3's) and DeepSpeed ZeRO-3 (bf16,
communication_data_type --reduce-dtype) on a Llama-3.2-1B-shaped decoder with synthetic
tokens; then coalescing and downcast fusion. Median step time, tokens/s per GPU, peak
max_memory_allocated over ranks. Gradients are reduced in bf16 by every system unless
--reduce-dtype fp32 (horovod_zero reduces in param_dtype, bf16, either way).

    torchrun --nproc_per_node=8 examples/bench_zero.py --micro-batch 4
    torchrun --nproc_per_node=8 examples/bench_zero.py --modes fsdp2+reshard,zero3,deepspeed3 --extras ""
    torchrun --nproc_per_node=2 examples/bench_zero.py --tiny     # smoke test, CPU too (no DeepSpeed)
    torchrun --nproc_per_node=2 examples/bench_zero.py --micro-batch 1 --breakdown --modes fsdp2+reshard,zero3
    torchrun --nproc_per_node=4 examples/bench_zero.py --model 8b --micro-batch 1 --adam fused --modes fsdp2+reshard,zero3
    torchrun --nproc_per_node=4 examples/bench_zero.py --sim-nodes 2 --modes zero3,zero3+hybrid,fsdp2+reshard,fsdp2+hsdp

A mode may carry environment settings for its optimizer and the runtime:
zero3@HOROVOD_ZERO_PREFETCH=2 (a value may hold commas: zero2@HOROVOD_THREAD_AFFINITY=8-11,24-27).
Each horovod_zero mode starts a fresh runtime (hvd.shutdown() and hvd.init()), as a job of its
own would, unless HOROVOD_AUTOTUNE=1.
zero2+ostep and zero3+ostep pass overlap_step=True: each shard is stepped during backward.
With HOROVOD_AUTOTUNE=1 the first horovod_zero mode first trains, untimed, until the
autotuner has kept its best setting (at most --tune-max-steps steps), and its line says
what was kept; that mode and the later ones are timed with it.
--compile compiles each block (block.compile(), before wrapping) and --ac recomputes each
block's activations in backward (torch.utils.checkpoint, non-reentrant), for every mode; a
mode's own +compile or +ac does the same for that mode alone (zero3+compile+ac). DeepSpeed
ZeRO-3 always runs its blocks eager: compiled blocks are not supported under its ZeRO-3 on
this torch, and its line says so.
--sim-nodes N splits the ranks into N simulated nodes (each sees only its own GPUs, as on
real nodes) for hybrid sharding: zero2+hybrid and zero3+hybrid (shard_group="node") and
FSDP2's HSDP (fsdp2+hsdp: a (nodes, local) mesh, reshard_after_forward=True). Their lines give
the bytes each step sent in the node sets, the cross-node sets and the global set.
--adam picks AdamW's kernel for every system alike: foreach or fused; by default each
system keeps its own (torch's is foreach on CUDA, horovod_zero's is fused: HOROVOD_ZERO_FUSED_STEP).
--breakdown first measures the compute floor (forward and backward of the same model in bf16
on each GPU alone: no communication, no optimizer step), then profiles three more steps of
each mode and splits their wall time into the floor's GPU time, compute above it, the
optimizer step, exposed communication and GPU idle time (the host on the critical path;
the profiler inflates it) (examples/step_breakdown.py); averages over ranks. --jsonl
appends every line as a row of docs/benchmarks/results.jsonl's form (commit from
$HVDZ_COMMIT).
--profile-back-to-back profiles those three steps without a synchronization between them, as
training runs them: what a step leaves queued (overlap_param_gather's gathers) then runs
under the next forward, as in the back-to-back time.
"""

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import os
import re
import shlex
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import horovod_zero.torch as hvd
from horovod_zero.settings import VARIABLES
from bench_timing import back_to_back_time, median_time, run_until_tuned, sync, tuned_text
from llama_model import LLAMA_1B, LLAMA_3B, LLAMA_8B, TINY, Decoder
from step_breakdown import OPTIMIZER_MARK, busy, profile_parts

MODELS = {"tiny": (TINY, "tiny"), "1b": (LLAMA_1B, "Llama-3.2-1B-shaped"),
          "3b": (LLAMA_3B, "Llama-3.2-3B-shaped"), "8b": (LLAMA_8B, "Llama-3.1-8B-shaped")}
ADAM_KERNELS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def max_gib(nbytes, name):
    """nbytes in GiB, the largest over ranks."""
    return hvd.allreduce(torch.tensor([nbytes / 2**30]), op=hvd.Max, name=name).item()


def peak_gib(outside=0):
    """`outside`: bytes held outside torch's allocator (HOROVOD_ZERO_CE_ALLGATHER_BYTES's window)."""
    if not torch.cuda.is_available():
        return float("nan")
    return max_gib(torch.cuda.max_memory_allocated() + outside, "bench.peak")


def release_memory():
    """Frees what the previous mode left (FSDP modules hold reference cycles), so
    each mode's peak counts only its own tensors."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_steps(step_fn, steps, warmup=3):
    """(median synchronized step, mean back-to-back step) in s: bench_timing says how they differ."""
    return median_time(step_fn, steps, warmup), back_to_back_time(step_fn, steps)


def build(cfg, dev, compiled=False, ac=False):
    """The model, initialized on the device (an 8B model's fp32 init on the host takes
    minutes), its blocks compiled and recomputed as asked."""
    torch.manual_seed(0)
    with torch.device(dev):
        model = Decoder(**cfg)
    model.ac = ac
    if compiled:
        for b in model.blocks:
            b.compile()
    return model


def profile_steps(step_fn, path, steps=3):
    """CUDA kernel time of a few steps by kernel, to show where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_fn()
        sync()
    if path is None:
        return
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        f.write("\n\nBy host time (where the Python side waits):\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))


def phase_peaks(forward, backward, update):
    """Peak memory (GiB, max over ranks) of one more step's forward, backward and update,
    and what each leaves allocated: where a mode's peak is, and what it holds there."""
    if not torch.cuda.is_available():
        return None
    out = []
    for phase in ("forward", "backward", "update"):
        sync()
        torch.cuda.reset_peak_memory_stats()
        if phase == "forward":
            loss = forward()
        elif phase == "backward":
            backward(loss)
            del loss
        else:
            update()
        sync()
        out.append((phase, peak_gib(), max_gib(torch.cuda.memory_allocated(), "bench.held")))
    return out


def fsdp2(model, reshard, reduce_dtype, adam, hsdp=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    mesh = None
    if hsdp:  # replicate across nodes, shard inside each
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (hvd.size() // hvd.local_size(), hvd.local_size()),
                                mesh_dim_names=("replicate", "shard"))
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard, mp_policy=mp, mesh=mesh)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=mp, mesh=mesh)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **adam)


def mean_over_ranks(values):
    keys = sorted(values)
    got = hvd.allreduce(torch.tensor([values[k] for k in keys], dtype=torch.float64), op=hvd.Average,
                        name="bench.mean")
    return dict(zip(keys, got.tolist()))


def trace_file(trace_dir, name):
    """Where this rank keeps its profiler trace of `name`, or None. trace_dir is a
    (folder, every rank) pair: rank 0 alone unless every rank was asked for."""
    folder, every = trace_dir or ("", False)
    if not folder or (hvd.rank() != 0 and not every):
        return None
    return os.path.join(folder, f"trace_{name}{f'.rank{hvd.rank()}' if every else ''}.json.gz")


def bench_floor(cfg, micro, steps, dev, compiled, ac, trace_dir=None):
    """The compute floor: forward and backward of the same model with bf16 parameters, on
    each GPU alone (no communication, no optimizer step). (median step s, back-to-back step s, peak GiB, GPU busy s)."""
    release_memory()
    torch._dynamo.reset()
    model = build(cfg, dev, compiled, ac).to(torch.bfloat16)
    x, y = batch(cfg, micro, dev)

    def step():
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
        for p in model.parameters():
            p.grad = None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t, tb = run_steps(step, steps)
    peak = peak_gib()
    keep = trace_file(trace_dir, "floor")
    parts = mean_over_ranks(profile_parts(step, 3, sync, keep))
    return t, tb, peak, busy(parts)


def batch(cfg, micro, dev):
    g = torch.Generator(device="cpu").manual_seed(hvd.rank())
    ids = torch.randint(0, cfg["vocab"], (micro, cfg["seq"] + 1), generator=g).to(dev)
    return ids[:, :-1], ids[:, 1:]


def deepspeed3(model, micro, reduce_dtype, adam):
    """DeepSpeed ZeRO-3 with torch's AdamW (no extension build; the kernel as --adam says),
    bf16 parameters and the gradient reduction in reduce_dtype."""
    import deepspeed  # pip install deepspeed
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True},
              "communication_data_type": "bf16" if reduce_dtype == torch.bfloat16 else "fp32",
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True, **adam}},
              "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


@contextlib.contextmanager
def mode_env(mode):
    """The settings a mode carries after '@' (zero3@HOROVOD_ZERO_PREFETCH=2@...), set while
    it runs: the optimizer's, and the runtime's, which fresh_runtime() reads."""
    pairs = [kv.split("=", 1) for kv in mode.split("@")[1:]]
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield mode.split("@")[0]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fresh_runtime():
    """Restarts horovod_zero's runtime on every rank, so that a mode starts as a job of its
    own would: with its own core settings (the mode's @HOROVOD_* ones are read now), and
    with nothing an earlier mode left in the runtime (its response cache, communicators,
    copy-engine window). Not with HOROVOD_AUTOTUNE=1, where the settings the tuner kept
    would be lost: then a mode's @HOROVOD_* core settings are not read, only its
    optimizer's."""
    hvd.shutdown()
    hvd.init()


def bytes_by_set(stats, opt, steps):
    """MiB per step that horovod_zero's collectives carried (each rank's payload), by kind
    of process set: hybrid's node sets stay inside a node, its cross sets cross nodes, and
    the global set spans every rank."""
    groups = getattr(getattr(opt, "_storage", None), "groups", None)
    node = getattr(getattr(groups, "shard_set", None), "process_set_id", None)
    cross = getattr(getattr(groups, "cross_set", None), "process_set_id", None)
    split = {"node": 0, "cross": 0, "global": 0}
    for s in stats:
        # one rank per node: the cross set is the global set, and what it carries crosses nodes
        kind = "node" if s["process_set"] == node and cross is not None else \
            "cross" if s["process_set"] == cross else "global"
        split[kind] += s["bytes"]
    return {k: v / steps / 2**20 for k, v in split.items()}


def split_modes(text):
    """--modes, split at its commas; a piece that starts with a digit continues the previous
    mode's setting (zero2@HOROVOD_THREAD_AFFINITY=8-11,24-27): a mode's name starts with a letter."""
    modes = []
    for piece in text.split(","):
        if modes and piece[:1].isdigit():
            modes[-1] += "," + piece
        else:
            modes.append(piece)
    return modes


def model_flags(mode, compile_all=False, ac_all=False):
    """The mode without its +compile and +ac, and whether its blocks are compiled and
    recomputed (DeepSpeed's are never compiled)."""
    parts = mode.split("+")
    base = "+".join(p for p in parts if p not in ("compile", "ac"))
    compiled = (compile_all or "compile" in parts) and base != "deepspeed3"
    return base, compiled, ac_all or "ac" in parts


def bench_mode(mode, cfg, micro, steps, dev, profile_dir=None, profile_modes=(), phases=False,
               reduce_dtype=torch.bfloat16, compiled=False, ac=False, adam=None, breakdown=False, trace_dir=None,
               tune_max_steps=0, label=None):
    """`label`: what names the mode's trace and profile files (the mode itself by default)."""
    with mode_env(mode) as base:
        if base.startswith("zero") and hvd.runtime_info()["autotune"] is None:
            fresh_runtime()
        return _bench_mode(base, cfg, micro, steps, dev, profile_dir, profile_modes, phases, reduce_dtype,
                           compiled, ac, adam or {}, breakdown, trace_dir, tune_max_steps,
                           re.sub(r"[^\w.@=-]", "_", label or mode))


def _bench_mode(mode, cfg, micro, steps, dev, profile_dir, profile_modes, phases, reduce_dtype, compiled, ac, adam,
                breakdown, trace_dir, tune_max_steps, file_name):
    release_memory()
    torch._dynamo.reset()  # each mode compiles its own blocks: none reuses another's code
    model = build(cfg, dev, compiled, ac)
    x, y = batch(cfg, micro, dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if mode == "ddp" else contextlib.nullcontext()
    net = model
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.1, **adam)
    elif mode in ("fsdp2", "fsdp2+reshard", "fsdp2+hsdp"):
        opt = fsdp2(model, mode != "fsdp2", reduce_dtype, adam, hsdp=mode == "fsdp2+hsdp")
    elif mode == "deepspeed3":
        net = opt = deepspeed3(model, micro, reduce_dtype, adam)  # the engine steps and zeroes
    else:  # zero1, zero2, zero2+overlap (the allgather overlapped with the next forward), zero3, +hybrid,
        # +ostep (overlap_step: each shard stepped during backward)
        stage, flags = int(mode.split("+")[0][-1]), set(mode.split("+")[1:])
        opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **adam),
                                           model=model, stage=stage, param_dtype=torch.bfloat16,
                                           overlap_param_gather="overlap" in flags, overlap_step="ostep" in flags,
                                           shard_group="node" if "hybrid" in flags else None,
                                           # FSDP2's root is wrapped with reshard_after_forward=True here too
                                           reshard_root_after_forward=stage == 3)

    def forward():
        with amp:
            return F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())

    def backward(loss):
        net.backward(loss) if mode == "deepspeed3" else loss.backward()

    def update():
        with torch.profiler.record_function(OPTIMIZER_MARK):  # its kernels are the optimizer step's
            opt.step()
            if mode != "deepspeed3":
                opt.zero_grad()

    def step():
        backward(forward())
        update()
    # HOROVOD_AUTOTUNE=1: the first horovod_zero mode trains until the tuner keeps its best
    # setting, which this mode and the later ones are then timed with.
    tuned = run_until_tuned(step, tune_max_steps) if mode.startswith("zero") and tune_max_steps else (0, None)
    # The training peak: from here on (construction's transient fp32 copies are not
    # counted for any mode; the first step's lazy allocations are).
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    hvd.collective_stats(reset=True)
    t, tb = run_steps(step, steps)
    links = bytes_by_set(hvd.collective_stats(), opt, 2 * steps + 3) if mode.startswith("zero") else None
    keep = trace_file(trace_dir, file_name)
    parts = mean_over_ranks(profile_parts(step, 3, sync, keep, breakdown == "back-to-back")) if breakdown else None
    window = hvd.runtime_info()["gather_window_bytes"] if mode.startswith("zero") else 0
    out = (t, tb, micro * cfg["seq"] / t, peak_gib(window), phase_peaks(forward, backward, update) if phases else None, links,
           parts, tuned)
    if profile_dir and mode in profile_modes:  # every rank steps; rank 0 writes
        profile_steps(step, os.path.join(profile_dir, f"profile_{file_name}.txt") if hvd.rank() == 0 else None)
    del model, opt, net
    return out


def bench_coalescing(dev, width, layers, passes, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, stage=2,
                                       param_dtype=torch.bfloat16)
    x = torch.randn(8, width, device=dev, dtype=torch.bfloat16)
    rows = []
    for coalesce in (False, True):
        def step():
            ctx = opt.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
            with ctx:
                for _ in range(passes):
                    model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        hvd.collective_stats(reset=True)
        t, _ = run_steps(step, steps, warmup=1)
        stats = [s for s in hvd.collective_stats() if s["op"] == "reducescatter"]
        per_step = 2 * steps + 1  # one warm-up step, the median's steps and the back-to-back ones
        rows.append((coalesce, t, sum(s["tensors"] for s in stats) / per_step,
                     sum(s["collectives"] for s in stats) / per_step))
    return rows


def bench_downcast(cfg, micro, steps, dev):
    rows = []
    for mode in ("1", "0"):
        os.environ["HOROVOD_ZERO_DOWNCAST"] = mode
        hvd.collective_stats(reset=True)
        t = bench_mode("zero2", cfg, micro, steps, dev)[0]
        gathered = sum(s["bytes"] for s in hvd.collective_stats() if s["op"] == "allgather")
        rows.append((mode, t, gathered / (2 * steps + 3)))
    os.environ.pop("HOROVOD_ZERO_DOWNCAST", None)
    return rows


def bench_init(cfg, dev):
    """Wrap time on the device path, then on the chunked host-staged fallback."""
    rows = []
    for chunked in (False, True):
        if chunked:
            os.environ["HOROVOD_ZERO_INIT_CHUNK_BYTES"] = str(64 << 20)
        model = build(cfg, dev)
        sync()
        t0 = time.perf_counter()
        opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters()), model=model, stage=2,
                                           param_dtype=torch.bfloat16)
        sync()
        rows.append((opt.init_path, time.perf_counter() - t0))
        os.environ.pop("HOROVOD_ZERO_INIT_CHUNK_BYTES", None)
        del model, opt
    return rows


def simulate_nodes(nodes):
    """torchrun's node variables for `nodes` simulated nodes of consecutive ranks, each
    seeing only its own GPUs; before anything touches CUDA."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size % nodes:
        raise SystemExit(f"--sim-nodes {nodes} does not divide {size} ranks")
    local = size // nodes
    node = rank // local
    os.environ.update(LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(node))
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:  # torch must not have counted GPUs yet
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * local + i) for i in range(local))


SYSTEMS = {"floor": "compute floor", "ddp": "DDP", "fsdp2": "FSDP2", "fsdp2+reshard": "FSDP2 reshard", "fsdp2+hsdp": "FSDP2 HSDP",
           "deepspeed3": "DeepSpeed ZeRO-3"}


def result_row(args, cfg, mode, settings, metrics):
    """One line of docs/benchmarks/results.jsonl."""
    base = mode.split("@")[0]
    system = SYSTEMS.get(base) or (f"horovod_zero stage {base[4]}" if base.startswith("zero") else base)
    with torch.device("meta"):
        n = sum(p.numel() for p in Decoder(**cfg).parameters())
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ") if torch.cuda.is_available() else "cpu"
    settings = dict(model=f"{MODELS[args.model][1]} decoder ({n / 1e9:.2f} B)", seq=cfg["seq"],
                    micro_batch=args.micro_batch, gpus=hvd.size(), mode=mode, param_dtype="bf16",
                    reduce_dtype=args.reduce_dtype, adam=args.adam, **settings)
    if args.no_lookup_grad:
        settings["lookup_grad"] = False  # an upper bound, not training (--no-lookup-grad)
    if "+overlap" in base:
        settings["overlap_param_gather"] = True
    if "+ostep" in base:
        settings["overlap_step"] = True
    if "+hybrid" in base:
        settings.update(shard_group="node", sim_nodes=args.sim_nodes)
    if "@" in mode:
        settings["env"] = mode.split("@", 1)[1]
    # The job's own HOROVOD_* settings (for every mode of the run), in the command too.
    tunables = {v.name for v in VARIABLES}
    job_env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k in tunables)
    if job_env:
        settings["job_env"] = job_env
    return dict(date=datetime.date.today().isoformat(), commit=os.environ.get("HVDZ_COMMIT"),
                machine=f"{hvd.size()} x {gpu}", benchmark="bench_zero",
                command=(job_env + " " if job_env else "") +
                f"torchrun --nproc_per_node={hvd.size()} examples/bench_zero.py {shlex.join(command_args())}",
                system=system, settings=settings, note=None,
                metrics={k: round(v, 3) if v == v else None for k, v in metrics.items()})  # NaN: not measured


def command_args():
    """The command line without --jsonl and its path (where the rows went)."""
    argv, out = sys.argv[1:], []
    while argv:
        a = argv.pop(0)
        if a == "--jsonl":
            argv.pop(0)
        elif not a.startswith("--jsonl="):
            out.append(a)
    return out


def breakdown_parts(parts, floor_busy):
    """A profiled step's disjoint parts in ms, adding up to its wall time: the floor's GPU
    time, compute above it, the optimizer step, exposed communication, and GPU idle (the
    host on the critical path); hidden communication apart."""
    return {"profiled_step_ms": parts["wall"] * 1e3, "floor_gpu_ms": floor_busy * 1e3,
            "compute_above_floor_ms": (parts["compute"] - floor_busy) * 1e3,
            "optimizer_ms": parts["optimizer"] * 1e3, "exposed_comm_ms": parts["exposed"] * 1e3,
            "gpu_idle_ms": (parts["wall"] - busy(parts)) * 1e3, "hidden_comm_ms": parts["hidden"] * 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="1b")
    ap.add_argument("--tiny", action="store_true", help="--model tiny: a smoke test that runs on CPU too")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="ddp,fsdp2,zero1,zero2,zero2+overlap,fsdp2+reshard,zero3,deepspeed3")
    ap.add_argument("--reduce-dtype", choices=("bf16", "fp32"), default="bf16",
                    help="FSDP2's and DeepSpeed's gradient reduction dtype")
    ap.add_argument("--adam", choices=sorted(ADAM_KERNELS), default="default",
                    help="AdamW's kernel for every system (default: each system's own)")
    ap.add_argument("--breakdown", action="store_true", help="the floor, and each step split into its parts (CUDA)")
    ap.add_argument("--profile-back-to-back", action="store_true",
                    help="with --breakdown: profile the steps with no synchronization between them, as training "
                         "runs them (what step() leaves queued, overlap_param_gather's gathers, runs under the next forward)")
    ap.add_argument("--trace-dir", default="", help="with --breakdown: keep rank 0's traces here, gzipped")
    ap.add_argument("--trace-all-ranks", action="store_true",
                    help="with --trace-dir: every rank keeps its trace (trace_<mode>.rank<N>.json.gz)")
    ap.add_argument("--jsonl", default="", help="append the results here, one JSON row per line (rank 0)")
    ap.add_argument("--extras", default="coalescing,downcast,init")
    ap.add_argument("--phases", action="store_true", help="peak memory per phase of one extra step")
    ap.add_argument("--profile", default="", help="modes to profile after timing (e.g. zero2,fsdp2)")
    ap.add_argument("--profile-dir", default=os.environ.get("OUT", "."), help="where rank 0 writes the profiles")
    ap.add_argument("--sim-nodes", type=int, default=0, help="split the ranks into this many simulated nodes")
    ap.add_argument("--compile", action="store_true", help="compile each block (block.compile()), every mode")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing per block, every mode")
    ap.add_argument("--no-lookup-grad", action="store_true",
                    help="an upper bound, not training: the embedding lookup passes no gradient to the tied "
                         "weight, so its reduction no longer waits for the end of backward (every mode and the floor)")
    ap.add_argument("--tune-max-steps", type=int, default=5000,
                    help="with HOROVOD_AUTOTUNE=1: most steps the first horovod_zero mode trains, untimed, until the "
                         "autotuner keeps its best setting")
    args = ap.parse_args()
    if args.tiny:
        args.model = "tiny"
    trace = (args.trace_dir, args.trace_all_ranks) if args.trace_dir else None
    breakdown = ("back-to-back" if args.profile_back_to_back else "synced") if args.breakdown else None
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    if args.sim_nodes:
        simulate_nodes(args.sim_nodes)
    hvd.init()
    dev = hvd.device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif args.breakdown:
        raise SystemExit("--breakdown needs CUDA: it splits the GPU's timeline")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            device_id=dev if dev.type == "cuda" else None)
    cfg, model_name = MODELS[args.model]
    if args.no_lookup_grad:
        cfg, model_name = dict(cfg, lookup_grad=False), model_name + " (the lookup passes no gradient)"
    adam = ADAM_KERNELS[args.adam]
    lines = [f"== bench_zero: {hvd.size()} ranks, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
             f"{model_name} model, micro-batch {args.micro_batch}, seq {cfg['seq']}, "
             f"FSDP2/DeepSpeed reduce in {args.reduce_dtype}, AdamW kernel: {args.adam}"]
    rows = []
    reduce_dtype = torch.bfloat16 if args.reduce_dtype == "bf16" else torch.float32
    floor_busy = None
    if args.breakdown:
        t, tb, peak, floor_busy = bench_floor(cfg, args.micro_batch, args.steps, dev, args.compile, args.ac,
                                              trace)
        lines.append(f"{'floor (1 GPU, fwd+bwd)':22s} step {t*1e3:9.1f} ms  back-to-back {tb*1e3:6.1f} ms  "
                     f"GPU busy {floor_busy*1e3:.1f} ms  peak {peak:6.2f} GiB")
        rows.append(result_row(args, cfg, "floor", dict(compile=args.compile, ac=args.ac),
                               dict(step_ms=t * 1e3, back_to_back_ms=tb * 1e3, peak_gib=peak,
                                    gpu_busy_ms=floor_busy * 1e3)))
    for mode in split_modes(args.modes):
        base, compiled, ac = model_flags(mode.split("@")[0], args.compile, args.ac)
        label = f"{base}{'@' + mode.split('@', 1)[1] if '@' in mode else ''}{'+compile' if compiled else ''}" \
                f"{'+ac' if ac else ''}"
        if base == "deepspeed3" and (dev.type != "cuda" or importlib.util.find_spec("deepspeed") is None):
            lines.append(f"{label:22s} skipped: needs CUDA and `pip install deepspeed`")
            continue
        run = base + mode[len(mode.split("@")[0]):]  # the mode's @settings, without +compile/+ac
        try:
            t, tb, tok, peak, phases, links, parts, tuned = bench_mode(
                run, cfg, args.micro_batch, args.steps, dev, args.profile_dir, args.profile.split(","), args.phases,
                reduce_dtype, compiled, ac, adam, breakdown, trace, args.tune_max_steps, label)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this setting: say so, go on
            lines.append(f"{label:22s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            release_memory()
            continue
        wire = ("  MiB/step: " + ", ".join(f"{k} sets {v:.1f}" if k != "global" else f"global set {v:.1f}"
                                          for k, v in links.items() if v or k == "global")) if links else ""
        note = "  (blocks eager: not compilable under DeepSpeed ZeRO-3)" if base == "deepspeed3" and \
            (args.compile or "compile" in mode.split("+")) else ""
        lines.append(f"{label:22s} step {t*1e3:9.1f} ms  back-to-back {tb*1e3:6.1f} ms  {tok:10.0f} tokens/s/GPU  "
                     f"peak {peak:6.2f} GiB{wire}{note}")
        metrics = dict(step_ms=t * 1e3, back_to_back_ms=tb * 1e3, tokens_per_s_per_gpu=tok, peak_gib=peak)
        if tuned[1]:
            lines.append("    " + tuned_text(*tuned))
        if phases:
            lines.append("    " + ", ".join(f"{ph} peak {pk:.2f} held {held:.2f}" for ph, pk, held in phases))
        if parts:
            b = breakdown_parts(parts, floor_busy)
            metrics.update(b)
            lines.append(f"    profiled step {b['profiled_step_ms']:.1f} ms = floor {b['floor_gpu_ms']:.1f} "
                         f"+ compute above it {b['compute_above_floor_ms']:.1f} + optimizer step {b['optimizer_ms']:.1f} + exposed comm {b['exposed_comm_ms']:.1f} "
                         f"+ GPU idle {b['gpu_idle_ms']:.1f} ms; comm hidden under compute {b['hidden_comm_ms']:.1f} ms")
        kept = dict(autotune=tuned[1], autotune_steps=tuned[0]) if tuned[1] else {}
        rows.append(result_row(args, cfg, run, dict(compile=compiled, ac=ac, **kept), metrics))
    extras = args.extras.split(",") if args.extras else []
    if "coalescing" in extras:
        width, layers = (64, 2) if args.model == "tiny" else (4096, 8)
        for coalesce, t, tensors, calls in bench_coalescing(dev, width, layers, 4, args.steps):
            lines.append(f"coalescing={coalesce!s:5s} MLP {layers}x{width}, 4 passes: step {t*1e3:8.1f} ms, "
                         f"{tensors:.0f} tensors reduce-scattered in {calls:.1f} fused collectives per step")
    if "downcast" in extras:
        for mode, t, gathered in bench_downcast(cfg, args.micro_batch, args.steps, dev):
            lines.append(f"HOROVOD_ZERO_DOWNCAST={mode}: step {t*1e3:9.1f} ms, {gathered/2**20:9.1f} MiB allgathered per step")
    if "init" in extras:
        for path, t in bench_init(cfg, dev):
            lines.append(f"wrap time (flatten, shard, master copies), {path} path: {t*1e3:.1f} ms")
    if hvd.rank() == 0:
        print("\n".join(lines), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
