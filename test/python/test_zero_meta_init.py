"""Models built on the meta device, made real at wrapping one unit at a time, over 2 and 3
CPU ranks: the same values as building the model normally and wrapping it (every
stage, offload, units=, a tied head, a frozen parameter, buffers), never more than one
unit's parameters in full, training that matches, and the refusals."""

import pytest
import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd
from horovod_zero.torch.zero.core.storage import ShardedStorage
from test_zero_compile import D, Block  # the residual LayerNorm-Linear-GELU-Linear block

VOCAB, BLOCKS = 23, 3
BATCH, SEQ = 6, 4


class Rope(torch.nn.Module):
    """A non-persistent buffer computed from the shape alone, set by reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.empty(SEQ, D), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        pos = torch.arange(SEQ, dtype=torch.float32)[:, None]
        self.table.copy_(torch.sin(pos / 10 ** (torch.arange(D) / D)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        # Tied: its own init drew from the generator before the blocks', then it was replaced.
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.rope = Rope()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.stats = torch.nn.BatchNorm1d(D)  # persistent buffers, set by its reset_parameters()
        self.blocks[0].norm.weight.requires_grad_(False)  # frozen, in the optimizer

    def forward(self, ids):
        x = self.emb(ids) + self.rope.table
        for b in self.blocks:
            x = b(x)
        return self.head(self.stats(x.transpose(1, 2)).transpose(1, 2))


def build(meta, seed=0):
    torch.manual_seed(seed)
    if not meta:
        return Net()
    with torch.device("meta"):
        return Net()


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def wrap(model, stage, options):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return hvd.DistributedZeroOptimizer(opt, model=model, stage=stage, device="cpu", **options)


def train(model, opt, steps=3):
    n, r = hvd.size(), hvd.rank()
    k = BATCH // n
    losses = []
    for step in range(steps):
        ids, target = (t[r * k:(r + 1) * k] for t in batch(step))
        loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _same_as_a_normal_build(stage, options):
    """Masters, buffers and training against the same model built on the host and wrapped."""
    full_at_once, sharded = [], set()
    rehome = ShardedStorage._rehome

    def recording(storage, s, p, master_slice, chunk):
        # Parameters made real but not yet moved into their sharded storage: one unit's at most.
        full_at_once.append(sum(q.numel() for q in model.parameters() if not q.is_meta and id(q) not in sharded))
        sharded.add(id(p))
        return rehome(storage, s, p, master_slice, chunk)
    ShardedStorage._rehome = recording
    try:
        model = build(meta=True)
        opt = wrap(model, stage, options)
    finally:
        ShardedStorage._rehome = rehome
    normal = build(meta=False)
    opt_n = wrap(normal, stage, options)
    masters = [torch.equal(a, b) for a, b in zip(opt._storage.master_params, opt_n._storage.master_params)]
    buffers = [torch.equal(a, b) for a, b in zip(model.buffers(), normal.buffers())]
    tied = model.head.weight is model.emb.weight
    on_cpu = all(t.device.type == "cpu" for t in list(model.parameters()) + list(model.buffers()))
    losses = train(model, opt), train(normal, opt_n)
    block = sum(p.numel() for p in build(meta=True).blocks[0].parameters())  # shapes only
    return masters, buffers, tied, on_cpu, losses, max(full_at_once), block


CASES = {"stage1": (1, {}), "stage2": (2, {}), "stage3": (3, {}),
         "stage3-units": (3, {"units": [torch.nn.Linear]}),
         "stage2-offload": (2, {"offload_optimizer": "cpu"}),
         "stage3-offload-params": (3, {"offload_optimizer": "cpu", "offload_params": "cpu"})}


@pytest.mark.parametrize("case", list(CASES))
def test_a_meta_model_gets_the_values_of_a_normal_build_unit_by_unit(ranks, case):
    stage, options = CASES[case]
    for masters, buffers, tied, on_cpu, (losses, normal_losses), most, block in ranks.run(
            _same_as_a_normal_build, stage, options):
        assert masters and all(masters), masters
        assert buffers and all(buffers), buffers  # the RoPE table and the batch-norm statistics
        assert tied and on_cpu
        assert losses == normal_losses, (losses, normal_losses)
        # The embedding (the root's largest) or one block's parameters, never more, held in full.
        assert most <= max(block, VOCAB * D), (most, block)


class NoInit(torch.nn.Module):
    """Parameters and a buffer with no reset_parameters() to set them."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(D))
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x) * self.scale


class RopeInInit(torch.nn.Module):
    """A buffer computed in __init__: on the meta device it never gets values."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.register_buffer("table", torch.arange(D, dtype=torch.float32), persistent=False)

    def reset_parameters(self):
        pass  # sets nothing: the table would be garbage

    def forward(self, x):
        return self.lin(x) + self.table


def _refusals():
    def refused(make, **kw):
        try:
            with torch.device("meta"):
                model = make()
            hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, stage=3, **kw)
        except ValueError as e:
            return str(e)
        return None

    out = {"no_device": refused(NoInit),
           "no_init": refused(NoInit, device="cpu"),
           "unset_buffer": refused(RopeInInit, device="cpu")}

    def init_scale(m):
        if isinstance(m, NoInit):
            torch.nn.init.ones_(m.scale)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()
    out["init_fn"] = refused(NoInit, device="cpu", init_fn=init_scale)
    half = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.device("meta"):
        half[1] = torch.nn.Linear(2, 2)
    try:
        hvd.DistributedZeroOptimizer(torch.optim.SGD(half.parameters(), lr=0.1), model=half, stage=3, device="cpu")
        out["partly"] = None
    except ValueError as e:
        out["partly"] = str(e)
    return out


def test_meta_models_that_cannot_be_made_right_are_refused_naming_what(ranks):
    for out in ranks.run(_refusals):
        assert "device=" in out["no_device"], out
        assert "NoInit" in out["no_init"] and "reset_parameters()" in out["no_init"] and "init_fn=" in out["no_init"], out
        assert "'table'" in out["unset_buffer"] or ".table'" in out["unset_buffer"], out
        assert "RoPE" in out["unset_buffer"] and "init_fn=" in out["unset_buffer"], out
        assert out["init_fn"] is None, out  # init_fn sets what reset_parameters() could not
        assert "meta device and some are not" in out["partly"], out
