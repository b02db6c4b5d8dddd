"""ZeRO stage 3 checkpoints: sharded (DCP) checkpoints saved at 2 ranks resume at 3 and the
other way round, between stages 3 and 2; per-rank state dicts between stages 3 and
2; the streamed model export. Every resumed run is checked against one
single-process torch run of all the steps."""

import pytest
import torch

import horovod_zero.torch as hvd
from harness import shared_pool
from test_zero_stage3 import Net, adamw, reference, rel_errors, train

STEPS = 2  # before and after the checkpoint


def whole(model, opt):
    """name -> full parameter, at any stage."""
    if opt.stage != 3:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def wrap(model, stage):
    return hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=stage)


def _save(path, stage):
    model = Net()
    opt = wrap(model, stage)
    train(model, opt, steps=STEPS)
    hvd.zero.save_checkpoint(path, model, opt)


def _resume(path, stage):
    model = Net(seed=5)  # other weights: the checkpoint must replace them
    opt = wrap(model, stage)
    hvd.zero.load_checkpoint(path, model, opt)
    train(model, opt, steps=STEPS, start=STEPS)
    return rel_errors(whole(model, opt), reference(steps=2 * STEPS))


@pytest.mark.parametrize("saved,resumed", [((2, 3), (3, 3)), ((2, 3), (3, 2)), ((3, 2), (2, 3))],
                         ids=["2ranks_stage3-3ranks_stage3", "2ranks_stage3-3ranks_stage2",
                              "3ranks_stage2-2ranks_stage3"])
def test_checkpoint_across_world_sizes_and_stages(tmp_path, saved, resumed):
    path = str(tmp_path / "ckpt.pt")
    shared_pool(saved[0]).run(_save, path, saved[1])
    for errs in shared_pool(resumed[0]).run(_resume, path, resumed[1]):
        assert max(errs.values()) < 1e-6, errs


def _per_rank(saved, resumed):
    model = Net()
    opt = wrap(model, saved)
    train(model, opt, steps=STEPS)
    state = opt.state_dict()
    model2 = Net(seed=5)
    opt2 = wrap(model2, resumed)
    opt2.load_state_dict(state)
    train(model2, opt2, steps=STEPS, start=STEPS)
    return rel_errors(whole(model2, opt2), reference(steps=2 * STEPS))


@pytest.mark.parametrize("saved,resumed", [(3, 2), (2, 3)], ids=["stage3-stage2", "stage2-stage3"])
def test_per_rank_state_dict_between_stages(ranks, saved, resumed):
    for errs in ranks.run(_per_rank, saved, resumed):
        assert max(errs.values()) < 1e-6, errs


def _export(path, max_file_bytes):
    import glob
    import os

    from safetensors import safe_open
    from safetensors.torch import load_file
    model = Net()
    opt = wrap(model, 3)
    train(model, opt, steps=STEPS)
    hvd.zero.save_model(path, model, opt, max_file_bytes=max_file_bytes)  # every rank: the gathers are collectives
    loaded = hvd.zero.load_model(path)
    fresh = Net(seed=5)
    fresh.load_state_dict(loaded)  # a plain torch model takes the file
    # The safetensors package reads every file as it is, with the format Hugging Face checks for.
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    by_package = {}
    for f in files:
        by_package.update(load_file(f))
        with safe_open(f, "pt") as g:
            assert g.metadata() == {"format": "pt"}, g.metadata()
    same = sorted(by_package) == sorted(loaded) and all(torch.equal(by_package[k], loaded[k]) for k in loaded)
    index = sorted(os.path.basename(f) for f in glob.glob(os.path.join(directory, "*.index.json")))
    return (rel_errors(dict(fresh.named_parameters()), reference(steps=STEPS)), sorted(loaded) == sorted(
        Net().state_dict()), same, [os.path.basename(f) for f in files], index)


@pytest.mark.parametrize("where,max_file_bytes", [("file", 5 << 30), ("file", 1000), ("dir", 1000)],
                         ids=["one-file", "files-with-index", "directory"])
def test_streamed_export_holds_the_trained_weights(ranks, tmp_path, where, max_file_bytes):
    path = str(tmp_path / "model.safetensors") if where == "file" else str(tmp_path) + "/"
    for errs, same_keys, read_by_package, files, index in ranks.run(_export, path, max_file_bytes):
        assert same_keys and read_by_package
        if max_file_bytes > 1 << 20:
            assert files == ["model.safetensors"] and index == [], (files, index)
        else:  # about 4 KB of weights: several files, named as Hugging Face names them
            n = len(files)
            assert n > 2 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)], files
            assert index == ["model.safetensors.index.json"], index
        assert max(errs.values()) < 1e-6, errs
