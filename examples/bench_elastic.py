"""Recovery of an elastic ZeRO job: the Llama-3.2-1B-shaped model at stage 3 (bf16
parameters, fp32 masters, AdamW) under horovodrun's elastic driver, with
hvd.elastic.TorchState committing after every step. The worker started as rank --victim
SIGKILLs itself in the middle of step --kill-at (after backward); the others re-form the
job without it, rebuild the optimizer for the smaller job and restore the last commit from
their own shards and the buddies' copies, then go on. For comparison, the same job saves a
sharded DCP checkpoint before the kill and loads it into the smaller job at the end.

Each worker appends its events (time, rank, size, seconds) to $OUT/elastic.<first rank>.jsonl;
test/gpu/run_elastic_bench.sh launches it and prints the summary:

    python -m horovod_zero.runner -np 4 --min-np 3 --max-np 4 --host-discovery-script ./hosts.sh \\
        --network-interface lo python examples/bench_elastic.py
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd
from bench_timing import sync
from llama_model import LLAMA_1B, TINY, Decoder, init_weights


class Log:
    def __init__(self, path, first_rank):
        self._f = open(path, "a")
        self._first = first_rank

    def __call__(self, event, **fields):
        row = dict(event=event, t=time.time(), first_rank=self._first, rank=hvd.rank(), size=hvd.size(), **fields)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the tiny model, on CPU too")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-at", type=int, default=4)
    ap.add_argument("--victim", type=int, default=1, help="the first rank of the worker that dies")
    ap.add_argument("--dir", default="/tmp/hvdz_elastic_ckpt", help="where the DCP checkpoint for comparison goes")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the DCP save and load")
    args = ap.parse_args()
    hvd.init()
    first = hvd.rank()
    # A process keeps its GPU for life: ranks change at a reset, the device may not.
    dev = torch.device("cuda", first % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    log = Log(os.path.join(os.environ.get("OUT", "."), f"elastic.{first}.jsonl"), first)
    cfg = TINY if args.tiny else LLAMA_1B
    with torch.device("meta"):
        model = Decoder(**cfg)
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, stage=3,
                                       device=dev, init_fn=init_weights,
                                       param_dtype=torch.bfloat16 if dev.type == "cuda" else None)

    class Timed(hvd.elastic.TorchState):
        def restore(self):
            log("failure seen")  # a collective raised HorovodInternalError
            super().restore()

    state = Timed(model, opt, step=0)
    state.register_reset_callbacks([lambda: log("job formed and optimizer rebuilt")])

    @hvd.elastic.run
    def train(state):
        log("state restored")  # sync() is done: the first call, or after a reset
        while state.step < args.steps:
            g = torch.Generator(device=dev).manual_seed(state.step * 100 + hvd.rank())
            ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), device=dev, generator=g)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
            loss.backward()
            if state.step == args.kill_at and first == args.victim:
                log("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
            sync()
            log("step", step=state.step)
            state.step += 1
            t0 = time.perf_counter()
            state.commit()
            log("commit", seconds=time.perf_counter() - t0)
            if state.step == args.kill_at and not args.no_checkpoint:  # the disk's way, saved before the kill
                t0 = time.perf_counter()
                hvd.zero.save_checkpoint(args.dir, model, opt)
                log("dcp save", seconds=time.perf_counter() - t0)

    train(state)
    if not args.no_checkpoint:
        t0 = time.perf_counter()
        hvd.zero.load_checkpoint(args.dir, model, opt)  # into the smaller job
        sync()
        log("dcp load", seconds=time.perf_counter() - t0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
