"""One AdamW step over N fp32 parameters on the CPU, as ZeRO offload takes it: the
gradient arrives in bf16 and the GPU needs a bf16 copy of the new params.

    python examples/bench_cpu_adam.py [--numel 400000000] [--threads 16] [--repeats 5]

Side by side, each from the same params, state and gradient:
  torch-fused    grad_bf16 -> fp32 grad buffer, torch.optim.AdamW(fused=True).step(), param -> bf16 copy
  torch-foreach  the same casts around torch.optim.AdamW(foreach=True).step()
  ours           CpuAdam (horovod_zero/torch/zero/offload): reads the bf16 gradient and writes the bf16
                 copy in its one pass; no casts around it

Prints, per implementation, the median time of each part and of the whole, G params/s,
the memory traffic it implies (GB/s: what each pass must read and write), the
threads and the ISA; then checks that the results agree.
"""

import argparse
import statistics
import time

import torch

from horovod_zero.torch.zero.offload.cpu_adam import CpuAdam, chosen_isa

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "none": None}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _size(dtype):
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 0


def _run_torch(kind, init, grad, out_dtype, steps):
    p = torch.nn.Parameter(init.clone())
    p.grad = grad if grad.dtype == torch.float32 else torch.empty_like(init)  # the fp32 grad buffer
    opt = torch.optim.AdamW([p], **HYPER, fused=kind == "fused", foreach=kind == "foreach")
    out = torch.empty(init.numel(), dtype=out_dtype) if out_dtype is not None else None
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if grad.dtype != torch.float32:
            p.grad.copy_(grad)  # grad_bf16.float(), into the buffer
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if out is not None:
            out.copy_(p.detach())  # param.to(bf16), into the copy
        t3 = time.perf_counter()
        times.append({"cast in": t1 - t0, "step": t2 - t1, "cast out": t3 - t2, "total": t3 - t0})
    return p.detach(), opt.state[p]["exp_avg"], out, times


def _run_ours(init, grad, out_dtype, steps):
    p = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([p], **HYPER)
    cpu_adam = CpuAdam(opt)
    out = torch.empty(init.numel(), dtype=out_dtype) if out_dtype is not None else None
    items = [(opt.param_groups[0], p, grad, out)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        cpu_adam.step_items(items)
        t1 = time.perf_counter()
        times.append({"step": t1 - t0, "total": t1 - t0})
    return p.detach(), opt.state[p]["exp_avg"], out, times


def _traffic_bytes(name, n, grad_dtype, out_dtype):
    """What each pass must read and write, per parameter, times N."""
    g, o = _size(grad_dtype), _size(out_dtype)
    state = 3 * 4 * 2  # param, exp_avg, exp_avg_sq: read and written
    if name == "ours":
        return n * (state + g + o)
    cast_in = (g + 4) if grad_dtype != torch.float32 else 0
    cast_out = (4 + o) if o else 0
    return n * (cast_in + state + 4 + cast_out)  # the step also reads the fp32 grad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=400_000_000)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per implementation, after one warm-up")
    ap.add_argument("--grad-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--out-dtype", choices=list(DTYPES), default="bf16", help="the param copy for the GPU")
    ap.add_argument("--only", default="torch-fused,torch-foreach,ours", help="comma-separated implementations")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    grad_dtype, out_dtype = DTYPES[args.grad_dtype], DTYPES[args.out_dtype]
    n, steps = args.numel, 1 + args.repeats
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    print(f"AdamW step over {n / 1e6:.1f}M fp32 params, grad {args.grad_dtype}, param copy {args.out_dtype}; "
          f"threads {torch.get_num_threads()}, ISA {chosen_isa()}, torch {torch.__version__}; "
          f"median of {args.repeats} after 1 warm-up")
    results = {}
    for name in args.only.split(","):
        if name == "ours":
            results[name] = _run_ours(init, grad, out_dtype, steps)
        else:
            results[name] = _run_torch(name.split("-")[1], init, grad, out_dtype, steps)
        times = results[name][3][1:]
        parts = {k: statistics.median(t[k] for t in times) for k in times[0]}
        total = parts["total"]
        detail = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if k != "total")
        gbs = _traffic_bytes(name, n, grad_dtype, out_dtype) / total / 1e9
        print(f"  {name:14s} {total * 1e3:8.1f} ms  {n / total / 1e9:6.2f} G params/s  {gbs:6.1f} GB/s   ({detail} ms)")
        results[name] = results[name][:3] + (total,)
    if "ours" in results:
        for name, (p, m, out, total) in results.items():
            if name != "ours":
                print(f"  ours vs {name}: {total / results['ours'][3]:.2f}x")
        _check_agreement(results)


def _check_agreement(results):
    """Every implementation took the same steps from the same state: the params and
    moments agree to a few fp32 ulps (torch's fused kernel orders its ops a little
    differently), and the copies are the params rounded."""
    p0, m0, out0, _ = results["ours"]
    ok = True
    for name, (p, m, out, _) in results.items():
        if out is not None and not torch.equal(out, p.to(out.dtype)):
            print(f"  DISAGREE: {name}'s param copy is not its param rounded")
            ok = False
        if name == "ours":
            continue
        dp, dm = (p - p0).abs().max().item(), (m - m0).abs().max().item()
        close = torch.allclose(p, p0, rtol=1e-5, atol=1e-6) and torch.allclose(m, m0, rtol=1e-4, atol=1e-7)
        print(f"  {'agree' if close else 'DISAGREE'}: ours and {name}, max |d param| {dp:.2e}, max |d exp_avg| {dm:.2e}")
        ok &= close
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
