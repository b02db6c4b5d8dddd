"""Draw the benchmark charts from results.jsonl.

    python docs/benchmarks/plot.py      # writes docs/benchmarks/*.svg (needs matplotlib)

results.jsonl holds one measurement a line, in the order the runs were made, so for a
setting measured more than once the newest run is the last. A run is the rows that share
date, commit, machine and command. Charts draw only runs whose commit was recorded, and
every bar group comes from one run, labelled with its date and commit.
"""
import json
import pathlib
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "horovod_zero", "font.size": 9})

# Bar order and colours: the peers in greys and blues, ours in greens, DeepSpeed in red.
SYSTEMS = OrderedDict([
    ("DDP", "#9e9e9e"),
    ("FSDP2", "#90b4d8"),
    ("FSDP2 reshard", "#3b6fa6"),
    ("ZeRO-1", "#c7e3b4"),
    ("ZeRO-2", "#7fbf5f"),
    ("ZeRO-2, overlap_param_gather", "#4c9a2a"),
    ("ZeRO-2, overlap_step", "#a5d38a"),
    ("ZeRO-3", "#1f6b1f"),
    ("ZeRO-3, overlap_step", "#5f8f5f"),
    ("DeepSpeed ZeRO-3", "#c0504d"),
])


def load():
    """The rows, less upper-bound experiments that do not train (bench_zero --no-lookup-grad)
    and runs of trees other than their commit's (settings "experiment")."""
    with open(HERE / "results.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("settings", {}).get("lookup_grad", True) and "experiment" not in r["settings"]]


def run_key(r):
    return (r["date"], r["commit"], r["machine"], r["command"])


def when(r):
    return f"{r['date'] or 'date not recorded'}, {r['commit']}"


def short_name(r):
    """The bar label of a bench_zero row."""
    name = r["system"].replace("horovod_zero stage ", "ZeRO-")
    if r["settings"].get("overlap_param_gather"):
        name += ", overlap_param_gather"
    if r["settings"].get("overlap_step"):
        name += ", overlap_step"
    if name.startswith("ZeRO") and "HOROVOD_ZERO_CE_ALLGATHER_BYTES" in r["settings"].get("job_env", ""):
        name += ",\ncopy-engine allgather"
    return name


def save(fig, name):
    fig.savefig(HERE / name, metadata={"Date": None})
    plt.close(fig)
    print("wrote", HERE / name)


def newest_zero_runs(rows):
    """{(machine, gpus, micro_batch): rows} of the newest eager run per setting that has FSDP2 in it."""
    eager = [r for r in rows if r["benchmark"] == "bench_zero" and r["commit"]
             and r["settings"].get("micro_batch") and r["settings"].get("gpus", 1) > 1
             and r["settings"]["model"].startswith("Llama-3.2-1B")
             and not r["settings"].get("compile") and not r["settings"].get("ac")
             and r["settings"].get("adam", "default") == "default"  # each system's own AdamW kernel
             and not any(k in r["settings"] for k in ("env", "extra", "sim_nodes"))]
    runs = OrderedDict()
    for r in eager:
        runs.setdefault(run_key(r) + (r["settings"]["micro_batch"],), []).append(r)
    newest = {}
    for (_, _, machine, _, mb), run in runs.items():
        if any(r["system"].startswith("FSDP2") for r in run):
            newest[(machine, run[0]["settings"]["gpus"], mb)] = run
    return newest


def _zero_chart(rows, metric, ylabel, filename):
    newest = newest_zero_runs(rows)
    panels = sorted({(m, g) for m, g, _ in newest}, key=lambda p: ("H100" not in p[0], p[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 4.6), sharey=True, squeeze=False)
    for ax, (machine, gpus) in zip(axes[0], panels):
        mbs = sorted(mb for m, g, mb in newest if (m, g) == (machine, gpus))
        ticks = []
        for x, mb in enumerate(mbs):
            run = newest[(machine, gpus, mb)]
            by_name = {short_name(r): r for r in run}
            bars = [(n, c, by_name[n]) for n, c in SYSTEMS.items() if n in by_name and metric in by_name[n]["metrics"]]
            width = 0.84 / len(bars)
            for i, (name, colour, r) in enumerate(bars):
                ax.bar(x - 0.42 + (i + 0.5) * width, r["metrics"][metric], width, color=colour, label=name)
            ticks.append(f"micro-batch {mb}\n{when(run[0])}")
        fsdp = next(r for r in newest[(machine, gpus, mbs[0])] if r["system"].startswith("FSDP2"))
        dtype = "all reduce in bf16" if fsdp["settings"].get("reduce_dtype") == "bf16" else "FSDP2 and DDP reduce in fp32, ZeRO in bf16"
        ax.set_xticks(range(len(mbs)), ticks, fontsize=7.5)
        ax.set_title(f"{machine.replace(' 80GB HBM3', '')}\n({dtype})", fontsize=8.5)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    labels = [n for n in SYSTEMS if n in handles]
    fig.legend([handles[n] for n in labels], labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("examples/bench_zero.py: Llama-3.2-1B-shaped decoder (1.24 B), seq 2048, bf16 parameters, "
                 "AdamW; newest run per setting", fontsize=9.5)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    save(fig, filename)


def step_time(rows):
    """Step time against FSDP2, DDP and DeepSpeed ZeRO-3, by machine, GPU count and micro-batch."""
    _zero_chart(rows, "step_ms", "median step time (ms), lower is better", "step_time.svg")


def peak_memory(rows):
    """Peak allocated GPU memory for the same runs as step_time."""
    _zero_chart(rows, "peak_gib", "peak GPU memory allocated (GiB), largest rank", "peak_memory.svg")


def offload(rows):
    """The newest one-GPU offload run (1B model, micro-batch 4): step and GPU peak of every system."""
    table = [r for r in rows if r["benchmark"] == "offload" and r["commit"] and r["settings"].get("micro_batch") == 4]
    key = run_key(table[-1])
    run = [r for r in table if run_key(r) == key]
    labels, colours = [], []
    for r in run:
        mode = r["settings"].get("mode", "")
        if r["system"].startswith("horovod_zero"):
            labels.append(f"{r['system'].replace('horovod_zero stage ', 'ZeRO-')} ({mode})")
            colours.append("#4c9a2a")
        else:
            labels.append(r["system"] + (", no offload" if r["system"] == "DDP" else ""))
            colours.append({"DDP": "#9e9e9e", "FSDP2 CPUOffloadPolicy": "#3b6fa6"}.get(r["system"], "#c0504d"))
    y = range(len(run))[::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    a1.barh(y, [r["metrics"].get("mean_ms", r["metrics"]["step_ms"]) for r in run], color=colours)
    a1.set_xlabel("mean step time (ms), lower is better")
    a2.barh(y, [r["metrics"]["gpu_peak_gib"] for r in run], color=colours)
    a2.set_xlabel("GPU peak max_memory_allocated (GiB)")
    a1.set_yticks(list(y), labels, fontsize=8)
    for ax in (a1, a2):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"examples/bench_offload.py on {run[0]['machine']}, {when(run[0])}\n"
                 "Llama-3.2-1B-shaped decoder, micro-batch 4, seq 2048, bf16 parameters and reduction, "
                 "optimizer on the host (ours: stage 3 offloads the parameters too)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    save(fig, "offload.svg")


def compile_ac(rows):
    """Compiled blocks and activation checkpointing: the newest run per micro-batch that compares compiled against eager."""
    zero = [r for r in rows if r["benchmark"] == "bench_zero" and r["commit"] and "env" not in r["settings"]
            and r["settings"].get("adam", "default") == "default"]
    runs = OrderedDict()
    for r in zero:
        runs.setdefault(run_key(r) + (r["settings"].get("micro_batch"),), []).append(r)
    newest = {}
    for k, run in runs.items():
        flags = {r["settings"].get("compile") for r in run}
        if flags == {True, False}:
            newest[k[-1]] = run
    variants = [(False, False, "eager"), (True, False, "compiled"), (False, True, "eager + AC"), (True, True, "compiled + AC")]
    names = ["ZeRO-2", "FSDP2", "ZeRO-3", "FSDP2 reshard", "DeepSpeed ZeRO-3"]
    fig, axes = plt.subplots(1, len(newest), figsize=(5.2 * len(newest), 4.4), squeeze=False)
    for ax, mb in zip(axes[0], sorted(newest)):
        run = newest[mb]
        for x, (comp, ac, _) in enumerate(variants):
            bars = [r for name in names for r in run if short_name(r) == name
                    and r["settings"]["compile"] == comp and r["settings"]["ac"] == ac]
            width = 0.84 / max(len(bars), 1)
            for i, r in enumerate(bars):
                ax.bar(x - 0.42 + (i + 0.5) * width, r["metrics"]["step_ms"], width, color=SYSTEMS[short_name(r)],
                       label=short_name(r))
        ax.set_xticks(range(len(variants)), [v[2] for v in variants])
        ax.set_title(f"micro-batch {mb}: {run[0]['machine']}, {when(run[0])}", fontsize=8.5)
        ax.set_ylabel("median step time (ms), lower is better")
        ax.grid(axis="y", alpha=0.3)
    handles = dict(zip(*axes[0][0].get_legend_handles_labels()[::-1]))
    fig.legend([handles[n] for n in names if n in handles], [n for n in names if n in handles],
               loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle("examples/bench_zero.py, blocks compiled with block.compile() and/or checkpointed (AC); "
                 "all reduce in bf16; DeepSpeed runs eager only", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.94))
    save(fig, "compile_ac.svg")


PARTS = [("floor_gpu_ms", "compute floor (fwd+bwd alone)", "#d9d9d9"),
         ("compute_above_floor_ms", "compute above the floor", "#f2b134"),
         ("optimizer_ms", "optimizer step", "#7b5ea7"),
         ("exposed_comm_ms", "exposed communication", "#c0504d"),
         ("gpu_idle_ms", "GPU idle (host on the critical path)", "#4f81bd")]


def breakdown(rows):
    """The step breakdown (bench_zero.py --breakdown) as stacked bars: the newest run per
    model, micro-batch and AdamW kernel that has a peer beside ours (else the newest); a
    tick marks each system's unprofiled median step."""
    # Eager blocks only: a compiled run has its own, lower floor (docs/benchmarks.md has both).
    split = [r for r in rows if r["benchmark"] == "bench_zero" and r["commit"] and "env" not in r["settings"]
             and "gpu_idle_ms" in r["metrics"] and not r["settings"].get("compile") and not r["settings"].get("ac")]
    runs = OrderedDict()
    for r in split:
        s = r["settings"]
        runs.setdefault((s["model"], s["micro_batch"], s.get("adam")), OrderedDict())[run_key(r)] = True
    panels = []
    def has_peer(key):
        return any(run_key(r) == key and not r["system"].startswith(("horovod_zero", "compute floor")) for r in split)
    for (model, mb, adam), keys in runs.items():
        key = next((k for k in reversed(keys) if has_peer(k)), list(keys)[-1])
        run = [r for r in rows if run_key(r) == key and "env" not in r["settings"]]
        panels.append((model, mb, adam, [r for r in run if "gpu_idle_ms" in r["metrics"]],
                       next((r for r in run if r["system"] == "compute floor"), None)))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.8), squeeze=False)
    for ax, (model, mb, adam, bars, floor) in zip(axes[0], panels):
        for x, r in enumerate(bars):
            bottom = 0.0
            for key, label, colour in PARTS:
                v = r["metrics"][key]
                ax.bar(x, v, 0.6, bottom=bottom, color=colour, label=label)
                bottom += v
            ax.plot([x - 0.3, x + 0.3], [r["metrics"]["step_ms"]] * 2, color="black", lw=1.5,
                    label="median step, unprofiled")
        if floor:
            ax.axhline(floor["metrics"]["step_ms"], color="grey", ls="--", lw=1, label="floor's median step")
        ax.set_xticks(range(len(bars)), [short_name(r) for r in bars], fontsize=8)
        ax.set_title(f"{model.split(' decoder')[0]}, micro-batch {mb}, AdamW {adam}, eager\n"
                     f"{bars[0]['machine']}, {when(bars[0])}", fontsize=8.5)
        ax.set_ylabel("ms per profiled step")
        ax.grid(axis="y", alpha=0.3)
    handles = dict(zip(*axes[0][0].get_legend_handles_labels()[::-1]))
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("examples/bench_zero.py --breakdown: where a step's time goes (the profiler slows the host, "
                 "so the bars exceed the unprofiled step by the idle it adds)", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 0.94))
    save(fig, "breakdown.svg")


if __name__ == "__main__":
    data = load()
    step_time(data)
    peak_memory(data)
    offload(data)
    compile_ac(data)
    breakdown(data)
