"""Autograd for the synchronous collectives, as in Horovod: allreduce, allgather,
reducescatter and broadcast, and the grouped_ forms of the first three, are
differentiable when an input requires grad. One Function per collective serves the
single and the grouped op; each backward is one collective (named after the forward
op's tensors, with ".grad" appended).

[Note: gradient conventions]
Write n for the number of ranks (of the op's process set), g_k for rank k's gradient of its loss with respect
to its output, and s = prescale * postscale / (n if op is Average else 1). Rank r's
input gradient is

    op             Horovod's (the default)            exact (HOROVOD_ZERO_EXACT_GRADIENTS=1)
    allreduce      s * sum_k g_k                      the same
    allgather      (1/n) * sum_k g_k, r's rows        sum_k g_k, r's rows
    broadcast      root: (1/n) * sum_k g_k; else 0    root: sum_k g_k; else 0
    reducescatter  n * s * allgather(g)               s * allgather(g)

"Exact" is the gradient of the sum of every rank's loss, what plain autograd gives
on one process holding every rank's inputs. Horovod's allgather and broadcast
average where the exact gradient sums, and its reducescatter scales by n more
(reducescatter and allgather are each other's adjoints only up to these factors),
so models written for Horovod were tuned with Horovod's: that is the default.
init() reads the variable once (basics._State.exact_gradients).

Min and Max reductions run forward on inputs that require grad, but have no
gradient: a backward through one raises.
"""

import torch

from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.basics import _core, _exact_gradients, rank
from horovod_zero.torch.process_sets import _rank, _size


def _run(kind, tensors, names, process_set, **args):
    """One (grouped) collective over these tensors; returns the outputs as a tuple."""
    if kind == _core.OP_REDUCESCATTER:
        outputs = [ops._scatter_output(t, process_set) for t in tensors]
    else:
        outputs = [None] * len(tensors)
    return tuple(ops.synchronize(ops._enqueue(kind, list(tensors), outputs, list(names),
                                                      process_set=process_set, **args)))


def _save(ctx, names, tensors, process_set):
    ctx.names = names
    ctx.process_set = process_set
    # Gradients exist for floating-point inputs only; every rank has the same dtypes,
    # so every rank's backward runs its collective over the same subset.
    ctx.floats = [i for i, t in enumerate(tensors) if t.dtype.is_floating_point]


def _float_grads(ctx, grads):
    """The floating-point inputs' output gradients and the names of their collective."""
    return [grads[i].contiguous() for i in ctx.floats], [f"{ctx.names[i]}.grad" for i in ctx.floats]


def _placed(ctx, values):
    """Input gradients in input order: None for the inputs without one."""
    out = [None] * len(ctx.names)
    for i, v in zip(ctx.floats, values):
        out[i] = v
    return tuple(out)


def _reducing(ctx, op, prescale, postscale):
    ctx.op = op
    ctx.scale = prescale * postscale / (_size(ctx.process_set) if op == ops.Average else 1)


def _check_differentiable(ctx, what):
    if ctx.op not in (ops.Sum, ops.Average):
        raise RuntimeError(
            f"A {what} with op=Min or Max has no gradient: detach() its input (or compute its output under "
            "torch.no_grad()) when it is not part of the loss.")


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, names, op, prescale, postscale, process_set, *tensors):
        _save(ctx, names, tensors, process_set)
        _reducing(ctx, op, prescale, postscale)
        return _run(_core.OP_ALLREDUCE, tensors, names, process_set, reduce_op=op, prescale=prescale,
                    postscale=postscale)

    @staticmethod
    def backward(ctx, *grads):
        _check_differentiable(ctx, "allreduce")
        # d/dx_r of sum_k L_k(s * sum_j x_j) = s * sum_k g_k; Horovod's (the allreduce of
        # the gradient with the forward's op and factors) is the same.
        grads, names = _float_grads(ctx, grads)
        g = _run(_core.OP_ALLREDUCE, grads, names, ctx.process_set, reduce_op=ops.Sum, postscale=ctx.scale)
        return (None, None, None, None, None) + _placed(ctx, g)


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, names, output_dtype, process_set, *tensors):
        _save(ctx, names, tensors, process_set)
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.rows = [t.shape[0] if t.dim() else 0 for t in tensors]
        return _run(_core.OP_ALLGATHER, tensors, names, process_set, output_dtype=output_dtype)

    @staticmethod
    def backward(ctx, *grads):
        grads, names = _float_grads(ctx, grads)
        if not grads:
            return (None, None, None) + _placed(ctx, ())
        # Where this rank's rows sit in each output: every rank's row counts, one collective.
        ps = ctx.process_set
        mine = torch.tensor([ctx.rows[i] for i in ctx.floats], dtype=torch.int64)
        every = ops.synchronize(ops._allgather_async(mine, f"{names[0]}.rows", None, ps)).view(_size(ps), -1)
        starts = every[:_rank(ps)].sum(0).tolist()
        op = ops.Sum if _exact_gradients() else ops.Average
        summed = _run(_core.OP_ALLREDUCE, grads, names, ps, reduce_op=op)
        out = [g[start:start + ctx.rows[i]].to(ctx.dtypes[i]) for g, start, i in zip(summed, starts, ctx.floats)]
        return (None, None, None) + _placed(ctx, out)


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, names, op, prescale, postscale, process_set, *tensors):
        _save(ctx, names, tensors, process_set)
        _reducing(ctx, op, prescale, postscale)
        return _run(_core.OP_REDUCESCATTER, tensors, names, process_set, reduce_op=op, prescale=prescale,
                    postscale=postscale)

    @staticmethod
    def backward(ctx, *grads):
        _check_differentiable(ctx, "reducescatter")
        # Row block r of every input feeds rank r's output: gather the blocks back.
        grads, names = _float_grads(ctx, grads)
        scale = ctx.scale if _exact_gradients() else ctx.scale * _size(ctx.process_set)
        g = _run(_core.OP_ALLGATHER, grads, names, ctx.process_set)
        return (None, None, None, None, None) + _placed(ctx, [t * scale if scale != 1.0 else t for t in g])


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, root_rank, process_set, tensor):
        ctx.name, ctx.root, ctx.process_set = name, root_rank, process_set
        return ops.synchronize(ops._broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        # Every rank's output is the root's input: only the root's input has a gradient.
        op = ops.Sum if _exact_gradients() else ops.Average
        (g,) = _run(_core.OP_ALLREDUCE, [grad.contiguous()], [f"{ctx.name}.grad"], ctx.process_set, reduce_op=op)
        return None, None, None, (g if rank() == ctx.root else torch.zeros_like(g))
