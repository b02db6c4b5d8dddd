"""DistributedZeroOptimizer(process_set=ps): ZeRO over the ranks of one process set
(here ranks 0 and 2 of 3) matches the single-process reference, the rank outside the
set is refused, and the set's checkpoint (written by its first rank) resumes in an
ordinary job of 2 ranks."""

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch
from refs import STEPS, adamw, batch, mlp, mse, rank_rows, rel_err, train_reference

MEMBERS = [0, 2]


def _train(model, opt, place, n, steps=STEPS, start=0):
    for step in range(start, start + steps):
        x, y = batch(step, 0)
        mse(model, rank_rows(x, place, n), rank_rows(y, place, n)).backward()
        opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()


def _in_a_set(stage, path):
    ps = hvd.ProcessSet(MEMBERS)
    hvd.init(process_sets=[ps])
    model = mlp()
    units = [torch.nn.Linear] if stage == 3 else None
    if not ps.included():
        try:
            hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=stage, units=units,
                                         process_set=ps)
            out = "built"
        except ValueError as e:
            out = str(e)
        hvd.barrier()
        hvd.shutdown()
        return out
    opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=stage, units=units,
                                       process_set=ps)
    _train(model, opt, ps.rank(), ps.size(), steps=2)
    hvd.zero.save_checkpoint(path, model, opt)
    _train(model, opt, ps.rank(), ps.size(), steps=2, start=2)
    ref, _ = train_reference(1, 0.05)
    if stage == 3:
        with opt.gathered_params():
            errs = [rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]
    else:
        errs = [rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]
    hvd.barrier()
    hvd.shutdown()
    return errs


def _resume(path):
    hvd.init()
    model = mlp(seed=7)
    opt = hvd.DistributedZeroOptimizer(adamw(model.named_parameters()), model=model, stage=2)
    hvd.zero.load_checkpoint(path, model, opt)
    _train(model, opt, hvd.rank(), hvd.size(), steps=2, start=2)
    out = [p.detach().tolist() for p in model.parameters()]
    hvd.shutdown()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_over_a_process_set_matches_reference_and_its_checkpoint_resumes(tmp_path, stage):
    path = str(tmp_path / "ckpt.pt")
    res = launch(_in_a_set, 3, stage, path, timeout=180)
    assert all(s == "ok" for s, _ in res.values()), res
    for r in MEMBERS:
        assert max(res[r][1]) < 1e-5, (r, res[r][1])
    assert "not in" in res[1][1], res[1][1]
    res = launch(_resume, 2, path, timeout=180)
    assert all(s == "ok" for s, _ in res.values()), res
    ref, _ = train_reference(1, 0.05)
    for r in range(2):
        for w, q in zip(res[r][1], ref.parameters()):
            assert rel_err(torch.tensor(w, dtype=torch.float64), q) < 1e-5
