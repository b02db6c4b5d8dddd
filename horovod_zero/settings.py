"""Every HOROVOD_* setting horovod_zero reads, declared once, with its default, the
values it accepts and what it does.

hvd.init() calls read() before anything starts: a bad value of any variable is
refused there, naming the variable, the value and what it accepts, instead of
being ignored or clamped somewhere later. The core's settings then go to the C++
runtime as one Params object (the C++ side reads no environment) and the job's to
the rest of init(); DistributedZeroOptimizer builds its ZeroConfig
(torch/zero/config.py) from the "zero" rows with read_section() when it is
built, so each optimizer takes the environment of its own construction,
checked by the same rows.

The launcher's own variables (HOROVOD_RANK, HOROVOD_SIZE, ..., and
HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT) say who this process is rather than how to
run; runner/world.py and runner/rendezvous.py read and check those.
"""

import math
import os
import socket
from dataclasses import dataclass, fields
from typing import Callable, Optional

# --- how a value is parsed: each parser knows the text of what it accepts -----------


def _show(x) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


@dataclass(frozen=True)
class _Number:
    kind: type  # int or float
    lo: float
    hi: Optional[float] = None

    def accepts(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        lo, hi = _show(self.lo), _show(self.hi)
        return f"{what} >= {lo}" if self.hi is None else f"{what} from {lo} to {hi}"

    def __call__(self, text: str):
        v = self.kind(text.strip())  # ValueError when it is no number of this kind
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError
        if v < self.lo or (self.hi is not None and v > self.hi):
            raise ValueError
        return v


@dataclass(frozen=True)
class _Choice:
    words: tuple

    def accepts(self) -> str:
        return "one of " + ", ".join(self.words) + " (any case)"

    def __call__(self, text: str):
        word = text.strip().lower()  # horovodrun --log-level passes DEBUG, TRACE, ...
        if word not in self.words:
            raise ValueError
        return word


@dataclass(frozen=True)
class _Bool:
    """Horovod's switches are 1 or 0."""

    def accepts(self) -> str:
        return "1 or 0"

    def __call__(self, text: str):
        if text.strip() not in ("0", "1"):
            raise ValueError
        return text.strip() == "1"


@dataclass(frozen=True)
class _Text:
    def accepts(self) -> str:
        return "any text"

    def __call__(self, text: str):
        return text


class _TimelinePath:
    """A path, or Horovod's DYNAMIC: no file until hvd.start_timeline()."""

    def accepts(self) -> str:
        return "a path, or DYNAMIC"

    def __call__(self, text: str):
        return "" if text == "DYNAMIC" else text


@dataclass(frozen=True)
class _Interface:
    def accepts(self) -> str:
        return "a network interface of this host (" + ", ".join(n for _, n in socket.if_nameindex()) + ")"

    def __call__(self, text: str):
        if text not in {n for _, n in socket.if_nameindex()}:
            raise ValueError
        return text


@dataclass(frozen=True)
class _CpuLists:
    """Horovod's HOROVOD_THREAD_AFFINITY: one entry per local rank, comma-separated; an
    entry is a CPU id or (ours) a range of them."""

    def accepts(self) -> str:
        return "one CPU id per local rank, comma-separated (e.g. 7,15), each may be a range (e.g. 4-7,12-15)"

    def __call__(self, text: str):
        out = []
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            lo = int(first)  # ValueError when it is no integer
            hi = int(last) if dash else lo
            if lo < 0 or hi < lo:
                raise ValueError
            out.append(tuple(range(lo, hi + 1)))
        return tuple(out)


# --- the table -----------------------------------------------------------------------


@dataclass(frozen=True)
class Variable:
    name: str  # the environment variable
    field: str  # its attribute in Settings (section "core": also in the C++ Params)
    section: str  # "core": the C++ runtime; "job": the rest of init(); "zero": ZeroConfig (torch/zero/config.py)
    parse: Callable  # text -> value; raises ValueError outside what it accepts
    default: object  # the value when the variable is unset or empty
    meaning: str

    def accepts(self) -> str:
        return self.parse.accepts()


_MiB = 1 << 20

VARIABLES = (
    Variable("HOROVOD_FUSION_THRESHOLD", "fusion_threshold_bytes", "core", _Number(int, 0), 128 * _MiB,
             "bytes per fusion buffer; 0 turns fusion off"),
    Variable("HOROVOD_CYCLE_TIME", "cycle_time_ms", "core", _Number(float, 0.01, 100.0), 1.0,
             "milliseconds between negotiation cycles while there is work; idle, the period doubles up to "
             "250 ms; new work starts a cycle at once"),
    Variable("HOROVOD_CACHE_CAPACITY", "cache_capacity", "core", _Number(int, 0, 1 << 20), 1024,
             "response cache entries; 0 turns the cache off"),
    Variable("HOROVOD_TIMELINE", "timeline_path", "core", _TimelinePath(), "",
             "path of a Chrome-trace JSON timeline written by rank 0; unset or DYNAMIC: none until "
             "hvd.start_timeline()"),
    Variable("HOROVOD_TIMELINE_MARK_CYCLES", "timeline_mark_cycles", "core", _Bool(), False,
             "1: the timeline marks the start of each negotiation cycle (CYCLE_START)"),
    Variable("HOROVOD_LOG_LEVEL", "log_level", "core",
             _Choice(("trace", "debug", "info", "warning", "error", "fatal")), "warning",
             "least severe messages printed (stderr); debug and trace show negotiation, fusion and transports"),
    Variable("HOROVOD_STALL_CHECK_TIME_SECONDS", "stall_check_seconds", "core", _Number(float, 0), 60.0,
             "warn about tensors some ranks have not submitted after this long; 0: never"),
    Variable("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_seconds", "core", _Number(float, 0), 0.0,
             "fail tensors some ranks have not submitted after this long; 0: never"),
    Variable("HOROVOD_GLOO_TIMEOUT_SECONDS", "transport_timeout_seconds", "core", _Number(float, 1, 86400), 30.0,
             "rendezvous, negotiation and collective timeout: a dead or silent peer becomes an error after it"),
    Variable("HOROVOD_ZERO_DIRECT_MAX_TENSORS", "direct_max_tensors", "core", _Number(int, -1), -1,
             "most tensors in a direct group (large tensors in place, each its own call, no fusion buffer: "
             "NCCL, and Gloo for allgather, reducescatter and broadcast); 0: never; -1: any number up to 4 "
             "ranks, 16 beyond"),
    Variable("HOROVOD_ZERO_COPY_STREAM_BYTES", "copy_stream_bytes", "core", _Number(int, 0), 8 * _MiB,
             "fused CUDA ops of at least this many bytes copy on side streams; 0: never"),
    Variable("HOROVOD_ZERO_CE_ALLGATHER_BYTES", "ce_allgather_bytes", "core", _Number(int, 0), 0,
             "bytes of a symmetric NCCL window per communicator through which CUDA allgathers that fit run on "
             "the copy engines instead of SMs (NCCL 2.28 or later, all ranks on one host); held outside "
             "torch's allocator; 0: off"),
    Variable("HOROVOD_ZERO_GATHER_STREAM", "gather_stream", "core", _Bool(), False,
             "1: CUDA allgathers run on a NCCL communicator and stream of their own, beside the other "
             "collectives instead of queued behind them (ZeRO's parameter gathers beside its reduce-scatters)"),
    Variable("HOROVOD_AUTOTUNE", "autotune", "core", _Bool(), False,
             "1: tune the fusion threshold, the cycle time and ZeRO's bucket size and prefetch depth while the "
             "job runs (Bayesian optimisation, as Horovod's autotuner); settings given explicitly stay as given"),
    Variable("HOROVOD_AUTOTUNE_LOG", "autotune_log", "core", _Text(), "",
             "autotuning: rank 0 writes every sample and the best setting here, as CSV with Horovod's columns"),
    Variable("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "autotune_warmup_samples", "core", _Number(int, 0), 3,
             "autotuning: samples discarded at the start"),
    Variable("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "autotune_steps_per_sample", "core", _Number(int, 1), 10,
             "autotuning: steps per sub-sample (a sample's score is the median of 5 sub-samples)"),
    Variable("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "autotune_max_samples", "core", _Number(int, 1), 20,
             "autotuning: samples the search scores"),
    Variable("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "autotune_noise", "core", _Number(float, 0.0, 1.0), 0.8,
             "autotuning: the noise the Gaussian process assumes in the (standardised) scores"),
    Variable("HOROVOD_AUTOTUNE_CONFIRM_ROUNDS", "autotune_confirm_rounds", "core", _Number(int, 0), 3,
             "autotuning: after the search, rounds measuring its best setting and the starting one in turn; the "
             "best is kept only when it wins by more than their spread (2% at least); 0: no rounds, the best kept"),
    Variable("HOROVOD_THREAD_AFFINITY", "thread_affinity", "job", _CpuLists(), None,
             "CPUs for the runtime's own threads (negotiation, CUDA completion), one entry per local rank: "
             "local rank i's threads run on entry i; unset: where the scheduler puts them"),
    Variable("HOROVOD_GLOO_IFACE", "gloo_iface", "job", _Interface(), "",
             "network interface Gloo uses; unset: the one the hostname resolves to"),
    Variable("HOROVOD_ZERO_SHM_CONTROL", "shm_control", "job", _Bool(), True,
             "negotiate through shared memory when every rank is on one host; 0: over Gloo"),
    Variable("HOROVOD_DYNAMIC_PROCESS_SETS", "dynamic_process_sets", "job", _Bool(), False,
             "1: process sets can be added and removed while the job runs (hvd.add_process_set(), "
             "hvd.remove_process_set()), as hvd.init(process_sets=\"dynamic\") allows; 0: only those passed to "
             "hvd.init()"),
    Variable("HOROVOD_ZERO_EXACT_GRADIENTS", "exact_gradients", "job", _Bool(), False,
             "1: the collectives' gradients are the exact gradients of the sum of every rank's loss; "
             "0: Horovod's gradients"),
    Variable("HOROVOD_ELASTIC", "elastic", "job", _Bool(), False,
             "set by horovodrun's elastic mode: after hvd.shutdown(), hvd.init() asks the launcher for this "
             "process's new rank and size (see hvd.elastic)"),
    Variable("HOROVOD_ELASTIC_TIMEOUT", "elastic_timeout_seconds", "job", _Number(float, 1), 600.0,
             "elastic: seconds a re-init waits for the launcher to form the next job (horovodrun's "
             "--elastic-timeout reads it too)"),
    Variable("HOROVOD_ZERO_BUCKET_BYTES", "bucket_bytes", "zero", _Number(int, 0), 32 * _MiB,
             "ZeRO stage 2: gradient bytes gathered before one grouped reduce-scatter; 0: one per gradient"),
    Variable("HOROVOD_ZERO_DOWNCAST", "downcast", "zero", _Bool(), True,
             "ZeRO: cast master shards to param_dtype before the allgather (on the wire); 0: after it"),
    Variable("HOROVOD_ZERO_INIT_CHUNK_BYTES", "init_chunk_bytes", "zero", _Number(int, 1), None,
             "ZeRO: build shards through host memory in chunks of this many bytes; unset: only when the "
             "device lacks memory"),
    Variable("HOROVOD_ZERO_PREFETCH", "prefetch", "zero", _Number(int, 0), 1,
             "ZeRO stage 3: gather units fetched ahead of the one in use; 0: none"),
    Variable("HOROVOD_ZERO_FUSED_STEP", "fused_step", "zero", _Bool(), True,
             "ZeRO: step Adam and AdamW master shards with torch's fused kernel when foreach was left "
             "unset; 0: as the optimizer was built"),
    Variable("HOROVOD_ZERO_STEP_CHUNK_BYTES", "step_chunk_bytes", "zero", _Number(int, 0), 256 * _MiB,
             "ZeRO, Adam/AdamW: fp32 master bytes stepped at a time, in the order the gradients were reduced; "
             "at stages 1-2 each chunk's allgather runs under the next chunk's step; 0: step all at once"),
    Variable("HOROVOD_ZERO_MASTER_ADAM", "master_adam", "zero", _Bool(), True,
             "ZeRO on CUDA, Adam/AdamW with the fused kernel, stepped in chunks: step from the reduced "
             "bf16/fp16 gradients in one kernel, without casting them to fp32 first; 0: cast, then torch's kernel"),
    Variable("HOROVOD_ZERO_CPU_ADAM_ISA", "cpu_adam_isa", "cpu_adam", _Choice(("auto", "avx512", "avx2", "scalar")),
             "auto", "ZeRO CPU offload: instruction set of the C++ Adam step; auto: the widest this CPU has"),
    Variable("HOROVOD_ZERO_NVME_QUEUE_DEPTH", "nvme_queue_depth", "nvme", _Number(int, 1, 1024), 8,
             "ZeRO NVMe offload: O_DIRECT requests in flight per state file"),
    Variable("HOROVOD_ZERO_NVME_REQUEST_BYTES", "nvme_request_bytes", "nvme", _Number(int, 4096), _MiB,
             "ZeRO NVMe offload: largest O_DIRECT request, rounded down to the file system's alignment"),
    Variable("HOROVOD_ZERO_OVERLAP_STEP_THREADS", "overlap_step_threads", "cpu_adam", _Number(int, 0), 0,
             "ZeRO CPU offload with overlap_step=True: threads of the host step that runs beside backward; "
             "0: the cores this process may use, less two"),
)


# --- what init() and the optimizer get -------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The core's and the job's settings, as read by init() (see VARIABLES)."""
    fusion_threshold_bytes: int
    cycle_time_ms: float
    cache_capacity: int
    timeline_path: str
    timeline_mark_cycles: bool
    log_level: str
    stall_check_seconds: float
    stall_shutdown_seconds: float
    transport_timeout_seconds: float
    direct_max_tensors: int
    copy_stream_bytes: int
    ce_allgather_bytes: int
    gather_stream: bool
    autotune: bool
    autotune_log: str
    autotune_warmup_samples: int
    autotune_steps_per_sample: int
    autotune_max_samples: int
    autotune_noise: float
    autotune_confirm_rounds: int
    thread_affinity: Optional[tuple]  # per local rank, a tuple of CPU ids; None: unpinned
    gloo_iface: str
    shm_control: bool
    dynamic_process_sets: bool
    exact_gradients: bool
    elastic: bool
    elastic_timeout_seconds: float
    bucket_bytes: int  # the ZeRO settings at init(), where the autotuner starts
    prefetch: int
    fixed: frozenset  # the TUNABLE variables set explicitly: the autotuner leaves them alone


# Params' flag for each setting the autotuner may change, set when the variable is.
TUNABLE = {"HOROVOD_FUSION_THRESHOLD": "fixed_fusion_threshold", "HOROVOD_CYCLE_TIME": "fixed_cycle_time",
           "HOROVOD_ZERO_BUCKET_BYTES": "fixed_zero_bucket", "HOROVOD_ZERO_PREFETCH": "fixed_zero_prefetch"}


def _values(rows, env) -> dict:
    """Each row's value; every bad one is reported, in one ValueError."""
    env = os.environ if env is None else env
    out, bad = {}, []
    for v in rows:
        text = env.get(v.name, "")
        if text == "":
            out[v.field] = v.default
            continue
        try:
            out[v.field] = v.parse(text)
        except ValueError:
            default = "unset" if v.default in (None, "") else str(int(v.default)) if isinstance(v.default, bool) \
                else repr(v.default)
            bad.append(f"  {v.name}={text!r}: expected {v.accepts()} ({v.meaning}; default {default})")
    if bad:
        raise ValueError("Invalid horovod_zero environment variable" + ("s" if len(bad) > 1 else "") +
                         "; set each to an accepted value, or unset it for the default:\n" + "\n".join(bad))
    return out


def _check_nccl_for_windows(env):
    """NCCL's own variables that would turn the copy-engine allgather off while the window
    is still registered (every gather then pays the window's copies for nothing)."""
    off = [f"{k}={env[k]}" for k in ("NCCL_WIN_ENABLE", "NCCL_CUMEM_ENABLE") if env.get(k, "").strip() == "0"]
    if env.get("NCCL_CTA_POLICY", "").strip():
        off.append(f"NCCL_CTA_POLICY={env['NCCL_CTA_POLICY']}")
    if off:
        raise ValueError("HOROVOD_ZERO_CE_ALLGATHER_BYTES needs NCCL's symmetric windows and its zero-CTA policy, "
                         f"which {', '.join(off)} turn off or override: unset "
                         f"{'them' if len(off) > 1 else 'it'}, or unset HOROVOD_ZERO_CE_ALLGATHER_BYTES.")


def read(env=None) -> Settings:
    """Every variable of VARIABLES from `env` (default: os.environ), validated; the
    "zero" ones are checked here too, and read again by each optimizer."""
    values = _values(VARIABLES, env)
    if values["elastic"] and values["ce_allgather_bytes"]:
        # A copy-engine gather waits for its peers with stream memory operations, which no
        # abort interrupts: a dead peer would leave the stream blocked and recovery hung.
        raise ValueError("HOROVOD_ZERO_CE_ALLGATHER_BYTES cannot be used in an elastic job (HOROVOD_ELASTIC=1): "
                         "a copy-engine allgather waiting for a lost peer cannot be interrupted, so the job could "
                         "not recover. Unset it for elastic jobs.")
    if values["ce_allgather_bytes"]:
        _check_nccl_for_windows(os.environ if env is None else env)
    values["fixed"] = explicitly_set(TUNABLE, env)
    return Settings(**{f.name: values[f.name] for f in fields(Settings)})


def explicitly_set(names, env=None) -> frozenset:
    """Those of `names` that have a value (empty means unset)."""
    env = os.environ if env is None else env
    return frozenset(n for n in names if env.get(n, "") != "")


def read_section(section: str, env=None) -> dict:
    """The validated values of one section's rows, by field name."""
    return _values([v for v in VARIABLES if v.section == section], env)


def thread_cpus(affinity, local_rank: int, local_size: int, allowed) -> list:
    """This local rank's entry of HOROVOD_THREAD_AFFINITY (`affinity`, parsed; None: []),
    checked against the CPUs this process may use (`allowed`)."""
    if affinity is None:
        return []
    if len(affinity) < local_size:
        raise ValueError(f"HOROVOD_THREAD_AFFINITY has {len(affinity)} entr{'y' if len(affinity) == 1 else 'ies'} "
                         f"for {local_size} local ranks: give one per local rank (entry i is local rank i's), "
                         "or unset it.")
    mine = list(affinity[local_rank])
    outside = [c for c in mine if c not in allowed]
    if outside:
        raise ValueError(f"HOROVOD_THREAD_AFFINITY gives local rank {local_rank} CPU "
                         f"{', '.join(map(str, outside))}, outside the CPUs this process may use "
                         f"({_cpu_text(sorted(allowed))}): choose CPUs among those.")
    return mine


def _cpu_text(cpus) -> str:
    """[0, 1, 2, 5] -> '0-2,5', the kernel's list format."""
    runs = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def core_params(settings: Settings, params):
    """Fills the C++ runtime's Params object (`_core.Params()`) from the core rows."""
    for v in VARIABLES:
        if v.section == "core":
            setattr(params, v.field, getattr(settings, v.field))
    params.zero_bucket_bytes, params.zero_prefetch = settings.bucket_bytes, settings.prefetch
    for name, flag in TUNABLE.items():
        setattr(params, flag, name in settings.fixed)
    return params
