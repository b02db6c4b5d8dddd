"""One rank's own state (opt.state_dict() / load_state_dict()): its fp32 master shards
and the inner optimizer's state for them, loadable only into the same rank of a job of
the same size. Checkpoints that change the world size are checkpoint.py's."""

import torch

from horovod_zero.torch.zero.state import compat


def save(view):
    """This rank's shard: its master weights and inner optimizer state."""
    with view.materialized():
        inner = view.inner.state_dict()
        if view.on_disk:
            # Copies, not views of the flat buffers read from disk: those are freed after
            # this, and a saved view would carry its whole buffer.
            inner["state"] = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
                              for k, st in inner["state"].items()}
        scaler = view.loss_scaler
        return {"zero": {"world_size": view.size, "rank": view.rank, "stage": view.stage,
                         "loss_scaler": scaler.state_dict() if scaler else None,
                         "optimizer": compat.describe(view.inner, view.groups, view.named),
                         "step_count": view.step_count},
                "master": [m.detach().clone() for m in view.flat_masters],
                "inner": inner}


def load(view, state):
    """Loads what save() returned on this rank of a job of this size."""
    with view.materialized(write_back=True):
        _load(view, state)


def _load(view, state):
    meta = state.get("zero", {})
    if meta.get("world_size") != view.size or meta.get("rank") != view.rank:
        raise ValueError(
            f"This state dict is rank {meta.get('rank')}'s shard of a job of size {meta.get('world_size')}; "
            f"this is rank {view.rank} of {view.size}. To change the world size, save with "
            "hvd.zero.save_checkpoint (or consolidated_state_dict) and load with hvd.zero.load_checkpoint.")
    plan = view.groups
    saved = meta.get("optimizer") or compat.positional(plan)
    inner = state["inner"]
    compat.check_class(saved, inner["param_groups"], inner["state"], view.inner)
    order = compat.match_groups(saved, plan)  # saved group index per group here
    with torch.no_grad():
        for g, i in enumerate(order):
            compat.relay_master(view.flat_masters[g], plan[g], saved["groups"][i], state["master"][i])
    view.inner.load_state_dict(compat.reorder_inner(inner, order, saved, plan))
    if view.loss_scaler is not None and meta.get("loss_scaler"):
        view.loss_scaler.load_state_dict(meta["loss_scaler"])
    view.set_step_count(meta.get("step_count"))
    view.publish()
