"""The Llama-3.2-1B-shaped decoder the ZeRO benchmarks train (RMSNorm, GQA
attention, SwiGLU FFN, tied embedding), and a tiny shape of it for smoke tests on CPU."""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LLAMA_1B = dict(layers=16, d=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=2048)
TINY = dict(layers=2, d=64, heads=4, kv_heads=2, ffn=128, vocab=512, seq=64)
LLAMA_3B = dict(layers=28, d=3072, heads=24, kv_heads=8, ffn=8192, vocab=128256, seq=2048)
LLAMA_8B = dict(layers=32, d=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=2048)


def init_weights(module):
    """The init of a normal build, per module, for models built on the meta device (the
    Decoder's constructor draws the embedding with std 0.02 after Embedding's own init)."""
    if isinstance(module, torch.nn.Embedding):
        torch.nn.init.normal_(module.weight, std=0.02)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


class RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def reset_parameters(self):  # what a model built on the meta device is initialised with
        torch.nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * self.weight


class Block(torch.nn.Module):
    def __init__(self, d, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv_heads, d // heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q = torch.nn.Linear(d, d, bias=False)
        self.k = torch.nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = torch.nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.gate = torch.nn.Linear(d, ffn, bias=False)
        self.up = torch.nn.Linear(d, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(torch.nn.Module):
    def __init__(self, layers, d, heads, kv_heads, ffn, vocab, seq, lookup_grad=True):
        super().__init__()
        # False: an experiment's upper bound, not training: the lookup gives the tied weight
        # no gradient (only the head does), as if the lookup's gradient cost nothing.
        self.lookup_grad = lookup_grad
        self.emb = torch.nn.Embedding(vocab, d)
        torch.nn.init.normal_(self.emb.weight, std=0.02)
        self.blocks = torch.nn.ModuleList(Block(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied embeddings
        self.ac = False  # recompute each block's activations in backward (non-reentrant checkpoint)

    def forward(self, ids):
        x = self.emb(ids) if self.lookup_grad else F.embedding(ids, self.emb.weight.detach())
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ac else b(x)
        return self.head(self.norm(x))
