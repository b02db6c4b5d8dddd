"""DistributedZeroOptimizer (stages 1 and 2) over 2 and 3 CPU ranks against a
single-process reference run of the same math on the concatenated batch."""

import contextlib
import os

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch, scoped_env
from refs import GLOBAL_BATCH, STEPS, Tied, adamw, batch, mlp, mse, rank_rows, rel_err, tied_batch, train_reference

# The workers below take `device`: "cpu" here; the GPU tests (test/gpu/test_gpu_zero.py)
# run the same workers with "cuda", this rank's GPU. References are always on the CPU.


def _on(device):
    return hvd.device() if device == "cuda" else torch.device(device)


def _wrap(model, **kwargs):
    return hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, **kwargs)


def _train(model, opt, passes, mode, clip, steps=STEPS, start=0, before_step=None):
    """This rank's share of train_reference(): its rows of each batch, on the model's device."""
    n, r = hvd.size(), hvd.rank()
    dev = next(model.parameters()).device
    counts = []
    for step in range(start, start + steps):
        hvd.collective_stats(reset=True)
        ctx = opt.coalesce_grad_reduction() if mode == "coalesce" else contextlib.nullcontext()
        with ctx:
            for micro in range(passes):
                x, y = batch(step, micro, dev)
                mse(model, rank_rows(x, r, n), rank_rows(y, r, n)).backward()
        if clip:
            opt.clip_grad_norm_(clip)
        if before_step:
            before_step()
        opt.step()
        opt.zero_grad()
        counts.append(sum(s["tensors"] for s in hvd.collective_stats() if s["op"] == "reducescatter"))
    return counts


def _check_against_reference(stage, mode, clip, device="cpu"):
    passes = {"plain": 1, "bpps": 2, "coalesce": 4, "perpass": 3}[mode]
    model = mlp(device=_on(device))
    opt = _wrap(model, stage=stage, backward_passes_per_step=passes if mode == "bpps" else 1)
    counts = _train(model, opt, passes, mode, clip)
    ref, _ = train_reference(passes, clip)
    errs = {n: rel_err(p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    state_numel = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k == "exp_avg")
    return errs, counts, state_numel


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mode,clip", [("plain", None), ("bpps", None), ("coalesce", None), ("perpass", None),
                                       ("plain", 0.05)],
                         ids=["plain", "backward_passes_per_step2", "coalesce4", "3passes_uncoalesced", "clip"])
def test_matches_single_process_reference(ranks_fusion, stage, mode, clip):
    nparams = 4
    total = sum(p.numel() for p in mlp().parameters())
    shard_total = sum(-(-p.numel() // ranks_fusion.size) for p in mlp().parameters())
    for errs, counts, state_numel in ranks_fusion.run(_check_against_reference, stage, mode, clip):
        for name, e in errs.items():
            assert e < 1e-5, (name, e)
        # One reduce-scatter per parameter per step, however many backward passes; except
        # stage 2 without coalescing, which reduces after every backward pass.
        per_step = nparams * (3 if (mode, stage) == ("perpass", 2) else 1)
        assert counts == [per_step] * STEPS, counts
        # Optimizer state is sharded: total / size, plus padding.
        assert state_numel == shard_total and state_numel < total


def _bucketed(bucket_bytes, passes):
    with scoped_env(HOROVOD_ZERO_BUCKET_BYTES=bucket_bytes):
        model = mlp()
        opt = _wrap(model, stage=2)
    collectives, before_step = [], []

    def submitted_and_held():  # after the step's last backward pass, before step()
        red = opt._reducer  # submitted: still running, or finished and taken at a flush
        submitted = sum(len(h) for h in red._pending.values()) + sum(len(d) for d in red._done.values())
        before_step.append((submitted, len(red._bucket)))

    for step in range(STEPS):
        hvd.collective_stats(reset=True)
        _train(model, opt, passes, "perpass" if passes > 1 else "plain", None, steps=1, start=step,
               before_step=submitted_and_held)
        collectives.append(sum(s["collectives"] for s in hvd.collective_stats() if s["op"] == "reducescatter"))
    ref, _ = train_reference(passes, None)
    return collectives, before_step, [rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 30])
@pytest.mark.parametrize("passes", [1, 3])
def test_stage2_gradient_buckets(ranks, bucket_bytes, passes):
    """A bucket larger than the model holds every gradient of the step (of every
    backward pass) until step(), then sends them as one fused collective; 0 sends
    each as it is ready. Both match the reference."""
    nparams = 4
    for collectives, before_step, errs in ranks.run(_bucketed, bucket_bytes, passes):
        assert all(e < 1e-5 for e in errs), errs
        if bucket_bytes:
            assert collectives == [1] * STEPS, collectives
            assert before_step == [(0, nparams * passes)] * STEPS, "the bucket must hold them until step()"
        else:
            assert before_step == [(nparams * passes, 0)] * STEPS, "each gradient must go when it is ready"


def _dropped_optimizer_is_freed(overlap):
    import gc
    import weakref
    model = mlp()
    opt = _wrap(model, stage=2, overlap_param_gather=overlap)
    _train(model, opt, 1, "plain", None, steps=1)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    mse(model, *batch(0, 0)).backward()  # the model keeps working without it
    return ref() is None, all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("overlap", [False, True])
def test_a_dropped_optimizer_is_freed_with_its_state(ranks, overlap):
    """Hooks on the model must not keep the optimizer (its shards and state) alive."""
    assert ranks.run(_dropped_optimizer_is_freed, overlap) == [(True, True)] * ranks.size


def _overlapped_gather(stage):
    """overlap_param_gather=True: step() leaves the gather in flight; the next
    forward's hooks and state_dict() wait for it, so training still matches."""
    model = mlp()
    opt = _wrap(model, stage=stage, overlap_param_gather=True)
    _train(model, opt, 1, "plain", None)
    in_flight = len(opt._gatherer.in_flight)
    state = model.state_dict()  # its pre-hook waits
    ref, _ = train_reference(1, None)
    return in_flight, len(opt._gatherer.in_flight), [rel_err(state[n], q) for n, q in ref.state_dict().items()]


@pytest.mark.parametrize("stage", [1, 2])
def test_overlapped_param_gather_matches_the_reference(ranks_fusion, stage):
    for in_flight, after, errs in ranks_fusion.run(_overlapped_gather, stage):
        assert in_flight == 4 and after == 0
        assert all(e < 1e-5 for e in errs), errs


def _values_dropped_during_step(stage, overlap):
    """What the parameters' storages hold while the inner optimizer steps (it sees only
    the master shards): nothing, so the step's temporaries never sit beside them; and
    after step() the same storages hold the new values."""
    model = mlp()
    opt = _wrap(model, stage=stage, overlap_param_gather=overlap)
    inner, seen = opt.optimizer.step, []

    def step(*args, **kwargs):
        seen.append(sum(p.untyped_storage().nbytes() for p in model.parameters()))
        return inner(*args, **kwargs)
    opt.optimizer.step = step
    _train(model, opt, 1, "plain", None)
    opt.wait_for_params()
    ref, _ = train_reference(1, None)
    errs = [rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]
    held = [p.untyped_storage().nbytes() for p in model.parameters()]
    return seen, all(h > 0 for h in held), errs, len(held)


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, False), (2, True)])
def test_parameters_are_freed_during_the_inner_step(ranks, stage, overlap):
    for seen, held, errs, n in ranks.run(_values_dropped_during_step, stage, overlap):
        assert seen == [0] * STEPS and held and n == 4, (seen, held)
        assert all(e < 1e-5 for e in errs), errs


def _bf16_params():
    n, r = hvd.size(), hvd.rank()
    model = mlp()
    opt = _wrap(model, stage=2, param_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    wire = []
    for step in range(STEPS):
        x, y = batch(step, 0)
        mse(model, rank_rows(x, r, n).bfloat16(), rank_rows(y, r, n).bfloat16()).backward()
        hvd.collective_stats(reset=True)
        opt.step()
        opt.zero_grad()
        wire += [(s["op"], s["dtype"]) for s in hvd.collective_stats() if s["op"] == "allgather"]
    # Reference: fp32 master weights stepped with gradients of a bf16 model on the whole batch.
    ref = mlp()
    master = [p.detach().clone().requires_grad_(True) for p in ref.parameters()]
    ref_opt = adamw(zip([n for n, _ in ref.named_parameters()], master))
    work = mlp().bfloat16()
    for step in range(STEPS):
        with torch.no_grad():
            for w, m in zip(work.parameters(), master):
                w.copy_(m)
        work.zero_grad()
        x, y = batch(step, 0)
        mse(work, x.bfloat16(), y.bfloat16()).backward()
        for w, m in zip(work.parameters(), master):
            m.grad = w.grad.float()
        ref_opt.step()
    errs = [rel_err(p, m.bfloat16()) for p, m in zip(model.parameters(), master)]
    return errs, sorted(set(wire))


def test_bf16_params_with_fp32_master_and_bf16_on_the_wire(ranks):
    for errs, wire in ranks.run(_bf16_params):
        assert all(e < 2e-2 for e in errs), errs  # bf16 rounding of the reduced gradients and weights
        assert wire == [("allgather", "bfloat16")], wire


def _save(path, steps, device="cpu", fmt="dcp"):
    hvd.init()
    model = mlp(device=_on(device))
    opt = _wrap(model, stage=2)
    _train(model, opt, 1, "plain", None, steps=steps)
    hvd.zero.save_checkpoint(path, model, opt, format=fmt)
    hvd.shutdown()


def _resume(path, steps, start, device="cpu"):
    hvd.init()
    model = mlp(seed=123, device=_on(device))  # different weights: the checkpoint must replace them
    opt = _wrap(model, stage=2)
    hvd.zero.load_checkpoint(path, model, opt)
    _train(model, opt, 1, "plain", None, steps=steps, start=start)
    # Plain lists: tensors sent from a process that then exits would arrive as dead shared-memory handles.
    out = {n: p.detach().tolist() for n, p in model.named_parameters()}
    hvd.shutdown()
    return out


@pytest.mark.parametrize("fmt", ["dcp", "consolidated"])
def test_checkpoint_saved_at_2_ranks_resumes_at_3(tmp_path, fmt):
    path = str(tmp_path / "ckpt.pt")
    res = launch(_save, 2, path, 2, "cpu", fmt, timeout=120)
    assert all(s == "ok" for s, _ in res.values()), res
    assert (os.path.isfile if fmt == "consolidated" else os.path.isdir)(path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file or folder left
    res = launch(_resume, 3, path, 2, 2, timeout=120)
    assert all(s == "ok" for s, _ in res.values()), res
    ref, _ = train_reference(1, None, steps=4)
    for r in range(3):
        params = {n: torch.tensor(v) for n, v in res[r][1].items()}
        for n, q in ref.named_parameters():
            assert rel_err(params[n], q) < 1e-5, (r, n, rel_err(params[n], q))


def _bad_zero_input():
    msgs = {}
    model = mlp()

    def attempt(key, fn):
        try:
            fn()
            msgs[key] = None
        except (ValueError, RuntimeError) as e:
            msgs[key] = str(e)

    other = torch.nn.Linear(2, 2)
    attempt("foreign", lambda: hvd.DistributedZeroOptimizer(torch.optim.SGD(other.parameters(), lr=1), model=model))
    attempt("missing", lambda: hvd.DistributedZeroOptimizer(torch.optim.SGD(model[0].parameters(), lr=1), model=model))
    mixed = torch.nn.Linear(2, 2)
    mixed.bias = torch.nn.Parameter(torch.zeros(2, device="meta"))
    attempt("devices", lambda: hvd.DistributedZeroOptimizer(torch.optim.SGD(mixed.parameters(), lr=1), model=mixed))
    model2 = mlp()
    opt = _wrap(model2, stage=2)
    sd = opt.state_dict()
    sd["zero"]["world_size"] = hvd.size() + 1
    attempt("world_size", lambda: opt.load_state_dict(sd))

    def step_inside():
        with opt.coalesce_grad_reduction():
            mse(model2, *batch(0, 0)).backward()
            opt.step()
    attempt("step_inside", step_inside)
    attempt("overlap_no_model", lambda: hvd.DistributedZeroOptimizer(
        adamw(mlp().named_parameters()), named_parameters=list(mlp().named_parameters()), overlap_param_gather=True))
    return msgs


def test_bad_input_is_refused_with_what_to_do(ranks):
    # "devices": parameters on two devices; a CPU machine's second device is the meta device,
    # refused as a model partly built there.
    expect = {"foreign": "not a parameter of the model", "missing": "not in the optimizer",
              "devices": "meta device and some are not", "world_size": "load_checkpoint", "step_inside": "after the with-block",
              "overlap_no_model": "needs model="}
    for msgs in ranks.run(_bad_zero_input):
        for key, fragment in expect.items():
            assert msgs[key] is not None, f"{key} was accepted"
            assert fragment in msgs[key], (key, msgs[key])


def _tied_run(model, opt, ranks_slice):
    dev = next(model.parameters()).device
    for step in range(3):
        ids, target = tied_batch(step, dev)
        lo, hi = ranks_slice
        loss = torch.nn.functional.cross_entropy(model(ids[lo:hi]).reshape(-1, 11), target.reshape(-1, 5)[lo:hi].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


def _tied_frozen_unused(device="cpu"):
    n, r = hvd.size(), hvd.rank()
    local = GLOBAL_BATCH // n
    model = Tied(_on(device))
    frozen_before = model.frozen.weight.detach().clone()
    unused_before = model.unused.weight.detach().clone()
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model=model)
    _tied_run(model, opt, (r * local, (r + 1) * local))
    ref = Tied()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    _tied_run(ref, ref_opt, (0, GLOBAL_BATCH))
    errs = {n: rel_err(p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    assert model.head.weight.data_ptr() == model.emb.weight.data_ptr(), "tied weights must stay one tensor"
    return errs, torch.equal(model.frozen.weight, frozen_before), torch.equal(model.unused.weight, unused_before)


def test_tied_frozen_and_gradless_parameters_match_torch(ranks):
    for errs, frozen_same, unused_same in ranks.run(_tied_frozen_unused):
        assert all(e < 1e-5 for e in errs.values()), errs
        assert frozen_same and unused_same


def _fp16_loss_scaling(device="cpu"):
    n, r = hvd.size(), hvd.rank()
    dev = _on(device)
    model = mlp(device=dev)
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), model=model,
                                       param_dtype=torch.float16)
    scale0 = opt.loss_scaler.scale
    before = [p.detach().clone() for p in model.parameters()]
    # The last rank's inputs overflow fp16 gradients at this scale: every rank must skip
    # the step. (The last, so that a job of one rank, on one GPU, overflows too.)
    x, y = batch(0, 0, dev)
    x = rank_rows(x, r, n).half() * (3e4 if r == n - 1 else 1.0)
    opt.scale_loss(mse(model, x, rank_rows(y, r, n).half())).backward()
    opt.step()
    opt.zero_grad()
    skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # A clean step with the reduced scale is taken, and tracks plain fp32 SGD.
    x, y = batch(1, 0, dev)
    opt.scale_loss(mse(model, rank_rows(x, r, n).half(), rank_rows(y, r, n).half())).backward()
    opt.step()
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    mse(ref, *batch(1, 0)).backward()
    ref_opt.step()
    errs = [rel_err(p.float(), q) for p, q in zip(model.parameters(), ref.parameters())]
    return skipped, scale0, opt.loss_scaler.scale, errs


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(ranks):
    for skipped, scale0, scale1, errs in ranks.run(_fp16_loss_scaling):
        assert skipped
        assert scale1 == scale0 * 0.5
        assert all(e < 5e-3 for e in errs), errs


def _downcast_modes():
    out = {}
    n, r = hvd.size(), hvd.rank()
    for mode in ("1", "0"):
        with scoped_env(HOROVOD_ZERO_DOWNCAST=mode):  # read by every step()
            model = mlp()
            opt = _wrap(model, param_dtype=torch.bfloat16)
            x, y = batch(0, 0)
            mse(model, rank_rows(x, r, n).bfloat16(), rank_rows(y, r, n).bfloat16()).backward()
            hvd.collective_stats(reset=True)
            opt.step()
        stats = [s for s in hvd.collective_stats() if s["op"] == "allgather"]
        out[mode] = ([p.detach().clone() for p in model.parameters()], {s["dtype"]: s["bytes"] for s in stats})
    same = all(torch.equal(a, b) for a, b in zip(out["1"][0], out["0"][0]))
    return same, out["1"][1], out["0"][1]


def test_downcast_fusion_halves_allgather_bytes_with_identical_weights(ranks):
    for same, on, off in ranks.run(_downcast_modes):
        assert same, "casting before or after the gather must round the same"
        assert list(on) == ["bfloat16"] and list(off) == ["float32"]
        # Buffer bytes: each rank's segment holds every shard at a 64-byte aligned offset.
        assert on["bfloat16"] == _gather_bytes(ranks.size, 2) and off["float32"] == _gather_bytes(ranks.size, 4)


def _gather_bytes(n, esize):
    align = 64 // esize
    segment = sum(-(-(-(-p.numel() // n)) // align) * align for p in mlp().parameters())
    return n * segment * esize


def _chunked_init():
    with scoped_env(HOROVOD_ZERO_INIT_CHUNK_BYTES=64):  # 16 elements a chunk: every parameter spans several
        model = mlp()
        opt = _wrap(model, stage=2)
    direct_model = mlp()
    direct = _wrap(direct_model, stage=2)
    paths = (opt.init_path, direct.init_path)
    # The same fp32 master shards and padded parameter storage as the direct build.
    same = (all(torch.equal(a, b) for a, b in zip(opt.sharded_state.flat_masters, direct.sharded_state.flat_masters))
            and all(torch.equal(a, b) for a, b in zip(opt._storage.stores, direct._storage.stores))
            and len(opt._storage.stores) == len(direct._storage.stores) == 4)
    _train(model, opt, 1, "plain", None)
    ref, _ = train_reference(1, None)
    return paths, same, [rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]


def test_chunked_initialisation_fallback_builds_the_same_shards(ranks):
    for (path, direct_path), same, errs in ranks.run(_chunked_init):
        assert path.startswith("chunked"), path
        assert direct_path == "device", direct_path
        assert same, "the chunked build's shards differ from the direct build's"
        assert all(e < 1e-5 for e in errs), errs


def _different_starts():
    """As in the README: ranks start from different weights, wrap, then broadcast."""
    n, r = hvd.size(), hvd.rank()
    model = mlp(seed=100 + r)  # every rank different; rank 0's must win
    opt = _wrap(model, stage=2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _train(model, opt, 1, "plain", None)
    ref = mlp(seed=100)
    train_reference(1, None, model=ref)
    return [rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]


def test_ranks_that_start_different_train_from_rank_0s_weights(ranks):
    for errs in ranks.run(_different_starts):
        assert all(e < 1e-5 for e in errs), errs


def _zero_grad_before_step(stage):
    """A backward whose gradients zero_grad() drops before step(), then the steps of the
    reference: as in torch, the dropped gradients never reach the weights."""
    n, r = hvd.size(), hvd.rank()
    model = mlp()
    opt = _wrap(model, stage=stage)
    x, y = batch(99, 0)
    mse(model, rank_rows(x, r, n) * 3, rank_rows(y, r, n)).backward()  # submitted at stage 2
    opt.zero_grad()
    _train(model, opt, 1, "plain", None)
    ref, _ = train_reference(1, None)
    return [rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_before_step_drops_the_gradients_so_far(ranks, stage):
    for errs in ranks.run(_zero_grad_before_step, stage):
        assert all(e < 1e-5 for e in errs), errs
