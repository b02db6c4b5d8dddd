"""The step of Adam/AdamW master shards in chunks, in the order the gradients were
reduced, each chunk's allgather (stages 1 and 2) queued before the next chunk is stepped,
or all of them after the last chunk in the parameters' order with overlap_param_gather
(core/step_chunks.py): the same weights and state as the step in one piece, the
reference's weights, and LR schedulers and step hooks that see every step. CPU ranks;
HOROVOD_ZERO_STEP_CHUNK_BYTES=64 makes a chunk of each parameter or two."""

import contextlib

import pytest
import torch

import horovod_zero.torch as hvd
from harness import scoped_env, shared_pool
from refs import STEPS, adamw, batch, mlp, mse, rank_rows, rel_err, scheduled_steps, stand_in_master_adam, \
    train_reference


@pytest.fixture
def two_ranks():
    return shared_pool(2)


def _train(stage, chunk_bytes, clip=None, device="cpu", master_adam=True, **kwargs):
    model = mlp(device=hvd.device() if device == "cuda" else "cpu")
    with scoped_env(HOROVOD_ZERO_STEP_CHUNK_BYTES=chunk_bytes, HOROVOD_ZERO_MASTER_ADAM=int(master_adam)):
        opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=stage, **kwargs)
    chunks = []
    n, r = hvd.size(), hvd.rank()
    for step in range(STEPS):
        x, y = batch(step, 0, next(model.parameters()).device)
        mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        chunks.append((opt._step.chunked.chunks_last_step, opt._step.chunked.uncast_last_step))
        opt.zero_grad()
    opt.wait_for_params()
    with opt.gathered_params() if stage == 3 else contextlib.nullcontext():
        weights = [p.detach().clone() for p in model.parameters()]
    # In the parameters' order: the state is made in the order the shards are stepped.
    state = [v.clone() for g in opt.optimizer.param_groups for p in g["params"]
             for k, v in sorted(opt.optimizer.state[p].items()) if k != "step"]
    return weights, state, chunks


def _chunked_against_whole(stage, clip, kwargs, device="cpu", master_adam=True):
    """The chunk counts (and shards stepped uncast) of the whole and the chunked runs;
    per tensor (weights, exp_avg, exp_avg_sq) whether the two are equal, and their
    largest relative difference; the chunked weights' error against the reference."""
    whole_w, whole_s, whole_chunks = _train(stage, 0, clip, device, master_adam, **kwargs)
    w, s, chunks = _train(stage, 64, clip, device, master_adam, **kwargs)
    ref, _ = train_reference(1, clip)
    return (whole_chunks, chunks, [torch.equal(a, b) for a, b in zip(w + s, whole_w + whole_s)],
            max(rel_err(a, b) for a, b in zip(w + s, whole_w + whole_s)),
            max(rel_err(p, q) for p, q in zip(w, ref.parameters())))


@pytest.mark.parametrize("stage,clip,kwargs", [(1, None, {}), (2, None, {}), (2, 0.05, {}),
                                               (2, None, dict(overlap_param_gather=True)), (3, None, {})],
                         ids=["stage1", "stage2", "stage2-clip", "stage2-overlap-gather", "stage3"])
def test_the_step_in_chunks_gives_the_whole_steps_values_and_the_references(two_ranks, stage, clip, kwargs):
    for whole_chunks, chunks, same, _, err in two_ranks.run(_chunked_against_whole, stage, clip, kwargs):
        assert whole_chunks == [(0, 0)] * STEPS and all(c >= 3 for c, _ in chunks), (whole_chunks, chunks)
        assert all(same), same  # weights and exp_avg, exp_avg_sq: bit for bit
        assert err < 1e-5, err


def _hooks_and_schedulers(pre_hook):
    """A StepLR and a post-hook see each step; a pre-hook makes the step run whole and
    runs before it: setting lr to 0 leaves the weights as they were."""
    model = mlp()
    with scoped_env(HOROVOD_ZERO_STEP_CHUNK_BYTES=64):
        opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=2)
    if pre_hook:
        def no_step(o, args, kwargs):
            for g in o.param_groups:
                g["lr"] = 0.0
        opt.optimizer.register_step_pre_hook(no_step)
    before = [p.detach().clone() for p in model.parameters()]
    chunks = []
    hooked, order = scheduled_steps(model, opt, hvd.size(), hvd.rank(),
                                    after_step=lambda: chunks.append(opt._step.chunked.chunks_last_step))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return hooked, order, [g["lr"] for g in opt.param_groups], chunks, unchanged


def test_lr_schedulers_and_step_hooks_see_every_step_in_chunks(two_ranks):
    for hooked, order, lrs, chunks, unchanged in two_ranks.run(_hooks_and_schedulers, False):
        assert hooked == 2 and not order, (hooked, order)
        assert lrs == pytest.approx([1e-2 * 0.25, 2e-2 * 0.25]), lrs  # halved after each of the 2 steps
        assert all(c >= 3 for c in chunks) and not unchanged, chunks


def test_a_step_pre_hook_runs_before_a_step_made_whole(two_ranks):
    for hooked, order, lrs, chunks, unchanged in two_ranks.run(_hooks_and_schedulers, True):
        assert hooked == 2 and chunks == [0, 0], (hooked, chunks)
        assert unchanged  # the pre-hook's lr=0 reached every shard's update


def _order_of_the_step(stage, overlap):
    """The shards whose gradients the step takes late, in the order it takes them, the
    order their reductions were submitted in (each parameter a bucket of its own), and
    the shards of each call that gathers new parameters, in order."""
    model = mlp()
    with scoped_env(HOROVOD_ZERO_STEP_CHUNK_BYTES=64, HOROVOD_ZERO_BUCKET_BYTES=1):
        opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=stage,
                                           overlap_param_gather=overlap)
    sink, reducer = opt._step.sink, opt._reducer
    taken, submitted = [], []
    take, submit = sink.take_deferred, reducer._submit

    def take_spy(indices=None, raw=None):
        taken.extend(i for i in (sink.deferred if indices is None else indices) if i in sink.deferred)
        return take(indices, raw)

    def submit_spy(items):
        submitted.extend(s.index for s, _, _ in items if s.index not in submitted)
        submit(items)
    sink.take_deferred, reducer._submit = take_spy, submit_spy
    published, publish = [], opt._params.publish

    def publish_spy(wait, indices=None):
        if indices:
            published.append(list(indices))
        publish(wait, indices)
    opt._params.publish = publish_spy
    x, y = batch(0, 0, "cpu")
    mse(model, rank_rows(x, hvd.rank(), hvd.size()), rank_rows(y, hvd.rank(), hvd.size())).backward()
    opt.step()
    opt.zero_grad()
    return taken, submitted, published, len(opt._storage.shards)


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, False), (3, False), (2, True)],
                         ids=["stage1", "stage2", "stage3", "stage2-overlap-gather"])
def test_the_step_takes_the_gradients_in_the_order_they_were_reduced(two_ranks, stage, overlap):
    for taken, submitted, published, n in two_ranks.run(_order_of_the_step, stage, overlap):
        assert sorted(taken) == list(range(n)) and sorted(submitted) == list(range(n)), (taken, submitted)
        # Stage 1 reduces every gradient at step(), in the parameters' order; stages 2 and 3
        # as backward makes them, the last layer's first.
        assert taken == submitted, (taken, submitted)
        assert (submitted == list(range(n))) == (stage == 1), submitted
        if overlap or stage == 3:
            # One call after the last chunk, in the parameters' order: the next forward's
            # first units, which it waits for first, are gathered first (stage 3 gathers
            # each unit at the next forward).
            assert published == [list(range(n))], published
        else:  # each chunk's gather right after its step
            assert len(published) >= 3 and sum(published, []) == taken, (published, taken)


class _Mixed(torch.nn.Module):
    """A bf16 layer and an fp32 one in one param group: gradients of two dtypes in a chunk."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 33).to(torch.bfloat16)
        self.b = torch.nn.Linear(33, 7)

    def forward(self, x):
        return self.b(self.a(x.bfloat16()).float())


def _uncast_run(stage, uncast, whole_first, mixed):
    """Three steps; `whole_first`: the first runs whole (a step pre-hook), and the second
    follows without zero_grad(), as loops that zero after step() do."""
    model = _Mixed() if mixed else mlp()
    with stand_in_master_adam() if uncast else contextlib.nullcontext() as calls, \
            scoped_env(HOROVOD_ZERO_STEP_CHUNK_BYTES=64 if not mixed else 1200, HOROVOD_ZERO_MASTER_ADAM=int(uncast)):
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2) if mixed else adamw(model.named_parameters())
        opt = hvd.DistributedZeroOptimizer(inner, model=model, stage=stage)
        hook = opt.optimizer.register_step_pre_hook(lambda *a: None) if whole_first else None
        n, r = hvd.size(), hvd.rank()
        uncast_steps = []
        for step in range(3):
            x, y = batch(step, 0)
            mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
            opt.step()
            uncast_steps.append(opt._step.chunked.uncast_last_step)
            if hook is not None:
                hook.remove()
                hook = None
            else:
                opt.zero_grad()
        opt.wait_for_params()
        with opt.gathered_params() if stage == 3 else contextlib.nullcontext():
            weights = [p.detach().float().clone() for p in model.parameters()]
        counts = sorted({float(st["step"]) for st in opt.optimizer.state.values()})
        return weights, counts, uncast_steps, list(calls or [])


@pytest.mark.parametrize("stage,whole_first,mixed", [(2, False, False), (3, False, False), (2, True, False),
                                                     (2, False, True)],
                         ids=["stage2", "stage3", "stage2-whole-then-no-zero-grad", "stage2-bf16-and-fp32-in-a-group"])
def test_the_uncast_path_steps_each_shard_once_as_the_cast_path_does(two_ranks, stage, whole_first, mixed):
    cast = two_ranks.run(_uncast_run, stage, False, whole_first, mixed)
    uncast = two_ranks.run(_uncast_run, stage, True, whole_first, mixed)
    for (w0, counts0, u0, _), (w1, counts1, u1, calls) in zip(cast, uncast):
        assert not any(u0) and u1[-1] > 0 and calls, (u0, u1, calls)
        assert counts0 == counts1 == [3.0], (counts0, counts1)  # every shard stepped once a step
        assert all(torch.equal(a, b) for a, b in zip(w0, w1))  # the stand-in is torch's own kernel


def _hook_on_rank0_run(uncast, param_dtype):
    """Three steps of stage 2 where only rank 0's inner optimizer has a step pre-hook (a
    logging hook, say): that rank steps whole, the others in chunks (with `uncast`, from
    the stand-in kernel, which writes the bf16 parameters into their gathers' slots)."""
    model = mlp()
    with stand_in_master_adam() if uncast else contextlib.nullcontext(), \
            scoped_env(HOROVOD_ZERO_STEP_CHUNK_BYTES=64, HOROVOD_ZERO_MASTER_ADAM=int(uncast)):
        opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=2,
                                           param_dtype=getattr(torch, param_dtype) if param_dtype else None,
                                           cast_forward_inputs=param_dtype is not None)
        n, r = hvd.size(), hvd.rank()
        if r == 0:
            opt.optimizer.register_step_pre_hook(lambda *a: None)
        for step in range(3):
            x, y = batch(step, 0)
            y = rank_rows(y, r, n)
            mse(model, rank_rows(x, r, n), y.to(getattr(torch, param_dtype)) if param_dtype else y).backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_params()
        return [p.detach().clone() for p in model.parameters()], opt._step.chunked.chunks_last_step


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"], ids=["fp32", "bf16"])
def test_a_step_pre_hook_on_one_rank_leaves_the_collectives_agreeing(two_ranks, param_dtype):
    """Whether a shard is reduced as a Sum (its mean applied by the uncast step), and what its
    gather reads (a bf16 slot the step wrote), are decided from what every rank shares, so a
    hook that makes one rank step whole changes no op and no dtype."""
    cast = two_ranks.run(_hook_on_rank0_run, False, param_dtype)
    uncast = two_ranks.run(_hook_on_rank0_run, True, param_dtype)
    for r, ((w0, _), (w1, chunks)) in enumerate(zip(cast, uncast)):
        assert (chunks == 0) == (r == 0), (r, chunks)
        for a, b in zip(w0, w1):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
