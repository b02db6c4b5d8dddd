"""Wrapping a model built on the meta device, one system per run (so each starts from a
fresh process): horovod_zero (DistributedZeroOptimizer with device=, made real unit by
unit), FSDP2 (fully_shard per block, to_empty, then each module's init) and DeepSpeed
ZeRO-3 (deepspeed.zero.Init around the constructor, then deepspeed.initialize). All use
bf16 parameters for compute, fp32 masters and AdamW, and then take one training step
(micro-batch 1, activation checkpointing per block) to show the wrapped model trains.
Prints the wrap time (both systems' communicators made before it starts), the host memory
the wrap added at its peak (sampled RSS), the GPU peak during the wrap and during the step,
largest over ranks.

    torchrun --nproc_per_node=2 examples/bench_init.py --model 8b --system ours
    torchrun --nproc_per_node=2 examples/bench_init.py --model 8b --system fsdp2
    torchrun --nproc_per_node=2 examples/bench_init.py --model 8b --system deepspeed3
    torchrun --nproc_per_node=1 examples/bench_init.py --model 3b --system ours --offload
    torchrun --nproc_per_node=2 examples/bench_init.py --model tiny --system ours     # CPU smoke test
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import horovod_zero.torch as hvd
from bench_checkpoint import RssPeak
from bench_timing import sync
from llama_model import LLAMA_1B, LLAMA_3B, LLAMA_8B, TINY, Decoder, init_weights

MODELS = {"tiny": TINY, "1b": LLAMA_1B, "3b": LLAMA_3B, "8b": LLAMA_8B}


def gpu_peak():
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def ours(cfg, dev, offload):
    with torch.device("meta"):
        model = Decoder(**cfg)
    extra = dict(offload_optimizer="cpu", offload_params="cpu") if offload else {}
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, stage=3,
                                       device=dev, init_fn=init_weights,
                                       param_dtype=torch.bfloat16 if dev.type == "cuda" else None, **extra)
    return model, opt, opt.step


def fsdp2(cfg, dev, offload):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    with torch.device("meta"):
        model = Decoder(**cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dev.type == "cuda" else None,
                              reduce_dtype=torch.bfloat16 if dev.type == "cuda" else None)
    kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else None) if offload else dict(mp_policy=mp)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu" if offload else dev)
    with torch.no_grad():
        for m in model.modules():
            if m is not model.head:  # the head is tied to the embedding: one init for both
                init_weights(m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, opt.step


def deepspeed3(cfg, dev, offload):
    import deepspeed
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "communication_data_type": "bf16",
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}}
    if offload:
        config["zero_optimization"].update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Decoder(**cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, None, engine.step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), default="8b")
    ap.add_argument("--system", choices=("ours", "fsdp2", "deepspeed3"), default="ours")
    ap.add_argument("--offload", action="store_true", help="optimizer state and parameters on the host")
    ap.add_argument("--layers", type=int, default=0, help="the model's shape with this many layers")
    args = ap.parse_args()
    hvd.init()
    dev = hvd.device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    cfg = dict(MODELS[args.model], **({"layers": args.layers} if args.layers else {}))
    # Both communicators made before the clock starts (NCCL's setup takes seconds): torch's by the
    # barrier, ours by a first collective on the device.
    hvd.allreduce(torch.zeros(1, device=dev), name="bench.init.warm")
    sync()
    dist.barrier()
    with RssPeak() as rss:
        t0 = time.perf_counter()
        model, opt, step = {"ours": ours, "fsdp2": fsdp2, "deepspeed3": deepspeed3}[args.system](cfg, dev, args.offload)
        sync()
        wrap = time.perf_counter() - t0
    wrap_peak = gpu_peak()
    if args.system == "ours":
        n = sum(s.numel for s in opt.sharded_state.shards)
    elif args.system == "fsdp2":
        n = sum(p.numel() for p in model.parameters())  # DTensors: the full sizes
    else:
        n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    inner = model.module if args.system == "deepspeed3" else model
    inner.ac = True
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), device=dev)
    t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda" and args.system != "deepspeed3"):
        loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
    (model.backward(loss) if args.system == "deepspeed3" else loss.backward())
    step()
    sync()
    step_time = time.perf_counter() - t0
    out = torch.tensor([wrap, rss.added / 2**30, wrap_peak / 2**30, gpu_peak() / 2**30, step_time], dtype=torch.float64)
    out = hvd.allreduce(out, op=hvd.Max, name="bench.init.max").tolist()
    if hvd.rank() == 0:
        print(f"== bench_init: {args.system}{' +offload' if args.offload else ''}, {args.model} model "
              f"{'' if not args.layers else f'with {args.layers} layers '}({n / 1e9:.2f}B parameters), {hvd.size()} ranks, "
              f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}: wrap {out[0]:.1f} s, host "
              f"+{out[1]:.2f} GiB at peak, GPU peak {out[2]:.2f} GiB during the wrap; first step "
              f"{out[4]:.1f} s, GPU peak {out[3]:.2f} GiB; loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
