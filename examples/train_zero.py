"""Trains a small decoder-style language model with ZeRO (DistributedZeroOptimizer).

Each rank takes its slice of every global batch; gradients are reduce-scattered
into fp32 shards, the inner AdamW steps only this rank's shard, and the updated
shards are allgathered into the model's parameters (bf16 on the wire with
--bf16). Runs on CPU (Gloo) or, when CUDA is usable, on this rank's GPU (NCCL).

    torchrun --nproc_per_node=2 examples/train_zero.py --stage 2
    torchrun --nproc_per_node=2 examples/train_zero.py --stage 3 --bf16   # parameters sharded too
    python -m horovod_zero.runner -np 2 -H localhost:2 python examples/train_zero.py
"""

import argparse
import contextlib
import time

import torch

import horovod_zero.torch as hvd


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=256, d=128, layers=2, heads=4, seq=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        torch.nn.init.normal_(self.emb.weight, std=0.02)  # tied with the output layer: keep logits small
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied embeddings
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, ids):
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        h = self.blocks(h, mask=self.mask[: ids.shape[1], : ids.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def batch(step, global_batch, seq, vocab):
    """A learnable synthetic language: each token is the previous one plus a step."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    stride = torch.randint(1, 4, (global_batch, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1], seqs[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2, help="1, 2, or 3 (each transformer layer one gather unit)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="global batch size")
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 master shards")
    ap.add_argument("--offload", choices=["cpu", "nvme"], help="optimizer state in host memory, or in files")
    ap.add_argument("--nvme-path", default=None, help="directory for --offload nvme (a local disk)")
    args = ap.parse_args()

    hvd.init()
    dev = hvd.device()
    torch.manual_seed(0)
    model = TinyLM().to(dev)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    opt = hvd.DistributedZeroOptimizer(opt, model=model, stage=args.stage,
                                       param_dtype=torch.bfloat16 if args.bf16 else None,
                                       offload_optimizer=args.offload, nvme_path=args.nvme_path)
    local = args.batch // hvd.size()
    t0 = time.time()
    for step in range(args.steps):
        ids, target = batch(step, args.batch, 32, 256)
        ids, target = (t[hvd.rank() * local:(hvd.rank() + 1) * local].to(dev) for t in (ids, target))
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), target.flatten())
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        global_loss = hvd.allreduce(loss.detach().float(), name="loss").item()
        if hvd.rank() == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {global_loss:.4f}", flush=True)
    with opt.gathered_params() if args.stage == 3 else contextlib.nullcontext():  # stage 3: whole only in here
        flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        total = sum(p.numel() for p in model.parameters())
    spread = (hvd.allreduce(flat, op=hvd.Max, name="check.max") - hvd.allreduce(flat, op=hvd.Min, name="check.min"))
    state = sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    if hvd.rank() == 0:
        print(f"done: ZeRO stage {args.stage}, {hvd.size()} ranks ({dev}), {args.steps} steps in {time.time() - t0:.1f} s; "
              f"this rank holds {state} optimizer-state values for {total} parameters (2 per parameter unsharded); "
              f"max weight difference between ranks {spread.abs().max().item():.1e}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
