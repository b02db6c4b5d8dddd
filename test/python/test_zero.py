"""DistributedZeroOptimizer (stages 1 and 2) over 2 and 3 CPU ranks against a
single-process reference run of the same math on the concatenated batch."""

import contextlib
import os

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch

GLOBAL_BATCH = 12  # divisible by 2 and 3
STEPS = 4
# Where models and batches are made: the GPU tests run these same functions with it set
# to the rank's GPU (test/gpu/test_gpu_zero.py).
DEVICE = torch.device("cpu")


def _model(seed=0):
    torch.manual_seed(seed)
    # Odd sizes: shards are padded on every world size used here.
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 7)).to(DEVICE)


def _adamw(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "lr": 1e-2},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2}])


def _batch(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(GLOBAL_BATCH, 16, generator=g).to(DEVICE), torch.randn(GLOBAL_BATCH, 7, generator=g).to(DEVICE)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _reference(passes, clip, steps=STEPS, start=0, model=None, opt=None):
    """Plain torch, one process, the whole batch: gradients summed over the passes."""
    model = model or _model()
    opt = opt or _adamw(model)
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(passes):
            _loss(model, *_batch(step, micro)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model, opt


def _train(model, opt, passes, mode, clip, steps=STEPS, start=0):
    n, r = hvd.size(), hvd.rank()
    local = GLOBAL_BATCH // n
    counts = []
    for step in range(start, start + steps):
        hvd.collective_stats(reset=True)
        ctx = opt.coalesce_grad_reduction() if mode == "coalesce" else contextlib.nullcontext()
        with ctx:
            for micro in range(passes):
                x, y = _batch(step, micro)
                _loss(model, x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]).backward()
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        counts.append(sum(s["tensors"] for s in hvd.collective_stats() if s["op"] == "reducescatter"))
    return counts


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check_against_reference(stage, mode, clip):
    passes = {"plain": 1, "bpps": 2, "coalesce": 4, "perpass": 3}[mode]
    model = _model()
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=stage,
                                       backward_passes_per_step=passes if mode == "bpps" else 1)
    counts = _train(model, opt, passes, mode, clip)
    ref, _ = _reference(passes, clip)
    errs = {n: _rel(p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    state_numel = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k == "exp_avg")
    return errs, counts, state_numel


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mode,clip", [("plain", None), ("bpps", None), ("coalesce", None), ("perpass", None),
                                       ("plain", 0.05)],
                         ids=["plain", "backward_passes_per_step2", "coalesce4", "3passes_uncoalesced", "clip"])
def test_matches_single_process_reference(ranks_fusion, stage, mode, clip):
    nparams = 4
    total = sum(p.numel() for p in _model().parameters())
    shard_total = sum(-(-p.numel() // ranks_fusion.size) for p in _model().parameters())
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
    os.environ["HOROVOD_ZERO_BUCKET_BYTES"] = str(bucket_bytes)
    try:
        model = _model()
        opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=2)
    finally:
        os.environ.pop("HOROVOD_ZERO_BUCKET_BYTES")
    collectives = []
    for step in range(STEPS):
        hvd.collective_stats(reset=True)
        _train(model, opt, passes, "perpass" if passes > 1 else "plain", None, steps=1, start=step)
        collectives.append(sum(s["collectives"] for s in hvd.collective_stats() if s["op"] == "reducescatter"))
    ref, _ = _reference(passes, None)
    return collectives, [_rel(p, q) for p, q in zip(model.parameters(), ref.parameters())]


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 30])
@pytest.mark.parametrize("passes", [1, 3])
def test_stage2_gradient_buckets(ranks, bucket_bytes, passes):
    """A bucket larger than the model holds every gradient of the step (of every
    backward pass) until step(), then sends them as one fused collective; 0 sends
    each as it is ready. Both match the reference."""
    for collectives, errs in ranks.run(_bucketed, bucket_bytes, passes):
        assert all(e < 1e-5 for e in errs), errs
        if bucket_bytes:
            assert collectives == [1] * STEPS, collectives


def _dropped_optimizer_is_freed(overlap):
    import gc
    import weakref
    model = _model()
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=2, overlap_param_gather=overlap)
    _train(model, opt, 1, "plain", None, steps=1)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    _loss(model, *_batch(0, 0)).backward()  # the model keeps working without it
    return ref() is None, all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("overlap", [False, True])
def test_a_dropped_optimizer_is_freed_with_its_state(ranks, overlap):
    """Hooks on the model must not keep the optimizer (its shards and state) alive."""
    assert ranks.run(_dropped_optimizer_is_freed, overlap) == [(True, True)] * ranks.size


def _overlapped_gather(stage):
    """overlap_param_gather=True: step() leaves the gather in flight; the next
    forward's hooks and state_dict() wait for it, so training still matches."""
    model = _model()
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=stage, overlap_param_gather=True)
    _train(model, opt, 1, "plain", None)
    in_flight = len(opt._gathering)
    state = model.state_dict()  # its pre-hook waits
    ref, _ = _reference(1, None)
    return in_flight, len(opt._gathering), [_rel(state[n], q) for n, q in ref.state_dict().items()]


@pytest.mark.parametrize("stage", [1, 2])
def test_overlapped_param_gather_matches_the_reference(ranks_fusion, stage):
    for in_flight, after, errs in ranks_fusion.run(_overlapped_gather, stage):
        assert in_flight == 4 and after == 0
        assert all(e < 1e-5 for e in errs), errs


def _bf16_params():
    n, r = hvd.size(), hvd.rank()
    model = _model()
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=2, param_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    wire = []
    local = GLOBAL_BATCH // n
    for step in range(STEPS):
        x, y = _batch(step, 0)
        _loss(model, x[r * local:(r + 1) * local].bfloat16(), y[r * local:(r + 1) * local].bfloat16()).backward()
        hvd.collective_stats(reset=True)
        opt.step()
        opt.zero_grad()
        wire += [(s["op"], s["dtype"]) for s in hvd.collective_stats() if s["op"] == "allgather"]
    # Reference: fp32 master weights stepped with gradients of a bf16 model on the whole batch.
    ref = _model()
    master = [p.detach().clone().requires_grad_(True) for p in ref.parameters()]
    ref_opt = _adamw_on(master, ref)
    work = _model().bfloat16()
    for step in range(STEPS):
        with torch.no_grad():
            for w, m in zip(work.parameters(), master):
                w.copy_(m)
        work.zero_grad()
        x, y = _batch(step, 0)
        _loss(work, x.bfloat16(), y.bfloat16()).backward()
        for w, m in zip(work.parameters(), master):
            m.grad = w.grad.float()
        ref_opt.step()
    errs = [_rel(p, m.bfloat16()) for p, m in zip(model.parameters(), master)]
    return errs, sorted(set(wire))


def _adamw_on(master, ref):
    names = [n for n, _ in ref.named_parameters()]
    decay = [m for n, m in zip(names, master) if n.endswith("weight")]
    no_decay = [m for n, m in zip(names, master) if n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "lr": 1e-2},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2}])


def test_bf16_params_with_fp32_master_and_bf16_on_the_wire(ranks):
    for errs, wire in ranks.run(_bf16_params):
        assert all(e < 2e-2 for e in errs), errs  # bf16 rounding of the reduced gradients and weights
        assert wire == [("allgather", "bfloat16")], wire


def _save(path, steps):
    hvd.init()
    model = _model()
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=2)
    _train(model, opt, 1, "plain", None, steps=steps)
    hvd.zero.save_checkpoint(path, model, opt)
    hvd.shutdown()


def _resume(path, steps, start):
    hvd.init()
    model = _model(seed=123)  # different weights: the checkpoint must replace them
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=2)
    hvd.zero.load_checkpoint(path, model, opt)
    _train(model, opt, 1, "plain", None, steps=steps, start=start)
    # Plain lists: tensors sent from a process that then exits would arrive as dead shared-memory handles.
    out = {n: p.detach().tolist() for n, p in model.named_parameters()}
    hvd.shutdown()
    return out


def test_consolidated_checkpoint_saved_at_2_ranks_resumes_at_3(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    res = launch(_save, 2, path, 2, timeout=120)
    assert all(s == "ok" for s, _ in res.values()), res
    assert os.path.exists(path) and not [f for f in os.listdir(tmp_path) if ".tmp." in f]
    res = launch(_resume, 3, path, 2, 2, timeout=120)
    assert all(s == "ok" for s, _ in res.values()), res
    ref, _ = _reference(1, None, steps=4)
    for r in range(3):
        params = {n: torch.tensor(v) for n, v in res[r][1].items()}
        for n, q in ref.named_parameters():
            assert _rel(params[n], q) < 1e-5, (r, n, _rel(params[n], q))


def _bad_zero_input():
    msgs = {}
    model = _model()

    def attempt(key, fn):
        try:
            fn()
            msgs[key] = None
        except (ValueError, RuntimeError) as e:
            msgs[key] = str(e)

    attempt("stage", lambda: hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=3))
    other = torch.nn.Linear(2, 2)
    attempt("foreign", lambda: hvd.DistributedZeroOptimizer(torch.optim.SGD(other.parameters(), lr=1), model=model))
    attempt("missing", lambda: hvd.DistributedZeroOptimizer(torch.optim.SGD(model[0].parameters(), lr=1), model=model))
    mixed = torch.nn.Linear(2, 2)
    mixed.bias = torch.nn.Parameter(torch.zeros(2, device="meta"))
    attempt("devices", lambda: hvd.DistributedZeroOptimizer(torch.optim.SGD(mixed.parameters(), lr=1), model=mixed))
    model2 = _model()
    opt = hvd.DistributedZeroOptimizer(_adamw(model2), model=model2, stage=2)
    sd = opt.state_dict()
    sd["zero"]["world_size"] = hvd.size() + 1
    attempt("world_size", lambda: opt.load_state_dict(sd))

    def step_inside():
        with opt.coalesce_grad_reduction():
            _loss(model2, *_batch(0, 0)).backward()
            opt.step()
    attempt("step_inside", step_inside)
    attempt("overlap_no_model", lambda: hvd.DistributedZeroOptimizer(
        _adamw(_model()), named_parameters=list(_model().named_parameters()), overlap_param_gather=True))
    return msgs


def test_bad_input_is_refused_with_what_to_do(ranks):
    expect = {"stage": "stages 1 and 2", "foreign": "not a parameter of the model", "missing": "not in the optimizer",
              "devices": "one device", "world_size": "load_checkpoint", "step_inside": "after the with-block",
              "overlap_no_model": "needs model="}
    for msgs in ranks.run(_bad_zero_input):
        for key, fragment in expect.items():
            assert msgs[key] is not None, f"{key} was accepted"
            assert fragment in msgs[key], (key, msgs[key])


class _Tied(torch.nn.Module):
    """Tied embedding/output weight, a frozen layer, and a layer never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.mid = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(6, 6)
        self.to(DEVICE)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.mid(h) + self.frozen(h))


def _tied_batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g).to(DEVICE),
            torch.randint(0, 11, (GLOBAL_BATCH * 5,), generator=g).to(DEVICE))


def _tied_run(model, opt, ranks_slice):
    for step in range(3):
        ids, target = _tied_batch(step)
        lo, hi = ranks_slice
        loss = torch.nn.functional.cross_entropy(model(ids[lo:hi]).reshape(-1, 11), target.reshape(-1, 5)[lo:hi].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


def _tied_frozen_unused():
    n, r = hvd.size(), hvd.rank()
    local = GLOBAL_BATCH // n
    model = _Tied()
    frozen_before = model.frozen.weight.detach().clone()
    unused_before = model.unused.weight.detach().clone()
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model=model)
    _tied_run(model, opt, (r * local, (r + 1) * local))
    ref = _Tied()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    _tied_run(ref, ref_opt, (0, GLOBAL_BATCH))
    errs = {n: _rel(p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}
    assert model.head.weight.data_ptr() == model.emb.weight.data_ptr(), "tied weights must stay one tensor"
    return errs, torch.equal(model.frozen.weight, frozen_before), torch.equal(model.unused.weight, unused_before)


def test_tied_frozen_and_gradless_parameters_match_torch(ranks):
    for errs, frozen_same, unused_same in ranks.run(_tied_frozen_unused):
        assert all(e < 1e-5 for e in errs.values()), errs
        assert frozen_same and unused_same


def _fp16_loss_scaling():
    n, r = hvd.size(), hvd.rank()
    local = GLOBAL_BATCH // n
    model = _model()
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), model=model,
                                       param_dtype=torch.float16)
    scale0 = opt.loss_scaler.scale
    before = [p.detach().clone() for p in model.parameters()]
    # Rank 1's inputs overflow fp16 gradients at this scale: every rank must skip the step.
    x, y = _batch(0, 0)
    x = x[r * local:(r + 1) * local].half() * (3e4 if r == 1 else 1.0)
    opt.scale_loss(_loss(model, x, y[r * local:(r + 1) * local].half())).backward()
    opt.step()
    opt.zero_grad()
    skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # A clean step with the reduced scale is taken, and tracks plain fp32 SGD.
    x, y = _batch(1, 0)
    opt.scale_loss(_loss(model, x[r * local:(r + 1) * local].half(), y[r * local:(r + 1) * local].half())).backward()
    opt.step()
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    _loss(ref, *_batch(1, 0)).backward()
    ref_opt.step()
    errs = [_rel(p.float(), q) for p, q in zip(model.parameters(), ref.parameters())]
    return skipped, scale0, opt.loss_scaler.scale, errs


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(ranks):
    for skipped, scale0, scale1, errs in ranks.run(_fp16_loss_scaling):
        assert skipped
        assert scale1 == scale0 * 0.5
        assert all(e < 5e-3 for e in errs), errs


def _downcast_modes():
    out = {}
    for mode in ("1", "0"):
        os.environ["HOROVOD_ZERO_DOWNCAST"] = mode
        model = _model()
        opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, param_dtype=torch.bfloat16)
        r, local = hvd.rank(), GLOBAL_BATCH // hvd.size()
        x, y = _batch(0, 0)
        _loss(model, x[r * local:(r + 1) * local].bfloat16(), y[r * local:(r + 1) * local].bfloat16()).backward()
        hvd.collective_stats(reset=True)
        opt.step()
        stats = [s for s in hvd.collective_stats() if s["op"] == "allgather"]
        out[mode] = ([p.detach().clone() for p in model.parameters()], {s["dtype"]: s["bytes"] for s in stats})
    os.environ.pop("HOROVOD_ZERO_DOWNCAST")
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
    segment = sum(-(-(-(-p.numel() // n)) // align) * align for p in _model().parameters())
    return n * segment * esize


def _chunked_init():
    os.environ["HOROVOD_ZERO_INIT_CHUNK_BYTES"] = "64"  # 16 elements a chunk: every parameter spans several
    try:
        model = _model()
        opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=2)
    finally:
        os.environ.pop("HOROVOD_ZERO_INIT_CHUNK_BYTES")
    path = opt.init_path
    _train(model, opt, 1, "plain", None)
    ref, _ = _reference(1, None)
    return path, [_rel(p, q) for p, q in zip(model.parameters(), ref.parameters())]


def test_chunked_initialisation_fallback_builds_the_same_shards(ranks):
    for path, errs in ranks.run(_chunked_init):
        assert path.startswith("chunked"), path
        assert all(e < 1e-5 for e in errs), errs


def _different_starts():
    """As in the README: ranks start from different weights, wrap, then broadcast."""
    n, r = hvd.size(), hvd.rank()
    model = _model(seed=100 + r)  # every rank different; rank 0's must win
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _train(model, opt, 1, "plain", None)
    ref = _model(seed=100)
    _reference(1, None, model=ref, opt=_adamw(ref))
    return [_rel(p, q) for p, q in zip(model.parameters(), ref.parameters())]


def test_ranks_that_start_different_train_from_rank_0s_weights(ranks):
    for errs in ranks.run(_different_starts):
        assert all(e < 1e-5 for e in errs), errs
