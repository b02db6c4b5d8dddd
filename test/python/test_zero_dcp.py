"""Sharded checkpoints in torch.distributed.checkpoint's format (hvd.zero.save_checkpoint):
FSDP2's checkpoints load into our stage 3 and ours into FSDP2, each checked against 6
steps of FSDP2 alone (and of ours alone); asynchronous saves; a failed save keeps the
previous checkpoint; misfit and partial checkpoints are refused on every rank.

FSDP2 runs on CPU over a Gloo process group that each rank opens next to the runtime."""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import horovod_zero.torch as hvd
from harness import shared_pool
from horovod_zero.torch.zero.state.dcp_layout import rectangles

V, D, H, GLOBAL_BATCH, SEQ = 11, 6, 7, 6, 3  # 11 x 6 and 7 x 6: shards end mid-row at 2 and 3 ranks
STEPS = 3


class Net(torch.nn.Module):
    def __init__(self, seed=0, blocks=2, hidden=H):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(D, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, D))
            for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(D)
        self.register_buffer("scale", torch.full((D,), 0.5))

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        return F.linear(self.norm(x) * self.scale, self.emb.weight)  # the head is the embedding


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (GLOBAL_BATCH, SEQ), generator=g)
    k = GLOBAL_BATCH // hvd.size()
    return ids[hvd.rank() * k:(hvd.rank() + 1) * k], torch.roll(ids, 1, 1)[hvd.rank() * k:(hvd.rank() + 1) * k]


def _train(model, opt, start, steps):
    for step in range(start, start + steps):
        x, y = _batch(step)
        F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def _ours(seed=0, stage=3):
    model = Net(seed)
    return model, hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=stage)


def _ours_full(model, opt):
    if opt.stage != 3:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


class _Torch:
    """A Gloo process group beside the runtime, for FSDP2 (closed on exit)."""

    def __init__(self, where):
        self.where = where

    def __enter__(self):
        dist.init_process_group("gloo", init_method=f"file://{self.where}", rank=hvd.rank(), world_size=hvd.size())

    def __exit__(self, *exc):
        dist.destroy_process_group()


def _fsdp(seed=0):
    from torch.distributed.fsdp import fully_shard
    model = Net(seed)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model, _adamw(model)


def _fsdp_full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {n: full[n].clone() for n, _ in model.named_parameters()}


def _fsdp_run(where, steps):
    with _Torch(where):
        model, opt = _fsdp()
        _train(model, opt, 0, steps)
        return _fsdp_full(model)


def _fsdp_save(where, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    with _Torch(where):
        model, opt = _fsdp()
        _train(model, opt, 0, STEPS)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _fsdp_resume(where, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    with _Torch(where):
        model, opt = _fsdp(seed=7)  # other weights: the checkpoint must replace them
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        _train(model, opt, STEPS, STEPS)
        return _fsdp_full(model)


def _ours_save(path, stage=3):
    model, opt = _ours(stage=stage)
    _train(model, opt, 0, STEPS)
    hvd.zero.save_checkpoint(path, model, opt)


def _ours_resume(path, stage=3):
    model, opt = _ours(seed=7, stage=stage)
    hvd.zero.load_checkpoint(path, model, opt)
    _train(model, opt, STEPS, STEPS)
    return _ours_full(model, opt), opt.sharded_state.step_count


def _ours_run(steps):
    model, opt = _ours()
    _train(model, opt, 0, steps)
    return _ours_full(model, opt)


def _close(a, b, tol=1e-5):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    errs = {n: ((a[n] - b[n]).norm() / b[n].norm()).item() for n in a}
    assert max(errs.values()) < tol, errs


@pytest.fixture(scope="module")
def fsdp_six_steps(tmp_path_factory):
    where = tmp_path_factory.mktemp("pg") / "store"
    return shared_pool(2).run(_fsdp_run, str(where), 2 * STEPS)[0]


def test_ours_alone_matches_fsdp2_alone(fsdp_six_steps):
    for full in shared_pool(2).run(_ours_run, 2 * STEPS):
        _close(full, fsdp_six_steps)


@pytest.mark.parametrize("size,stage", [(2, 3), (3, 3), (3, 1)], ids=["2ranks_stage3", "3ranks_stage3",
                                                                      "3ranks_stage1"])
def test_fsdp2_checkpoint_resumes_in_ours(tmp_path, fsdp_six_steps, size, stage):
    path = str(tmp_path / "fsdp_ckpt")
    shared_pool(2).run(_fsdp_save, str(tmp_path / "store"), path)
    for full, steps in shared_pool(size).run(_ours_resume, path, stage):
        _close(full, fsdp_six_steps)
        assert steps == 2 * STEPS  # taken from the optimizer's own step count


@pytest.mark.parametrize("stage", [3, 2])
def test_our_checkpoint_resumes_in_fsdp2(tmp_path, fsdp_six_steps, stage):
    path = str(tmp_path / "ckpt")
    shared_pool(3).run(_ours_save, path, stage)
    for full in shared_pool(2).run(_fsdp_resume, str(tmp_path / "store"), path):
        _close(full, fsdp_six_steps)


def test_rectangles_cover_each_flat_range_once():
    g = torch.Generator().manual_seed(0)
    for shape in [(), (7,), (11, 6), (3, 4, 5), (2, 3, 1, 4), (5, 0)]:
        n = int(torch.Size(shape).numel())
        for _ in range(30):
            a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist()) if n else (0, 0)
            seen = torch.zeros(shape, dtype=torch.int64)
            flat = 0
            for offsets, sizes in rectangles(shape, a, b):
                block = seen[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else seen
                block += 1
                flat += int(torch.Size(sizes).numel())
            want = torch.zeros(n, dtype=torch.int64)
            want[a:b] = 1
            assert torch.equal(seen.reshape(-1), want), (shape, a, b)
            assert flat == b - a


# --- asynchronous saves and a failed save --------------------------------------------

def _async(path):
    model, opt = _ours()
    _train(model, opt, 0, STEPS)
    saved = _ours_full(model, opt)
    handle = hvd.zero.async_save_checkpoint(path, model, opt)
    _train(model, opt, STEPS, 1)  # the step goes on while the files are written
    handle.wait()
    assert handle.done()
    model2, opt2 = _ours(seed=7)
    hvd.zero.load_checkpoint(path, model2, opt2)
    later = _ours_full(model2, opt2)
    moved = max(((saved[n] - p).abs().max().item() for n, p in _ours_full(model, opt).items()))
    return saved, later, moved


def test_async_save_holds_the_state_when_it_was_called(tmp_path):
    for saved, loaded, moved in shared_pool(2).run(_async, str(tmp_path / "ckpt")):
        assert moved > 1e-4  # the step after the save changed the weights...
        for n in saved:  # ...but the checkpoint holds them as they were at the call
            assert torch.equal(saved[n], loaded[n]), n


def _failed_save(path):
    from horovod_zero.torch.zero.state import dcp_io
    model, opt = _ours()
    _train(model, opt, 0, 1)
    hvd.zero.save_checkpoint(path, model, opt)
    first = _ours_full(model, opt)
    _train(model, opt, 1, 1)
    original = dcp_io.PlannedSave.write
    if hvd.rank() == 1:
        def broken(self):
            self._failure = OSError(28, "No space left on device")
        dcp_io.PlannedSave.write = broken
    try:
        start = time.monotonic()
        try:
            hvd.zero.save_checkpoint(path, model, opt)
            msg = None
        except RuntimeError as e:
            msg = str(e)
        seconds = time.monotonic() - start
    finally:
        dcp_io.PlannedSave.write = original
    model2, opt2 = _ours(seed=7)
    hvd.zero.load_checkpoint(path, model2, opt2)
    return msg, seconds, first, _ours_full(model2, opt2)


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    for msg, seconds, first, loaded in shared_pool(2).run(_failed_save, str(tmp_path / "ckpt")):
        assert msg is not None and "rank 1" in msg and "No space left" in msg, msg
        assert seconds < 20
        for n in first:
            assert torch.equal(first[n], loaded[n]), n


# --- checkpoints that do not fit -------------------------------------------------------

def _load_error(path, kind):
    model = Net(blocks=3) if kind == "more_blocks" else Net(hidden=H + 1) if kind == "wider" else Net()
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=3)
    start = time.monotonic()
    try:
        hvd.zero.load_checkpoint(path, model, opt)
        return None, 0.0
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        return str(e), time.monotonic() - start


@pytest.mark.parametrize("kind,fragments", [
    ("more_blocks", ["missing keys", "blocks.2.0.weight"]),
    ("wider", ["shapes that differ", "blocks.0.0.weight: saved (7, 6), here (8, 6)"]),
    ("partial", ["incomplete", "__1_0.distcp"]),
    ("absent", ["no checkpoint at"]),
])
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank(tmp_path, kind, fragments):
    path = str(tmp_path / "ckpt")
    shared_pool(2).run(_ours_save, path)
    if kind == "partial":
        os.remove(os.path.join(path, "__1_0.distcp"))
    if kind == "absent":
        path += "-elsewhere"
    for msg, seconds in shared_pool(2).run(_load_error, path, kind):
        assert msg is not None and all(f in msg for f in fragments), msg
        assert seconds < 20


def test_unexpected_keys_are_named(tmp_path):
    path = str(tmp_path / "ckpt")
    shared_pool(2).run(_ours_save, path)
    for msg, _ in shared_pool(2).run(_load_error_fewer, path):
        assert msg is not None and "unexpected keys" in msg and "blocks.1.0.weight" in msg, msg


def _load_error_fewer(path):
    model = Net(blocks=1)
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=3)
    try:
        hvd.zero.load_checkpoint(path, model, opt)
        return None, 0.0
    except ValueError as e:
        return str(e), 0.0


def _load_into_sgd(path):
    model = Net(seed=7)
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
                                       stage=3)
    before = _ours_full(model, opt)
    try:
        hvd.zero.load_checkpoint(path, model, opt)
        msg = None
    except ValueError as e:
        msg = str(e)
    after = _ours_full(model, opt)
    return msg, all(torch.equal(before[n], after[n]) for n in before)


def test_a_checkpoint_of_another_optimizer_is_refused_before_anything_is_read(tmp_path):
    path = str(tmp_path / "ckpt")
    shared_pool(2).run(_ours_save, path)
    for msg, unchanged in shared_pool(2).run(_load_into_sgd, path):
        assert msg is not None and "another optimizer class" in msg and "momentum" in msg, msg
        assert unchanged  # the weights were not touched


# --- a rank that fails alone, 0-dim parameters, groups split another way ------------------

class Scaled(Net):
    """Net with a trained 0-dim parameter (a learned temperature)."""

    def __init__(self, seed=0):
        super().__init__(seed)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, ids):
        return super().forward(ids) * self.temperature


def _scalar_round_trip(path):
    model = Scaled()
    opt = hvd.DistributedZeroOptimizer(_adamw(model), model=model, stage=3)
    _train(model, opt, 0, 2)
    hvd.zero.save_checkpoint(path, model, opt)
    _train(model, opt, 2, 2)
    want = _ours_full(model, opt)
    model2 = Scaled(seed=7)
    opt2 = hvd.DistributedZeroOptimizer(_adamw(model2), model=model2, stage=3)
    hvd.zero.load_checkpoint(path, model2, opt2)
    _train(model2, opt2, 2, 2)  # the moments of the 0-dim parameter were loaded with their shape
    got = _ours_full(model2, opt2)
    return max(((want[n] - got[n]).abs().max() / want[n].abs().max()).item() for n in want)


def test_a_0_dim_parameter_and_its_moments_round_trip(tmp_path):
    for err in shared_pool(2).run(_scalar_round_trip, str(tmp_path / "ckpt")):
        assert err < 1e-6, err


def _fails_alone(path, where):
    from horovod_zero.torch.zero.state import dcp_state
    model, opt = _ours()
    _train(model, opt, 0, 1)
    hvd.zero.save_checkpoint(path, model, opt)
    original = dcp_state.staged if where == "staging" else dcp_state.LoadTarget._plan_optimizer
    if hvd.rank() == 1:
        def broken(*args, **kwargs):
            raise MemoryError("pinned memory exhausted" if where == "staging" else "CUDA out of memory")
        if where == "staging":
            dcp_state.staged = broken
        else:
            dcp_state.LoadTarget._plan_optimizer = broken
    start = time.monotonic()
    try:
        if where == "staging":
            hvd.zero.async_save_checkpoint(path, model, opt).wait()
        else:
            hvd.zero.load_checkpoint(path, model, opt)
        msg = None
    except RuntimeError as e:
        msg = str(e)
    finally:
        if where == "staging":
            dcp_state.staged = original
        else:
            dcp_state.LoadTarget._plan_optimizer = original
    return msg, time.monotonic() - start


@pytest.mark.parametrize("where", ["staging", "load_target"])
def test_a_rank_that_fails_alone_makes_every_rank_raise(tmp_path, where):
    for msg, seconds in shared_pool(2).run(_fails_alone, str(tmp_path / "ckpt"), where, timeout=60):
        assert msg is not None and "rank 1" in msg and "MemoryError" in msg, msg
        assert seconds < 20


def _other_grouping(path):
    model = Net(seed=7)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                                                         lr=0.02), model=model, stage=3)
    try:
        hvd.zero.load_checkpoint(path, model, opt)
        return None
    except ValueError as e:
        return str(e)


def test_param_groups_split_another_way_are_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    shared_pool(2).run(_ours_save, path)
    for msg in shared_pool(2).run(_other_grouping, path):
        assert msg is not None and "groups them another way" in msg, msg
