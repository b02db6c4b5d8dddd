"""opt.sharded_state, the optimizer's public view of its sharded state that
checkpoints and export read: what it says each rank holds, checked against the
model's own parameters, and the step count it carries through state dicts and
checkpoints."""

import torch

import horovod_zero.torch as hvd
from refs import STEPS, batch, mlp, mse, rank_rows
from test_zero import _train, _wrap


def _view_matches_the_model():
    model = mlp()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _wrap(model, stage=2)
    view = opt.sharded_state
    out = {"named": view.named, "rank": view.rank, "size": view.size, "stage": view.stage,
           "names": [s.name for s in view.shards],
           "groups": [[s.name for s in g] for g in view.groups], "errors": []}
    for s, master, p in zip(view.shards, view.masters, view.params):
        flat = torch.nn.functional.pad(full[s.name].reshape(-1), (0, s.padded - s.numel))
        mine = flat[view.rank * s.shard:(view.rank + 1) * s.shard]
        out["errors"].append(float((master.detach() - mine).abs().max()))
        out["errors"].append(float((p.detach() - full[s.name]).abs().max()))
    out["inner_is_wrapped"] = view.inner is opt.optimizer
    hvd.barrier()
    return out


def test_the_view_names_each_shard_and_holds_this_ranks_slice(ranks):
    names = [n for n, _ in mlp().named_parameters()]
    groups = [[n for n in names if n.endswith("weight")], [n for n in names if n.endswith("bias")]]  # refs.adamw
    for r, out in enumerate(ranks.run(_view_matches_the_model)):
        # shard indices follow the optimizer's order: its groups, one after the other
        assert out["named"] and out["groups"] == groups and out["names"] == groups[0] + groups[1], out
        assert (out["rank"], out["size"], out["stage"]) == (r, ranks.size, 2)
        assert out["inner_is_wrapped"]
        # every rank starts from rank 0's values (the wrap broadcasts them): the reference is rank 0's model
        assert max(out["errors"]) == 0.0, out["errors"]


def _step_count_survives(tmp):
    model = mlp()
    opt = _wrap(model, stage=2)
    _train(model, opt, 1, "plain", None)
    counts = [opt.sharded_state.step_count]
    rank_state = opt.state_dict()
    path = f"{tmp}/ckpt.pt"
    hvd.zero.save_checkpoint(path, model, opt)
    fresh_model = mlp()
    fresh = _wrap(fresh_model, stage=2)
    counts.append(fresh.sharded_state.step_count)
    fresh.load_state_dict(rank_state)
    counts.append(fresh.sharded_state.step_count)
    other = _wrap(mlp(), stage=2)
    hvd.zero.load_checkpoint(path, None, other)
    counts.append(other.sharded_state.step_count)
    x, y = batch(0, 0)
    mse(fresh_model, rank_rows(x, hvd.rank(), hvd.size()), rank_rows(y, hvd.rank(), hvd.size())).backward()
    fresh.step()
    counts.append(fresh.sharded_state.step_count)
    hvd.barrier()
    return counts


def test_step_count_counts_steps_and_survives_state_dicts_and_checkpoints(ranks, tmp_path):
    for counts in ranks.run(_step_count_survives, str(tmp_path)):
        assert counts == [STEPS, 0, STEPS, STEPS, STEPS + 1], counts
