"""Optimizer offload (offload_optimizer="cpu", offload_params="cpu") over 2 and 3
CPU ranks against a single-process torch reference of the same maths, for stages
1-3, AdamW and SGD; checkpoints between offloaded and not offloaded jobs of other
sizes; and the argument errors. On a machine without GPUs the parameters' device is
the host too, so these run the offload code paths (host shards, the sink that takes
reduced gradients, the gather source, the steppers) without the copies; the GPU
tests (test/gpu/test_gpu_offload.py) run the same workers on CUDA."""

import contextlib
import copy
import os
import threading
import time

import pytest
import torch

import horovod_zero.torch as hvd
from horovod_zero import _core
from harness import launch, scoped_env
from refs import (GLOBAL_BATCH, STEPS, Tied, adamw, batch, mlp, mse, rank_rows, rel_err, scheduled_steps, tied_batch,
                  train_reference)


def _on(device):
    return hvd.device() if device == "cuda" else torch.device(device)


def _inner(kind, model):
    if kind == "adamw":
        return adamw(model.named_parameters())
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def _wrap(model, kind, stage, **kwargs):
    if stage == 3:
        kwargs.setdefault("units", [torch.nn.Linear])
    return hvd.DistributedZeroOptimizer(_inner(kind, model), model=model, stage=stage, **kwargs)


def _train(model, opt, passes, clip, steps=STEPS, start=0):
    n, r = hvd.size(), hvd.rank()
    dev = next(model.parameters()).device
    for step in range(start, start + steps):
        for micro in range(passes):
            x, y = batch(step, micro, dev)
            mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()


def _weights(model, opt):
    """The model's full fp32-comparable weights (gathered at stage 3)."""
    if opt.stage == 3:
        with opt.gathered_params():
            return [p.detach().double().cpu().clone() for p in model.parameters()]
    return [p.detach().double().cpu().clone() for p in model.parameters()]


def _reference(kind, passes, clip, steps=STEPS):
    model = mlp()
    ref, _ = train_reference(passes, clip, steps=steps, model=model, opt=_inner(kind, model))
    return [p.detach().double() for p in ref.parameters()]


def _parity(stage, kind, offload_params=None, device="cpu", nvme_path=None):
    """(mode, max relative error, ...) for plain steps, clipping and 2 backward passes per step."""
    out = []
    where = dict(offload_optimizer="nvme", nvme_path=nvme_path) if nvme_path else dict(offload_optimizer="cpu")
    for mode, passes, clip in (("plain", 1, None), ("clip", 1, 0.05), ("bpps2", 2, None)):
        model = mlp(device=_on(device))
        opt = _wrap(model, kind, stage, backward_passes_per_step=passes, offload_params=offload_params, **where)
        _train(model, opt, passes, clip)
        errs = [rel_err(p, q) for p, q in zip(_weights(model, opt), _reference(kind, passes, clip))]
        out.append((mode, max(errs), opt.offload_stats()["step"],
                    {k for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0
                     and v.device.type != "cpu"}))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_offloaded_optimizer_matches_single_process_reference(ranks, stage, kind):
    for rank_out in ranks.run(_parity, stage, kind):
        for mode, err, step, state_off_host in rank_out:
            assert err < 1e-5, (mode, err)
            assert not state_off_host, state_off_host  # optimizer state lives on the host
            if kind == "sgd":
                assert step == "torch SGD.step()", step


def test_stage3_with_parameters_offloaded_matches_reference(ranks):
    for rank_out in ranks.run(_parity, 3, "adamw", "cpu"):
        for mode, err, _, _ in rank_out:
            assert err < 1e-5, (mode, err)


def _parity_in_small_chunks(stage, overlap):
    """_parity with the host step cut into chunks of a parameter or two, each gathered
    while the next is stepped: every rank must make the same chunks."""
    from horovod_zero.torch.zero.offload import host_step, overlap as worker
    host_step._CHUNK_NUMEL = 40  # the four parameters' shards (4 to 264 elements): three chunks
    worker._BATCH_NUMEL = 40  # and overlap_step's worker takes a backlog in batches that size
    if not overlap:
        return _parity(stage, "adamw")
    os.environ["HOROVOD_ZERO_OVERLAP_STEP_THREADS"] = "2"  # two threads taking a batch's shards unit by unit
    model = mlp()
    opt = _wrap(model, "adamw", stage, offload_optimizer="cpu", overlap_step=True)
    del os.environ["HOROVOD_ZERO_OVERLAP_STEP_THREADS"]  # read at construction
    _train(model, opt, 1, None)
    return [("overlap", max(rel_err(p, q) for p, q in zip(_weights(model, opt), _reference("adamw", 1, None))),
             opt._step.sink.threads, set())]


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, False), (2, True), (3, False)])
def test_host_step_in_chunks_matches_reference(ranks, stage, overlap):
    for rank_out in ranks.run(_parity_in_small_chunks, stage, overlap):
        for mode, err, threads, _ in rank_out:
            assert err < 1e-5, (mode, err)
            if mode == "overlap":
                assert threads == 2, threads  # HOROVOD_ZERO_OVERLAP_STEP_THREADS


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_offload_matches_single_process_reference(ranks, stage, tmp_path):
    for rank_out in ranks.run(_parity, stage, "adamw", "cpu" if stage == 3 else None, "cpu", str(tmp_path)):
        for mode, err, step, _ in rank_out:
            assert err < 1e-5, (mode, err)
            assert step.endswith("on NVMe"), step


def _nvme_bytes(path):
    """Disk bytes of one step against the state's size, and the state after a round trip
    through state_dict (which reads it from disk) into a CPU-offloaded optimizer."""
    model = mlp()
    opt = _wrap(model, "adamw", 2, offload_optimizer="nvme", nvme_path=path)
    _train(model, opt, 1, None, steps=1)
    before = opt.offload_stats()
    _train(model, opt, 1, None, steps=1, start=1)
    after = opt.offload_stats()
    state = opt._step.nvme._swapper.state_bytes
    per_step = (after["disk_read_bytes"] - before["disk_read_bytes"],
                after["disk_write_bytes"] - before["disk_write_bytes"])
    saved = copy.deepcopy(opt.state_dict())
    model2 = mlp(seed=9)
    opt2 = _wrap(model2, "adamw", 2, offload_optimizer="cpu")
    opt2.load_state_dict(saved)
    _train(model, opt, 1, None, steps=1, start=2)
    _train(model2, opt2, 1, None, steps=1, start=2)
    same = max(rel_err(p, q) for p, q in zip(model2.parameters(), model.parameters()))
    files = sorted(f for f in os.listdir(opt._step.nvme._swapper.directory) if f.endswith(".swp"))
    opt._step.nvme.close()
    return per_step, state, same, files


def test_nvme_step_reads_and_writes_the_state_once_and_never_the_gradients(ranks, tmp_path):
    for (read, written), state, same, files in ranks.run(_nvme_bytes, str(tmp_path)):
        assert read == state and written == state, (read, written, state)
        assert same == 0.0, same
        assert files == ["exp_avg.swp", "exp_avg_sq.swp", "master.swp"], files  # no gradient file


def _overlap(stage, device="cpu", offload="cpu"):
    """offload=None: overlap_step on the device (core/early_step.py)."""
    model = mlp(device=_on(device))
    opt = _wrap(model, "adamw", stage, offload_optimizer=offload, overlap_step=True)
    _train(model, opt, 1, None)
    errs = [rel_err(p, q) for p, q in zip(_weights(model, opt), _reference("adamw", 1, None))]
    # What overlap_step refuses: clipping after the step ran, a second reduction in one step.
    n, r = hvd.size(), hvd.rank()
    x, y = batch(0, 0, _on(device))
    mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
    refused = []
    try:
        opt.clip_grad_norm_(1.0)
    except RuntimeError as e:
        refused.append(str(e))
    try:
        opt.state_dict()
    except RuntimeError as e:
        refused.append(str(e))
    try:
        mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
        opt.step()
    except RuntimeError as e:
        refused.append(str(e))
    try:
        opt.zero_grad()
    except RuntimeError as e:  # when the first of those backward passes stepped shards already
        if "cannot be skipped" not in str(e):
            raise
    return max(errs), refused


@pytest.mark.parametrize("offload", ["cpu", None], ids=["host", "device"])
@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_step_matches_reference_and_refuses_what_it_cannot_do(ranks, stage, offload):
    for err, refused in ranks.run(_overlap, stage, "cpu", offload):
        assert err < 1e-5, err
        assert len(refused) == 3, refused
        assert "overlap_step=False to clip" in refused[0]
        assert "would mix two steps" in refused[1]
        assert "reduced a second time in one step" in refused[2]


def _halving(opt):
    """A learning rate halved after every step: the scheduler runs while the host step of
    the step before may still be going on."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _tied_loss(model, step, lo, hi, dev):
    ids, target = tied_batch(step, dev)
    out = model(ids[lo:hi]).reshape(-1, 11)
    return torch.nn.functional.cross_entropy(out, target.reshape(-1, 5)[lo:hi].reshape(-1))


def _overlap_forward(model_name, device="cpu", stage=2, offload_params=None):
    """overlap_param_gather with overlap_step: step() returns before the host step ends and
    each module's forward waits for its own parameters. Against plain torch with the same
    schedule; then what a read outside forward must do first."""
    n, r = hvd.size(), hvd.rank()
    lo, hi = r * GLOBAL_BATCH // n, (r + 1) * GLOBAL_BATCH // n
    make = (lambda dev: Tied(dev)) if model_name == "tied" else (lambda dev: mlp(device=dev))
    if model_name == "tied":
        inner = lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        loss = lambda m, step, lo, hi: _tied_loss(m, step, lo, hi, next(m.parameters()).device)
    else:
        inner = lambda m: adamw(m.named_parameters())
        loss = lambda m, step, lo, hi: mse(m, *(t[lo:hi].to(next(m.parameters()).device) for t in batch(step, 0)))
    model = make(_on(device))
    opt = hvd.DistributedZeroOptimizer(inner(model), model=model, stage=stage, offload_optimizer="cpu",
                                       offload_params=offload_params, overlap_step=True, overlap_param_gather=True,
                                       units=[torch.nn.Linear])
    sched = _halving(opt.optimizer)
    for step in range(STEPS):
        loss(model, step, lo, hi).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    # Right after step(): the checkpoint waits for the last host step (the masters), and so
    # does model.state_dict() (the parameters).
    full = hvd.zero.consolidated_state_dict(model, opt)
    with opt.gathered_params() if stage == 3 else contextlib.nullcontext():
        state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = make("cpu")
    ref_opt = inner(ref)
    ref_sched = _halving(ref_opt)
    for step in range(STEPS):
        loss(ref, step, 0, GLOBAL_BATCH).backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
    err = max(rel_err(state[k], v) for k, v in ref.state_dict().items())
    if full is not None:  # rank 0
        err = max([err] + [rel_err(full["model"][k], v) for k, v in ref.state_dict().items()])
    return err, len(opt._step.sink.position)


@pytest.mark.parametrize("model_name,stage,offload_params", [("mlp", 2, None), ("tied", 2, None), ("mlp", 3, None),
                                                              ("mlp", 3, "cpu")])
def test_overlap_param_gather_with_overlap_step_matches_torch(ranks, model_name, stage, offload_params):
    for err, positions in ranks.run(_overlap_forward, model_name, "cpu", stage, offload_params):
        assert err < 1e-5, err
        assert positions > 0  # the forward hooks set the order the worker steps in


class _Attn(torch.nn.Module):
    """MultiheadAttention reads out_proj's weights without calling out_proj."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.inp = torch.nn.Linear(16, 16)
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 7)

    def forward(self, x):
        h = self.inp(x).reshape(x.shape[0], 2, 8)
        return self.out(self.mha(h, h, h, need_weights=False)[0].reshape(x.shape[0], 16))


def _attn_forward(units):
    n, r = hvd.size(), hvd.rank()
    lo, hi = r * GLOBAL_BATCH // n, (r + 1) * GLOBAL_BATCH // n
    model, ref = _Attn(), _Attn()
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, stage=2,
                                       offload_optimizer="cpu", overlap_step=True, overlap_param_gather=True,
                                       units=units)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step, 0)
        mse(model, x[lo:hi], y[lo:hi]).backward()
        opt.step()
        opt.zero_grad()
        mse(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = model.state_dict()
    # in_proj_bias's key part has a zero gradient: Adam makes rounding noise of it.
    return max(rel_err(got[k], v) for k, v in ref.state_dict().items() if k != "mha.in_proj_bias")


@pytest.mark.parametrize("units", [None, [torch.nn.MultiheadAttention]], ids=["root", "units"])
def test_overlap_param_gather_waits_for_weights_a_module_reads_without_calling(ranks, units):
    # A unit waits for every parameter under it: MultiheadAttention's forward reads out_proj's.
    for err in ranks.run(_attn_forward, units):
        assert err < 1e-5, err


class _Branch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.a, self.b, self.c = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 7)

    def forward(self, x, use_b):
        h = self.a(x)
        return self.c(self.b(h) if use_b else h)


def _wrap_branch(model, overlap_param_gather=True):
    return hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, stage=2,
                                        offload_optimizer="cpu", overlap_step=True,
                                        overlap_param_gather=overlap_param_gather,
                                        units=[torch.nn.Linear] if overlap_param_gather else None)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _across_ranks(model):
    """The largest difference between this rank's parameters and the others'."""
    flat = _flat(model)
    return float((hvd.allgather(flat[None]) - flat).abs().max())


def _late_worker(opt, shards=None):
    """On every rank but 0 the worker sleeps before it steps any of `shards` (all: None)."""
    step_now = opt._step.host.step

    def step_late(indices, *args, **kwargs):
        if (hvd.rank() != 0 and (shards is None or shards & set(indices))
                and threading.current_thread().name == "hvdz-offload-step"):
            time.sleep(0.5)
        return step_now(indices, *args, **kwargs)

    opt._step.host.step = step_late


def _train_branching(model, opt):
    """Three steps in which only rank 0 runs `b` after the first."""
    n, r = hvd.size(), hvd.rank()
    dev = next(model.parameters()).device
    for step in range(3):
        x, y = (t[r::n].to(dev) for t in batch(step, 0))
        torch.nn.functional.mse_loss(model(x, step == 0 or r == 0), y).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    return _across_ranks(model)


def _branching_ranks():
    """Ranks whose forwards run different modules (as with LayerDrop or experts without
    tokens): every rank still gathers every parameter, and they end equal."""
    model = _Branch()
    return _train_branching(model, _wrap_branch(model))


def test_overlap_param_gather_with_ranks_running_different_modules(ranks):
    assert all(diff == 0.0 for diff in ranks.run(_branching_ranks))


def _late_worker_for_the_skipped_branch(device="cpu"):
    """As _branching_ranks, with every rank but 0 stepping `b` late: its forward skips `b`,
    so nothing waits for b's deferred step, and its next backward begins first. That
    step's gather was still owed to rank 0, whose forward waits for it; a worker that held
    it back with the new backward's early steps until the next step() hung both ranks."""
    model = _Branch().to(_on(device))
    _slow_backward(model)  # a and c are stepped early, so step() defers b alone
    with scoped_env(HOROVOD_ZERO_BUCKET_BYTES=1):
        opt = _wrap_branch(model)
    _late_worker(opt, {s.index for s in opt.sharded_state.shards if s.name.startswith("b.")})
    return _train_branching(model, opt)


def test_a_late_step_of_a_branch_this_rank_skipped_is_still_gathered(ranks):
    assert all(diff == 0.0 for diff in ranks.run(_late_worker_for_the_skipped_branch, timeout=60))


def _step_again_after_a_refusal(overlap_param_gather):
    """step() refused (the learning rate changed after backward), the rate set back and
    step() called again, as the message says: the weights are those of a step never
    refused. The refused call must not have taken the gradients: the retry then found
    none and stepped only the shards stepped early, and (rank 0 alone runs b) with
    overlap_param_gather gathered b on rank 0 only and hung."""
    n, r = hvd.size(), hvd.rank()
    weights, refused = [], None
    for refuse in (False, True):
        model = _Branch()
        opt = _wrap_branch(model, overlap_param_gather)
        x, y = (t[r::n] for t in batch(0, 0))
        torch.nn.functional.mse_loss(model(x, r == 0), y).backward()
        if refuse:
            lr = opt.param_groups[0]["lr"]
            opt.param_groups[0]["lr"] = lr / 10
            try:
                opt.step()
            except RuntimeError as e:
                refused = str(e)
            opt.param_groups[0]["lr"] = lr
        opt.step()
        opt.zero_grad()
        opt.wait_for_params()
        weights.append(_flat(model))
    return refused, float((weights[1] - weights[0]).abs().max()), _across_ranks(model)


@pytest.mark.parametrize("overlap_param_gather", [False, True], ids=["overlap_step", "overlap_param_gather"])
def test_step_called_again_after_a_refused_one_steps_every_shard(ranks, overlap_param_gather):
    for refused, diff, across in ranks.run(_step_again_after_a_refusal, overlap_param_gather, timeout=60):
        assert refused is not None and "changed before step()" in refused, refused
        assert diff == 0.0 and across == 0.0, (diff, across)


def _grads_set_by_hand():
    """Gradients from torch.autograd.grad set as p.grad, so no backward hook runs, with a
    late worker on every rank but 0: as many steps through backward give the same weights.
    The worker held back the gathers of shards it stepped after step() for good (their
    step had not begun in its eyes), and rank 0's next forward waited for them."""
    n, r = hvd.size(), hvd.rank()
    weights = []
    for by_hand in (False, True):
        model = mlp()
        opt = _wrap(model, "adamw", 2, offload_optimizer="cpu", overlap_step=True, overlap_param_gather=True,
                    units=[torch.nn.Linear])
        if by_hand:
            _late_worker(opt)
        params = list(model.parameters())
        for step in range(3):
            x, y = batch(step, 0)
            loss = mse(model, rank_rows(x, r, n), rank_rows(y, r, n))
            if by_hand:
                for p, g in zip(params, torch.autograd.grad(loss, params)):
                    p.grad = g
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
        opt.wait_for_params()
        weights.append(_flat(model))
    return float((weights[1] - weights[0]).abs().max()), _across_ranks(model)


def test_gradients_set_by_hand_are_stepped_and_gathered(ranks):
    for diff, across in ranks.run(_grads_set_by_hand, timeout=60):
        assert diff < 1e-6 and across == 0.0, (diff, across)


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.inp = torch.nn.Linear(16, 16)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
        self.out = torch.nn.Linear(16, 7)

    def forward(self, x, k):
        return self.out(self.experts[k](self.inp(x)))


def _own_experts():
    """Each rank routes to its own expert (top-1 routing, LayerDrop with a per-rank RNG):
    every rank has gradients the others have none for, and steps them early."""
    os.environ["HOROVOD_ZERO_BUCKET_BYTES"] = "1"
    n, r = hvd.size(), hvd.rank()
    model = _Experts()
    _slow_backward(model)
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, stage=2,
                                       offload_optimizer="cpu", overlap_step=True, overlap_param_gather=True)
    for step in range(3):
        x, y = batch(step, 0)
        torch.nn.functional.mse_loss(model(x[r::n], r % 3), y[r::n]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    del os.environ["HOROVOD_ZERO_BUCKET_BYTES"]  # the pool's processes run other tests after
    return _across_ranks(model)


def test_overlap_param_gather_with_ranks_stepping_different_shards_early(ranks):
    assert all(diff == 0.0 for diff in ranks.run(_own_experts))


def _stale_hybrid():
    hvd.init()
    model = mlp()
    opt = _wrap(model, "adamw", 2, offload_optimizer="cpu", overlap_step=True, overlap_param_gather=True,
                units=[torch.nn.Linear], shard_group="node")
    n, r = hvd.size(), hvd.rank()
    x, y = batch(0, 0)
    stale = lambda x: torch.nn.functional.linear(model[1](model[0](x)), model[2].weight, model[2].bias)
    refused = None
    try:
        for _ in range(2):
            torch.nn.functional.mse_loss(stale(rank_rows(x, r, n)), rank_rows(y, r, n)).backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        refused = str(e)
    # Every rank refuses at the same point, with no collective left open: they all get here.
    # Without it, the first to return exits, and a slower rank still in the step's last
    # collective is told that rank shut down instead of why.
    hvd.allreduce(torch.zeros(1), name="stale_hybrid.done")
    return refused


def test_stale_forward_is_refused_with_hybrid_sharding():
    # 4 ranks as 2 nodes of 2: shards are stepped at step(), after the cross-node average.
    env = lambda rank: {"LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2)}
    out = launch(_stale_hybrid, 4, env=env, timeout=120)
    for status, msg in out.values():
        assert status == "ok" and msg is not None and "before its last update" in msg, out


def _slow_backward(model):
    """Each gradient hook sleeps, so that reductions finish, and shards are stepped, while
    backward still runs (on the CPU it is otherwise over before any is done)."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: __import__("time").sleep(0.02))


def _skip_and_stale():
    os.environ["HOROVOD_ZERO_BUCKET_BYTES"] = "1"  # one reduction per parameter
    n, r = hvd.size(), hvd.rank()
    out = {}
    model = mlp()
    _slow_backward(model)
    opt = _wrap(model, "adamw", 2, offload_optimizer="cpu", overlap_step=True)
    x, y = batch(0, 0)
    mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
    out["early"] = len(opt._step.sink.stepped)
    try:
        opt.zero_grad()  # skipping a step whose host step has begun
    except RuntimeError as e:
        out["skip"] = str(e)
    try:
        opt.state_dict()  # some shards of it stepped, others not
    except RuntimeError as e:
        out["state"] = str(e)
    opt.step()
    out["state_after_step"] = sorted(opt.state_dict())
    # Refused where no shard was stepped early too (one large bucket, reduced at step()): the
    # ranks must agree whatever their timing.
    del os.environ["HOROVOD_ZERO_BUCKET_BYTES"]
    model = mlp()
    opt = _wrap(model, "adamw", 2, offload_optimizer="cpu", overlap_step=True)
    mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
    try:
        opt.zero_grad()
    except RuntimeError as e:
        out["skip2"] = str(e)
    opt.step()
    # A forward that reads a unit's weight without calling the unit reads it stale.
    model = mlp()
    opt = _wrap(model, "adamw", 2, offload_optimizer="cpu", overlap_step=True, overlap_param_gather=True,
                units=[torch.nn.Linear])
    stale = lambda x: torch.nn.functional.linear(model[1](model[0](x)), model[2].weight, model[2].bias)
    for step in range(2):
        try:
            torch.nn.functional.mse_loss(stale(rank_rows(x, r, n)), rank_rows(y, r, n)).backward()
            opt.step()
        except RuntimeError as e:
            out["stale"] = str(e)
            break
    return out


def test_offload_refuses_a_skipped_step_a_state_read_mid_step_and_a_stale_forward(ranks):
    for out in ranks.run(_skip_and_stale):
        assert out["early"] > 0, out  # the scenario happened: shards stepped during backward
        assert "cannot be skipped" in out.get("skip", ""), out
        assert "would mix two steps" in out.get("state", "") and out["state_after_step"], out
        assert "cannot be skipped" in out.get("skip2", ""), out
        assert "Parameter '2." in out.get("stale", "") and "wait_for_params()" in out["stale"], out


def _lr_changed_after_backward(offload):
    model = mlp()
    opt = _wrap(model, "adamw", 2, offload_optimizer=offload, overlap_step=True)
    n, r = hvd.size(), hvd.rank()
    x, y = batch(0, 0)
    mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
    opt.param_groups[1]["lr"] = 1e-3  # too late: the host step began during backward
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("offload", ["cpu", None], ids=["host", "device"])
def test_overlap_step_refuses_a_learning_rate_changed_after_backward(ranks, offload):
    for msg in ranks.run(_lr_changed_after_backward, offload):
        assert msg is not None and "param group(s) [1]" in msg and "scheduler.step() right after" in msg, msg


def _scheduler_sees_each_step(kwargs):
    """overlap_step on the device, and the C++ Adam of offload, step the shards themselves;
    the inner optimizer's step() still runs once per step, so an LR scheduler and a step
    hook see every step."""
    model = mlp()
    opt = _wrap(model, "adamw", 2, **kwargs)
    hooked, order = scheduled_steps(model, opt, hvd.size(), hvd.rank())
    return hooked, order, [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("kwargs", [dict(overlap_step=True), dict(offload_optimizer="cpu"),
                                    dict(offload_optimizer="cpu", overlap_step=True)],
                         ids=["device-overlap", "offload", "offload-overlap"])
def test_lr_schedulers_and_step_hooks_see_every_step_when_zero_steps_the_shards(ranks, kwargs):
    for hooked, order, lrs in ranks.run(_scheduler_sees_each_step, kwargs):
        assert hooked == 2 and not order, (hooked, order)
        assert lrs == pytest.approx([1e-2 * 0.25, 2e-2 * 0.25]), lrs  # halved after each of the 2 steps


def _where(offload, path):
    """offload: False, True (CPU) or "nvme" (files next to the checkpoint)."""
    if offload == "nvme":
        return dict(offload_optimizer="nvme", nvme_path=os.path.dirname(path))
    return dict(offload_optimizer="cpu" if offload else None)


def _save(path, steps, offload, stage):
    hvd.init()
    model = mlp()
    opt = _wrap(model, "adamw", stage, **_where(offload, path))
    _train(model, opt, 1, None, steps=steps)
    hvd.zero.save_checkpoint(path, model, opt)
    hvd.shutdown()


def _resume(path, steps, start, offload, stage):
    hvd.init()
    model = mlp(seed=123)  # different weights: the checkpoint must replace them
    opt = _wrap(model, "adamw", stage, **_where(offload, path))
    hvd.zero.load_checkpoint(path, model, opt)
    _train(model, opt, 1, None, steps=steps, start=start)
    out = [w.tolist() for w in _weights(model, opt)]  # plain lists: the process exits
    hvd.shutdown()
    return out


@pytest.mark.parametrize("saved,loaded", [((2, True, 2), (3, False, 2)), ((3, False, 3), (2, True, 3)),
                                          ((2, True, 3), (3, True, 2)), ((2, "nvme", 2), (3, "nvme", 3))],
                         ids=["offloaded2-to-plain3", "plain3-to-offloaded2", "offloaded-stage3-to-stage2",
                              "nvme2-to-nvme3-stage3"])
def test_checkpoints_move_between_offloaded_and_not_and_across_sizes(tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt.pt")
    res = launch(_save, saved[0], path, 2, saved[1], saved[2], timeout=120)
    assert all(s == "ok" for s, _ in res.values()), res
    res = launch(_resume, loaded[0], path, 2, 2, loaded[1], loaded[2], timeout=120)
    assert all(s == "ok" for s, _ in res.values()), res
    ref = _reference("adamw", 1, None, steps=4)
    for r in range(loaded[0]):
        for w, q in zip(res[r][1], ref):
            assert rel_err(torch.tensor(w, dtype=torch.float64), q) < 1e-5


def _shard_round_trip():
    """state_dict() of an offloaded optimizer loads into a fresh one, which then trains on
    exactly as the first would have."""
    model = mlp()
    opt = _wrap(model, "adamw", 2, offload_optimizer="cpu")
    _train(model, opt, 1, None, steps=2)
    saved = copy.deepcopy(opt.state_dict())  # as a save to disk: torch's state_dict() shares the state tensors
    model2 = mlp(seed=5)
    opt2 = _wrap(model2, "adamw", 2, offload_optimizer="cpu")
    opt2.load_state_dict(saved)
    _train(model, opt, 1, None, steps=2, start=2)
    _train(model2, opt2, 1, None, steps=2, start=2)
    return max(rel_err(p, q) for p, q in zip(model2.parameters(), model.parameters()))


def test_per_rank_state_dict_round_trip_with_offload(ranks):
    assert all(err == 0.0 for err in ranks.run(_shard_round_trip))


def _bad_offload_args():
    model = mlp()
    errors = {}
    cases = {
        "unknown": dict(offload_optimizer="gpu"),
        "nvme_no_path": dict(offload_optimizer="nvme"),
        "path_no_nvme": dict(offload_optimizer="cpu", nvme_path="/tmp"),
        "params_stage2": dict(stage=2, offload_optimizer="cpu", offload_params="cpu"),
        "params_alone": dict(stage=3, offload_params="cpu"),
        "overlap_device_sgd": dict(overlap_step=True, sgd=True),
        "overlap_device_gather3": dict(stage=3, overlap_step=True, overlap_param_gather=True),
        "overlap_stage1": dict(stage=1, offload_optimizer="cpu", overlap_step=True),
        "overlap_fp16": dict(offload_optimizer="cpu", overlap_step=True, param_dtype=torch.float16),
        "overlap_sgd": dict(offload_optimizer="cpu", overlap_step=True, sgd=True),
        "nvme_sgd": dict(offload_optimizer="nvme", nvme_path="/tmp", sgd=True),
        "nvme_missing": dict(offload_optimizer="nvme", nvme_path="/nonexistent/hvdz"),
        "nvme_overlap": dict(offload_optimizer="nvme", nvme_path="/tmp", overlap_step=True),
        "gather_no_overlap_step": dict(offload_optimizer="cpu", overlap_param_gather=True),
    }
    for key, kwargs in cases.items():
        kwargs = dict(kwargs)
        stage = kwargs.pop("stage", 2)
        kind = "sgd" if kwargs.pop("sgd", False) else "adamw"
        try:
            _wrap(model, kind, stage, **kwargs)
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
        model = mlp()  # a refused wrap may not have touched it, but start clean
    return errors


def test_offload_argument_errors_say_what_to_do(ranks):
    for errors in ranks.run(_bad_offload_args):
        expect = {"unknown": "use None, 'cpu'", "nvme_no_path": "needs nvme_path=", "path_no_nvme": "only used with",
                  "params_stage2": "is for stage=3", "params_alone": "needs offload_optimizer",
                  "overlap_device_sgd": "Use overlap_step=False",
                  "overlap_device_gather3": "Leave overlap_param_gather=False", "overlap_stage1": "needs stage=2 or 3",
                  "overlap_fp16": "loss scaling", "overlap_sgd": "Use overlap_step=False",
                  "nvme_sgd": "Use offload_optimizer='cpu' for other optimizers",
                  "nvme_missing": "/nonexistent/hvdz", "nvme_overlap": "is for offload_optimizer='cpu'",
                  "gather_no_overlap_step": "needs overlap_step=True"}
        for key, text in expect.items():
            assert errors[key] is not None and text in errors[key], (key, errors[key])


def _nvme_aio(path):
    hvd.init()
    try:
        model = mlp()
        opt = _wrap(model, "adamw", 2, offload_optimizer="nvme", nvme_path=path)
        return {name: (f.queue_depth, f.request_bytes) for name, f in opt._step.nvme._swapper._files.items()}
    except ValueError as e:
        return str(e)
    finally:
        hvd.shutdown()


@pytest.mark.skipif(not getattr(_core, "HAVE_LIBURING", False), reason="this build has no liburing")
def test_nvme_queue_depth_and_request_size_come_from_the_environment(tmp_path):
    res = launch(_nvme_aio, 1, str(tmp_path),
                 env={"HOROVOD_ZERO_NVME_QUEUE_DEPTH": "3", "HOROVOD_ZERO_NVME_REQUEST_BYTES": "65536"})
    status, files = res[0]
    assert status == "ok", files
    assert files == {name: (3, 65536) for name in ("master", "exp_avg", "exp_avg_sq")}, files
    status, err = launch(_nvme_aio, 1, str(tmp_path), env={"HOROVOD_ZERO_NVME_QUEUE_DEPTH": "0"})[0]
    assert status == "error" and "HOROVOD_ZERO_NVME_QUEUE_DEPTH='0'" in err, err  # refused by init()
