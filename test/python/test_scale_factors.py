"""prescale_factor, postscale_factor and op=Average on floating-point tensors over 2
and 3 CPU ranks (Gloo), bit for bit against Horovod's arithmetic (scale_refs.py):
Horovod's own tests ask for exact equality up to 3 ranks. Every way a reduction runs
is covered: a lone tensor in place, a fused group (even and uneven splits), and a
direct group of large tensors."""

import pytest
import torch

import horovod_zero.torch as hvd
from refs import FLOATS, dtype, scatter_slice
from scale_refs import assert_equal, reduced

# (prescale, postscale): factors that float, fp16 and 1/size do not hold exactly.
FACTORS = [(0.1915194503788923, 1.0), (1.0, 0.7), (0.3, 1.7)]


def _inputs(dt, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, cols, generator=g, dtype=torch.float64) * 200 - 100).to(dt)  # values up to 100


def exact_scaling(dtype_name, nccl=False, device="cpu", nccl_avg=None):
    """Runs on every rank; the same inputs everywhere. `nccl_avg`: see scale_refs.reduced."""
    n, r, dt = hvd.size(), hvd.rank(), dtype(dtype_name)
    # A direct group needs tensors of 1 MiB on average (Gloo's reducescatter ring).
    big_cols = (1 << 20) // (dt.itemsize * 2 * n) + 1
    for op_name in ("Sum", "Average"):
        op = getattr(hvd, op_name)
        for pre, post in FACTORS:
            tag = f"{dtype_name}.{op_name}.{pre}.{post}"
            kw = dict(op=op, prescale_factor=pre, postscale_factor=post)

            def ref(x, allreduce):
                return reduced(x, n, op_name, pre, post, allreduce, nccl, nccl_avg)

            x = _inputs(dt, 2 * n, 9, 1)
            out = hvd.allreduce(x.to(device), name=f"sx.ar.{tag}", **kw)
            assert_equal(out, ref(x, True), f"allreduce {tag}")
            group = [_inputs(dt, 3, 5, 2), _inputs(dt, 7, 1, 3)]
            outs = hvd.grouped_allreduce([t.to(device) for t in group], name=f"sx.gar.{tag}", **kw)
            for k, (o, t) in enumerate(zip(outs, group)):
                assert_equal(o, ref(t, True), f"grouped_allreduce {tag} #{k}")
            rs = hvd.reducescatter(x.to(device), name=f"sx.rs.{tag}", **kw)
            assert_equal(rs, scatter_slice(ref(x, False), n, r), f"reducescatter {tag}")
            group = [_inputs(dt, 2 * n + 1, 4, 4), _inputs(dt, n, 3, 5)]  # uneven, then even: fused
            if pre == FACTORS[-1][0]:  # and two large ones alone: a direct group
                big = [_inputs(dt, 2 * n, big_cols, 6), _inputs(dt, 2 * n, big_cols, 7)]
                outs = hvd.grouped_reducescatter([t.to(device) for t in big], name=f"sx.drs.{tag}", **kw)
                for k, (o, t) in enumerate(zip(outs, big)):
                    assert_equal(o, scatter_slice(ref(t, False), n, r), f"direct grouped_reducescatter {tag} #{k}")
            outs = hvd.grouped_reducescatter([t.to(device) for t in group], name=f"sx.grs.{tag}", **kw)
            for k, (o, t) in enumerate(zip(outs, group)):
                assert_equal(o, scatter_slice(ref(t, False), n, r), f"grouped_reducescatter {tag} #{k}")


@pytest.mark.parametrize("dtype_name", FLOATS)
def test_scale_factors_match_horovod_bit_for_bit(ranks, dtype_name):
    ranks.run(exact_scaling, dtype_name)
