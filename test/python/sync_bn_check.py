"""hvd.SyncBatchNorm against torch.nn.BatchNorm on the whole batch in one process: the
rank runs its own slice (ranks hold different batch sizes), and every rank computes the
reference itself. Shared by the CPU test and the GPU test."""

import torch

import horovod_zero.torch as hvd

CHANNELS = 3


def _data(n_total, dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n_total, CHANNELS, 4, 5, generator=g, dtype=dtype) * 3 + 1
    weights = torch.randn(n_total, CHANNELS, 4, 5, generator=g, dtype=dtype)  # the loss is sum(y * weights)
    return x, weights


def run(device, dtype=torch.float64, steps=2, momentum=0.1):
    """Per step: (max |dx - ref| over this rank's slice, max |dw, db - ref| (the local
    weight and bias gradients summed over ranks), max |running stats - ref|, max |y - ref|);
    then eval mode's output error, and the batches tracked."""
    device = hvd.device() if device == "cuda" else torch.device(device)  # "cuda": this rank's GPU
    r, n = hvd.rank(), hvd.size()
    sizes = [k + 2 for k in range(n)]  # uneven batches: the counts must weigh the statistics
    lo, hi = sum(sizes[:r]), sum(sizes[:r + 1])
    ref = torch.nn.BatchNorm2d(CHANNELS, momentum=momentum, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.linspace(0.5, 1.5, CHANNELS))
        ref.bias.copy_(torch.linspace(-0.2, 0.2, CHANNELS))
    bn = hvd.SyncBatchNorm(CHANNELS, momentum=momentum, dtype=dtype).to(device)
    bn.load_state_dict(ref.state_dict())
    errs = []
    for step in range(steps):
        x, w = _data(sum(sizes), dtype)
        x = x + step
        xr = x.clone().requires_grad_()
        (ref(xr) * w).sum().backward()
        mine = x[lo:hi].to(device).requires_grad_()
        y = bn(mine)
        (y * w[lo:hi].to(device)).sum().backward()
        grads = hvd.allreduce(torch.cat([bn.weight.grad, bn.bias.grad]).cpu(), op=hvd.Sum, name=f"sbn.g.{step}")
        errs.append((
            float((mine.grad.cpu() - xr.grad[lo:hi]).abs().max()),
            float((grads - torch.cat([ref.weight.grad, ref.bias.grad])).abs().max()),
            float(max((bn.running_mean.cpu() - ref.running_mean).abs().max(),
                      (bn.running_var.cpu() - ref.running_var).abs().max())),
            float((y.detach().cpu() - _reference_output(ref, x, lo, hi)).abs().max()),
        ))
        bn.zero_grad()
        ref.zero_grad()
    bn.eval()
    ref.eval()
    x, _ = _data(sum(sizes), dtype)
    eval_err = float((bn(x[lo:hi].to(device)).detach().cpu() - ref(x)[lo:hi].detach()).abs().max())
    return errs, eval_err, int(bn.num_batches_tracked)


def _reference_output(ref, x, lo, hi):
    """The training-mode output for the whole batch, without touching ref's running stats."""
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    var = x.var(dim=(0, 2, 3), keepdim=True, correction=0)
    y = (x - mean) / torch.sqrt(var + ref.eps) * ref.weight.detach().view(1, -1, 1, 1) + ref.bias.detach().view(1, -1, 1, 1)
    return y[lo:hi]
