"""What the tests compare against, in plain torch: deterministic per-rank inputs and
tolerances for the op tests (every rank can rebuild every other rank's input, so
references are computed in the test itself), and the ZeRO tests' model, batches and
single-process training, shared by test_zero.py and test/gpu/test_gpu_zero.py; and a
CPU stand-in for the CUDA master Adam kernel."""

import contextlib
import types
import warnings

import torch

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8"]
FLOATS = ["float32", "float64", "float16", "bfloat16"]


def dtype(name):
    return getattr(torch, name)


def make(rank, shape, dtype_name, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    dt = dtype(dtype_name)
    if dt.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dt)
    elif dt == torch.uint8:
        t = torch.randint(0, 20, shape, generator=g).to(dt)
    else:
        t = torch.randint(-20, 20, shape, generator=g).to(dt)
    return t.to(device)


def tol(dtype_name):
    return {
        "float32": dict(rtol=1e-5, atol=1e-5),
        "float64": dict(rtol=1e-12, atol=1e-12),
        "float16": dict(rtol=5e-3, atol=5e-3),
        "bfloat16": dict(rtol=3e-2, atol=3e-2),
    }.get(dtype_name, dict(rtol=0, atol=0))


def reduce_ref(tensors, op_name):
    """The reduction every rank should see, computed in float64 (or exactly for ints)."""
    stacked = torch.stack([t.double() if t.dtype.is_floating_point else t.long() for t in tensors])
    if op_name == "Sum":
        return stacked.sum(0)
    if op_name == "Average":
        return stacked.sum(0) / len(tensors)
    if op_name == "Min":
        return stacked.min(0).values
    return stacked.max(0).values


def scatter_rows(dim0, size, rank):
    return dim0 // size + (1 if rank < dim0 % size else 0)


def scatter_slice(t, size, rank):
    start = sum(scatter_rows(t.shape[0], size, k) for k in range(rank))
    return t[start:start + scatter_rows(t.shape[0], size, rank)]


def assert_close(out, ref, dtype_name):
    """out (on any device) has dtype dtype_name and equals the reference within its tolerance."""
    assert out.dtype == dtype(dtype_name), (out.dtype, dtype_name)
    out = out.cpu()
    torch.testing.assert_close(out.double() if out.dtype.is_floating_point else out.long(),
                               ref.double() if ref.dtype.is_floating_point else ref.long(), **tol(dtype_name))


# ZeRO: a model, its batches and the single-process training that every ZeRO test
# (CPU in test_zero.py, CUDA in test/gpu/test_gpu_zero.py) compares against.

GLOBAL_BATCH = 12  # divisible by 2 and 3
STEPS = 4


def mlp(seed=0, device="cpu"):
    torch.manual_seed(seed)
    # Odd sizes: shards are padded on every world size used here.
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 7)).to(device)


def adamw(named_params):
    """AdamW in two groups: weights decay, biases do not and step at twice the rate."""
    named = list(named_params)
    return torch.optim.AdamW([
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1, "lr": 1e-2},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 2e-2}])


def batch(step, micro, device="cpu"):
    """The global batch of a step's micro-th backward pass."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 16, generator=g).to(device), torch.randn(GLOBAL_BATCH, 7, generator=g).to(device)


def rank_rows(t, rank, size):
    """This rank's equal block of rows of a global batch."""
    local = t.shape[0] // size
    return t[rank * local:(rank + 1) * local]


def mse(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def train_reference(passes, clip, steps=STEPS, start=0, model=None, opt=None):
    """Plain torch, one process, on the CPU, the whole batch: gradients summed over the passes."""
    model = model or mlp()
    opt = opt or adamw(model.named_parameters())
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(passes):
            mse(model, *batch(step, micro)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model, opt


def rel_err(a, b):
    """|a - b| / |b| in float64 on the CPU, wherever a and b live."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


class Tied(torch.nn.Module):
    """Tied embedding/output weight, a frozen layer, and a layer never used."""

    def __init__(self, device="cpu"):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.mid = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(6, 6)
        self.to(device)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.mid(h) + self.frozen(h))


def tied_batch(step, device="cpu"):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g).to(device),
            torch.randint(0, 11, (GLOBAL_BATCH * 5,), generator=g).to(device))


def scheduled_steps(model, opt, n, r, steps=2, after_step=None):
    """`steps` training steps of a DistributedZeroOptimizer on rank r of n, with a StepLR
    (halving) on its inner optimizer and a step post-hook that counts: (post-hook calls,
    torch's warnings that lr_scheduler.step() came before optimizer.step()).
    after_step() runs after each opt.step()."""
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    hooked = []
    opt.optimizer.register_step_post_hook(lambda *_: hooked.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x, y = batch(step, 0)
            mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
            opt.step()
            if after_step is not None:
                after_step()
            opt.zero_grad()
            sched.step()
    return len(hooked), [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]


@contextlib.contextmanager
def stand_in_master_adam():
    """CPU ranks have no CUDA kernel (csrc/cuda/master_adam.cu): torch's fused Adam on the
    cast gradients stands in for it, behind the same one-dtype rule, writing the copies
    the gathers read, so that the uncast path's plumbing (which shards it takes, their
    factors, state and step counts, the gathers' slots) runs here. Yields the number of
    shards of each call. test/gpu/test_gpu_master_adam.py checks the kernel itself."""
    from horovod_zero.torch.zero.core import master_adam
    calls = []

    def step(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, decoupled, maximize,
             grad_scale, copies=(), add_step=False):
        assert len({g.dtype for g in grads}) == 1, [g.dtype for g in grads]
        calls.append(len(params))
        if add_step:
            torch._foreach_add_(steps, 1)
        fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
        fused(params, [g.float() * grad_scale for g in grads], exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
              maximize=maximize, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        for p, c in zip(params, copies):
            c.copy_(p)
    saved = master_adam.available, master_adam._core
    master_adam.available = lambda device: True
    master_adam._core = types.SimpleNamespace(master_adam_step=step, HAVE_MASTER_ADAM=True)
    try:
        yield calls
    finally:
        master_adam.available, master_adam._core = saved
