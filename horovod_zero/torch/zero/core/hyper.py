"""The hyperparameters of a step that runs during backward (overlap_step, on the host
or the device): taken when backward begins, on every rank at the same point, and
checked unchanged at step(), so that a change in between is refused on every rank
instead of stepping some shards with the old values and some with the new."""

from typing import Dict


def hyper_of(group) -> tuple:
    """The hyperparameters of a param group that an Adam step reads: (lr, beta1, beta2,
    eps, weight_decay, decoupled, maximize)."""
    b1, b2 = group["betas"]
    return (float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
            bool(group.get("decoupled_weight_decay", False)), bool(group.get("maximize", False)))


def snapshot(param_groups) -> Dict[int, tuple]:
    """Each param group's hyper_of(), by id(group)."""
    return {id(g): hyper_of(g) for g in param_groups}


def check_unchanged(before, now):
    """Refuses a step whose shards were stepped early with the hyperparameters `before`
    when the param groups hold others `now` (both snapshot()s). Groups added since step
    as they are."""
    groups = [k for k, (g, h) in enumerate(now.items()) if before.get(g, h) != h]
    if groups:
        raise RuntimeError(
            f"overlap_step=True stepped parameters during backward with the hyperparameters param group(s) "
            f"{groups} had when backward began, and they changed before step(). Change the learning rate "
            "(and other hyperparameters) between step() and the next backward, e.g. scheduler.step() right "
            "after opt.step(); to complete this step, set them back and call step() again.")
