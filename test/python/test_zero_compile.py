"""torch.compile and activation checkpointing at every ZeRO stage, over 2 and 3 CPU
ranks with inductor on CPU (hybrid sharding over 4 ranks through aot_eager), against
plain single-process eager torch.

The model is the shape users compile block by block: an embedding tied to the
output head, four LayerNorm-Linear-GELU-Linear residual blocks in a ModuleList, a
final LayerNorm. Blocks are compiled the four ways users do it (`block.compile()` or
`torch.compile(block)` put back in the list, before or after wrapping), recomputed
with non-reentrant torch.utils.checkpoint, or both. After step 2 nothing is compiled
again: dynamo's counters stay where they were, and the four blocks share one graph
(a graph per unit would mean dynamo specialised on the unit's hooks)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import horovod_zero.torch as hvd
from harness import launch, shared_pool

VOCAB, D, H, BLOCKS = 31, 16, 24, 4
BATCH, SEQ = 12, 5  # global batch, divisible by 2, 3 and 4
STEPS = 5
WARM = 2  # steps after which nothing compiles


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, H)
        self.down = torch.nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, ac=False):
        """`ac`: True (non-reentrant checkpointing, torch's default early stop), "full"
        (non-reentrant without early stop: the whole forward is recomputed, hooks included)
        or "reentrant"."""
        super().__init__()
        torch.manual_seed(0)
        self.ac = ac
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = torch.nn.LayerNorm(D)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            if self.ac == "reentrant":
                x = checkpoint(b, x, use_reentrant=True)
            elif self.ac:
                x = checkpoint(b, x, use_reentrant=False, early_stop=self.ac != "full")
            else:
                x = b(x)
        return F.linear(self.norm(x), self.emb.weight)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model, ids, target):
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), target.reshape(-1))


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference(steps=STEPS):
    """Plain eager torch in one process, on the whole batch."""
    model = Net()
    opt = adamw(model)
    for step in range(steps):
        loss_of(model, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return model


def compile_blocks(model, how, backend="inductor"):
    """`how`: "method" (block.compile(), the module stays) or "wrap" (torch.compile(block)
    put back in the ModuleList in its place)."""
    for k, b in enumerate(model.blocks):
        if how == "method":
            b.compile(backend=backend)
        else:
            model.blocks[k] = torch.compile(b, backend=backend)


def dynamo_counts():
    from torch._dynamo.utils import counters
    return dict(counters["stats"]), sum(counters["recompiles"].values()) if "recompiles" in counters else 0


def train_case(stage, how, when, ac, options=None, compiled_autograd=False, device="cpu", backend="inductor"):
    """Trains STEPS steps; returns each parameter's relative error against the reference,
    and dynamo's counters after step WARM and at the end. `device`: "cuda" trains on this
    rank's GPU (the GPU tests); `backend`: torch.compile's for the blocks."""
    import contextlib

    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # the pool's processes are shared: start from no compiled code
    counters.clear()
    dev = hvd.device() if device == "cuda" else torch.device("cpu")
    model = Net(ac=ac).to(dev)
    if how and when == "before":
        compile_blocks(model, how, backend)
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=stage, **(options or {}))
    if how and when == "after":
        compile_blocks(model, how, backend)
    n, r = hvd.size(), hvd.rank()
    k = BATCH // n
    warm = None
    for step in range(STEPS):
        ids, target = (t[r * k:(r + 1) * k].to(dev) for t in batch(step))
        loss = loss_of(model, ids, target)
        ctx = torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")) if compiled_autograd \
            else contextlib.nullcontext()
        with ctx:
            loss.backward()
        opt.step()
        opt.zero_grad()
        if step + 1 == WARM:
            warm = dynamo_counts()
    ref = dict(reference().named_parameters())
    gathered = opt.gathered_params() if stage == 3 else contextlib.nullcontext()
    opt.wait_for_params()
    with gathered:
        errs = {name: float((p.detach().cpu() - ref[name.replace("._orig_mod", "")].detach()).norm()
                            / ref[name.replace("._orig_mod", "")].detach().norm())
                for name, p in model.named_parameters()}
    return errs, warm, dynamo_counts()


def check(results, compiled, tol=1e-5):
    for errs, warm, end in results:
        assert len(errs) == 3 + 6 * BLOCKS, sorted(errs)
        assert max(errs.values()) < tol, errs
        assert warm == end, (warm, end)  # nothing compiled after step WARM
        if compiled:
            # One graph for the four blocks: none specialised on its unit, none recompiled.
            assert end[0].get("unique_graphs") == 1 and end[1] == 0, end


# Each stage with blocks compiled, with AC, and with both; the four ways to compile are spread
# over the stages.
CASES = {
    "stage1-compiled": (1, "method", "after", False), "stage1-ac": (1, None, None, True),
    "stage1-compiled-ac": (1, "wrap", "before", True),
    "stage2-compiled": (2, "wrap", "before", False), "stage2-ac": (2, None, None, True),
    "stage2-compiled-ac": (2, "method", "after", True),
    "stage3-compiled": (3, "method", "before", False), "stage3-compiled-after": (3, "wrap", "after", False),
    "stage3-ac": (3, None, None, True), "stage3-compiled-ac": (3, "method", "before", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_blocks_and_ac_match_eager_torch(ranks, case):
    stage, how, when, ac = CASES[case]
    check(ranks.run(train_case, stage, how, when, ac, timeout=300), compiled=how is not None)


# The options that change when parameters are gathered and where the step runs, with blocks
# compiled and recomputed.
OPTION_CASES = {
    "stage1-offload": (1, {"offload_optimizer": "cpu"}),
    "stage2-overlap_param_gather": (2, {"overlap_param_gather": True}),
    "stage3-offload": (3, {"offload_optimizer": "cpu"}),
    "stage3-no-reshard-after-forward": (3, {"reshard_after_forward": False}),
    "stage3-reshard-root": (3, {"reshard_root_after_forward": True}),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_compiled_and_ac_with_options(ranks, case):
    stage, options = OPTION_CASES[case]
    check(ranks.run(train_case, stage, "method", "before", True, options, timeout=300), compiled=True)


@pytest.mark.parametrize("ac", ["full", "reentrant"])
def test_recomputation_inside_backward_keeps_the_unit_gathered(ranks, ac):
    # "full": the recomputation runs the unit's whole forward, post-forward hook included,
    # inside backward; the unit must stay gathered for the backward that follows. "reentrant":
    # the first forward ran without grad (no backward hooks), so the recomputation's hooks
    # free the unit after its backward.
    check(ranks.run(train_case, 3, None, None, ac, timeout=300), compiled=False)


def test_compiled_autograd_at_stage3():
    # Each gradient hook and unit hook is a graph break in the compiled backward; the result is
    # still eager torch's, and nothing compiles after warm-up. (2 ranks only: a minute's tracing.)
    for errs, warm, end in shared_pool(2).run(train_case, 3, "method", "before", False, None, True, timeout=300):
        assert max(errs.values()) < 1e-5, errs
        assert warm == end, (warm, end)


def _node_env(rank, local):
    return {"LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local)}


def _hybrid():
    hvd.init()
    try:
        # aot_eager: dynamo and AOTAutograd trace the blocks around the hooks as inductor's
        # would, without generating C++ on four ranks of a two-core machine (the inductor
        # cases above cover the generated code).
        return train_case(3, "method", "before", True, {"shard_group": "node"}, backend="aot_eager")
    finally:
        hvd.barrier()
        hvd.shutdown()


def test_hybrid_sharding_with_compiled_blocks_and_ac():
    res = launch(_hybrid, 4, env=functools.partial(_node_env, local=2), timeout=300)
    assert sorted(res) == [0, 1, 2, 3] and all(s == "ok" for s, _ in res.values()), res
    check([out for _, out in res.values()], compiled=True)
