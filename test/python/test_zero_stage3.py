"""ZeRO stage 3 over 2 and 3 CPU ranks against a single-process torch reference:
a model with a ModuleList of blocks, an embedding tied to the output head, a
frozen parameter, a block called twice per forward and a block run on some steps
only."""

import collections

import pytest
import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd

VOCAB, D, H = 19, 10, 14  # odd sizes: shards are padded at 2 and 3 ranks
BATCH, SEQ = 6, 5  # global batch, divisible by 2 and 3
STEPS = 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(D, H)
        self.down = torch.nn.Linear(H, D)
        self.scale = torch.nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x))) * self.scale


class Net(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.blocks[0].scale.requires_grad_(False)  # frozen, still in the optimizer
        self.norm = torch.nn.LayerNorm(D)

    def forward(self, ids, branch=True):
        x = self.emb(ids)
        x = self.blocks[0](x)
        x = self.blocks[1](self.blocks[1](x))  # one unit called twice
        if branch:
            x = self.blocks[2](x)
        return F.linear(self.norm(x), self.emb.weight)  # the output head is the embedding


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def local(t):
    k = t.shape[0] // hvd.size()
    return t[hvd.rank() * k:(hvd.rank() + 1) * k]


def branch_on(step):
    return step % 3 != 1  # the last block runs on some steps only


def loss_of(model, ids, target, step):
    return F.cross_entropy(model(ids, branch_on(step)).reshape(-1, VOCAB), target.reshape(-1))


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference(steps=STEPS, passes=1):
    model = Net()
    opt = adamw(model)
    for step in range(steps):
        for micro in range(passes):
            ids, target = batch(10 * step + micro)
            (loss_of(model, ids, target, step) / passes).backward()
        opt.step()
        opt.zero_grad()
    return model


def train(model, opt, steps=STEPS, passes=1, coalesce=False, start=0):
    import contextlib
    for step in range(start, start + steps):
        with opt.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for micro in range(passes):
                ids, target = batch(10 * step + micro)
                (loss_of(model, local(ids), local(target), step) / passes).backward()
        opt.step()
        opt.zero_grad()


def full_params(model, opt):
    with opt.gathered_params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_errors(params, ref):
    return {n: float((params[n].double() - q.detach().double()).norm() / q.detach().double().norm())
            for n, q in ref.named_parameters()}


def with_env(env, make):
    """make() with these HOROVOD_ZERO_* set: the optimizer reads them when it is built."""
    import os
    os.environ.update(env)
    try:
        return make()
    finally:
        for k in env:
            del os.environ[k]


def stage3(model, prefetch=1, **kw):
    return with_env({"HOROVOD_ZERO_PREFETCH": str(prefetch)},
                    lambda: hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3, **kw))


def _parity(prefetch, passes, coalesce, reshard_after_forward=True):
    model = Net()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = stage3(model, prefetch, backward_passes_per_step=passes if not coalesce else 1,
                 reshard_after_forward=reshard_after_forward)
    train(model, opt, passes=passes, coalesce=coalesce)
    params = full_params(model, opt)
    moved = sorted(n for n, p in params.items() if not torch.equal(p, initial[n]))
    return rel_errors(params, reference(passes=passes)), moved, opt._params.forward_order.changes


@pytest.mark.parametrize("prefetch,passes,coalesce,raf", [(1, 1, False, True), (0, 1, False, True), (2, 1, False, True),
                                                          (1, 2, False, True), (1, 3, True, True), (1, 1, False, False)],
                         ids=["prefetch1", "prefetch0", "prefetch2", "backward_passes_per_step2", "coalesce3",
                              "no_reshard_after_forward"])
def test_stage3_matches_single_process_torch(ranks, prefetch, passes, coalesce, raf):
    trained = sorted(n for n, p in Net().named_parameters() if p.requires_grad)
    for errs, moved, changes in ranks.run(_parity, prefetch, passes, coalesce, raf):
        assert max(errs.values()) < 1e-6, errs
        assert moved == trained, moved  # the frozen scale stays, every other parameter trains
        assert changes >= 2, changes  # the branch changes the forward order, and changes it back


# --- memory ---------------------------------------------------------------------------------

def _storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (a storage shared by views counts once)."""
    seen = {}
    for t in tensors:
        if torch.is_tensor(t):
            st = t.untyped_storage()
            seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
    return sum(seen.values())


def held_bytes(model, opt):
    """What this rank holds for the model: parameters and their gradients, the wrapper's
    buffers, master shards with their gradients, and the optimizer state."""
    params = list(model.parameters())
    st = opt._storage
    masters = list(opt.param_groups[0]["params"])
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": _storage_bytes(params + st.stores + st.master),
            "grads": _storage_bytes([p.grad for p in params] + [m.grad for m in masters]),
            "state": _storage_bytes(state)}


def _memory_at_rest(stage):
    model = Net()
    model.requires_grad_(True)
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=stage)
    ids, target = batch(0)
    loss_of(model, local(ids), local(target), 0).backward()
    opt.step()  # gradient shards are kept until zero_grad(): the most held at rest
    held = held_bytes(model, opt)
    return held, sum(s.shard for s in opt.sharded_state.shards)


def test_stage3_holds_16_over_n_bytes_per_parameter_at_rest(ranks):
    numel = sum(p.numel() for p in Net().parameters())
    n = ranks.size
    for held, shard_numel in ranks.run(_memory_at_rest, 3):
        # fp32 master 4 + fp32 gradient shard 4 + AdamW exp_avg and exp_avg_sq 8 = 16 bytes a shard element;
        # no full parameter, no second low-precision shard.
        assert held == {"params": 4 * shard_numel, "grads": 4 * shard_numel, "state": 8 * shard_numel}, held
        assert sum(held.values()) <= 16 * numel / n * 1.1, (held, numel)  # padding only
    for held, _ in ranks.run(_memory_at_rest, 2):  # stage 2 keeps whole parameters: the test can tell
        assert held["params"] > 4 * numel, held


def _coalescing_holds_full_gradients():
    model = Net()
    model.requires_grad_(True)
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3)
    with opt.coalesce_grad_reduction():
        for micro in range(2):
            ids, target = batch(micro)
            loss_of(model, local(ids), local(target), 0).backward()
        inside = held_bytes(model, opt)
    return inside, held_bytes(model, opt)


def test_coalescing_at_stage3_holds_whole_gradients_until_the_block_exits(ranks):
    """The memory cost of coalescing: every gradient whole (param_dtype) until the one reduction."""
    numel = sum(p.numel() for p in Net().parameters())
    for inside, after in ranks.run(_coalescing_holds_full_gradients):
        assert inside["grads"] == 4 * numel, inside
        assert after["grads"] == 0, after  # handed to the reduce-scatters; the shards come at step()


def _root_between_forward_and_backward(reshard_root):
    model = Net()
    opt = stage3(model, reshard_root_after_forward=reshard_root)
    params = []
    for step in range(2):
        ids, target = batch(10 * step)  # as reference() numbers them
        loss = loss_of(model, local(ids), local(target), step)
        held = model.emb.weight.untyped_storage().nbytes()
        loss.backward()  # fails unless backward gathered the root again
        opt.step()
        opt.zero_grad()
    return held, rel_errors(full_params(model, opt), reference(steps=2))


def test_reshard_root_after_forward_frees_the_root_until_backward(ranks):
    # By default the root stays gathered from forward to backward, as FSDP2 keeps its root;
    # with the option, as FSDP2 with reshard_after_forward=True on the root, the loss (here,
    # over logits the size of the vocabulary) is computed without the embedding and head
    # gathered, and backward gathers them again.
    for held, errs in ranks.run(_root_between_forward_and_backward, True):
        assert held == 0 and max(errs.values()) < 1e-6, (held, errs)
    for held, errs in ranks.run(_root_between_forward_and_backward, False):
        assert held >= VOCAB * D * 4 and max(errs.values()) < 1e-6, (held, errs)  # the padded fp32 embedding


class _ScaleOut(torch.nn.Module):
    """Returns a view of its own (root) parameter beside the blocks' output, as a policy
    returning its log-std does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(2))
        self.log_std = torch.nn.Parameter(torch.zeros(D))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x, self.log_std.expand_as(x)


def _root_view_output():
    model = _ScaleOut()
    opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3, reshard_root_after_forward=True)
    x = torch.randn(4, D)
    mean, log_std = model(x)
    read = float(log_std.sum())  # freeing the root would have emptied this view
    (mean.pow(2).mean() + log_std.pow(2).mean()).backward()
    opt.step()
    return read


def test_an_output_that_views_a_root_parameter_keeps_the_root_gathered(ranks):
    assert ranks.run(_root_view_output) == [0.0] * ranks.size


def _raising_backward_then_training():
    model = Net()
    opt = stage3(model)
    fail = [True]

    def raise_once(module, grad_in, grad_out):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("injected")
    hook = model.blocks[1].register_full_backward_hook(raise_once)
    ids, target = batch(0)
    try:
        loss_of(model, local(ids), local(target), 0).backward()
    except RuntimeError as e:
        assert "injected" in str(e)
    hook.remove()
    opt.zero_grad()  # frees what the failed backward left gathered
    train(model, opt, steps=STEPS)
    return rel_errors(full_params(model, opt), reference()), opt._params.backward_order.changes


def test_a_backward_that_raised_leaves_the_next_steps_right(ranks):
    # autograd drops the callback queued for the end of a backward that raised; the next
    # forward must not take it as still queued (the root would then stay gathered and the
    # backward order never be recorded again).
    for errs, _ in ranks.run(_raising_backward_then_training):
        assert max(errs.values()) < 1e-6, errs


def _dropped_optimizer_releases_its_gathers():
    import gc
    model = Net()
    opt = stage3(model)
    train(model, opt, steps=1)
    with torch.no_grad():  # an evaluation forward: its gathers are waited for in the stream order
        model(local(batch(0)[0]))
    tables = (opt._gatherer.in_flight, opt._gatherer._ordered)
    before = sum(map(len, tables))
    del opt
    gc.collect()
    return before, sum(map(len, tables))


def test_a_dropped_optimizer_releases_its_gather_handles(ranks):
    # Each handle holds its gather's input and output in the runtime until it is synchronized.
    for before, after in ranks.run(_dropped_optimizer_releases_its_gathers):
        assert before > 0 and after == 0, (before, after)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a unit's backward long enough for the reductions
    submitted before it to finish."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import time
        time.sleep(0.3)
        return g


def _in_flight_after_backward():
    model = Net()
    for b in model.blocks:
        b.register_forward_pre_hook(lambda m, args: (_SlowBackward.apply(args[0]),))
    opt = stage3(model)
    ids, target = batch(0)
    loss_of(model, local(ids), local(target), 0).backward()
    st, red = opt._storage, opt._reducer
    in_flight = sorted(st.shards[i].name for i, hs in red._pending.items() if hs)
    opt.step()
    return in_flight


def test_backward_lets_go_of_each_full_gradient_once_its_reduction_is_done(ranks):
    # A handle keeps the full gradient it reduces until it is waited for: each unit's flush
    # takes the finished ones, so at the end of backward only the last unit's (blocks.0)
    # and the root's are still held, not every gradient of the model until step().
    for in_flight in ranks.run(_in_flight_after_backward):
        assert all(n.startswith(("blocks.0.", "emb.", "norm.")) for n in in_flight), in_flight


# --- no full fp32 parameter -----------------------------------------------------------------

def _full_fp32_tensors(downcast):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    model = Net()
    opt = with_env({"HOROVOD_ZERO_DOWNCAST": downcast}, lambda: hvd.DistributedZeroOptimizer(
        adamw(model), model=model, stage=3, param_dtype=torch.bfloat16))
    # Full sizes of the larger parameters: no activation or shard here has these sizes.
    full = {n for s in opt.sharded_state.shards if s.numel >= 100 for n in (s.numel, s.padded)}
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and t.dtype == torch.float32 and t.numel() in full:
                    seen.append((str(func), t.numel()))
            return out

    with Watch():
        for step in range(2):
            ids, target = batch(step)
            loss_of(model, local(ids), local(target), step).float().backward()
            opt.step()
            opt.zero_grad()
    return seen


def test_no_full_fp32_parameter_is_ever_made(ranks):
    for seen in ranks.run(_full_fp32_tensors, "1"):
        assert seen == [], seen
    # Gathering fp32 and casting afterwards makes them: the check can see them.
    for seen in ranks.run(_full_fp32_tensors, "0"):
        assert seen, "HOROVOD_ZERO_DOWNCAST=0 makes full fp32 parameters, and the check missed them"


# --- collectives ----------------------------------------------------------------------------

def _collectives(prefetch, reshard_after_forward=True):
    model = Net()
    opt = stage3(model, prefetch, reshard_after_forward=reshard_after_forward)
    per_step = []
    for step in range(3):
        hvd.collective_stats(reset=True)
        ids, target = batch(step)
        F.cross_entropy(model(local(ids)).reshape(-1, VOCAB), local(target).reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        stats = [s for s in hvd.collective_stats() if s["op"] == "allgather"]
        per_step.append((sum(s["collectives"] for s in stats), sum(s["tensors"] for s in stats)))
    return per_step


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_each_unit_gather_is_one_collective(ranks, prefetch):
    # Root (emb, norm: 3 tensors) once; each unit call (blocks 0, 1, 1, 2: 5 tensors each) in
    # forward and again in backward.
    for per_step in ranks.run(_collectives, prefetch):
        assert all(t == 3 + 5 * 4 * 2 for _, t in per_step), per_step
        if prefetch == 0:  # nothing else in flight: one fused collective per grouped gather
            assert all(c == 1 + 4 * 2 for c, _ in per_step), per_step
        else:  # prefetched gathers may share a collective
            assert all(c <= 1 + 4 * 2 for c, _ in per_step), per_step


def test_without_reshard_after_forward_backward_gathers_less(ranks):
    # Forward gathers the root and blocks 0, 1 and 2 once each (the second call of block 1
    # finds it gathered), and the root stays gathered; backward frees each unit after its
    # backward, so only the first call of block 1 gathers again.
    for per_step in ranks.run(_collectives, 0, False):
        assert all(t == 3 + 5 * 4 and c == 1 + 4 for c, t in per_step), per_step


# --- models without a ModuleList ------------------------------------------------------------

def _any_model(kind):
    """Stage 3 with no units= on a model without a ModuleList, against the reference."""
    import refs
    make = {"sequential": refs.mlp,  # units: its two Linear layers
            "one-layer": lambda: (torch.manual_seed(0), torch.nn.Linear(16, 7))[1]}[kind]  # no unit: all in the root
    model = make()
    opt = hvd.DistributedZeroOptimizer(refs.adamw(model.named_parameters()), model=model, stage=3)
    n, r = hvd.size(), hvd.rank()
    for step in range(refs.STEPS):
        x, y = refs.batch(step, 0)
        refs.mse(model, refs.rank_rows(x, r, n), refs.rank_rows(y, r, n)).backward()
        opt.step()
        opt.zero_grad()
    ref = make()
    refs.train_reference(1, None, model=ref, opt=refs.adamw(ref.named_parameters()))
    with opt.gathered_params():
        errs = [refs.rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters())]
    return len(opt._params.units), errs


@pytest.mark.parametrize("kind,units", [("sequential", 2), ("one-layer", 0)])
def test_stage3_takes_a_model_without_a_module_list(ranks, kind, units):
    for n_units, errs in ranks.run(_any_model, kind):
        assert n_units == units
        assert max(errs) < 1e-5, errs


Pair = collections.namedtuple("Pair", "x y")


def _trees(a, b, frozen):
    return {
        "output": a,
        "output without grad": frozen,
        "args": ((a, None, 3, frozen), {}),
        "args and kwargs": ((a,), {"mask": b, "scale": 0.5, "name": "x", "flag": True}),
        "no grad anywhere": ((frozen, 2), {"m": None}),
        "nested (pytree)": (([a, (b,)],), {}),
        "namedtuple (pytree)": ((Pair(a, b),), {}),
        "dict output (pytree)": {"h": a, "aux": frozen},
    }


@pytest.mark.parametrize("case", list(_trees(0, 0, 0)))
def test_unit_hooks_pass_any_input_or_output_tree_through_as_pytree_would(case, monkeypatch):
    """The unit hooks' shortcut for plain trees (one tensor; args and kwargs of leaves)
    gives what the pytree path gives: the same structure, the same values, each tensor that
    needs grad behind one node whose backward calls the hook once, gradients unchanged."""
    from horovod_zero.torch.zero.stage3 import hooks

    def run(shortcut):
        a = torch.arange(4.0, requires_grad=True)
        b = torch.ones(4, requires_grad=True)
        tree = _trees(a, b, torch.zeros(4))[case]
        calls = []
        with monkeypatch.context() as m:
            if not shortcut:
                m.setattr(hooks, "_simple_through", lambda *_: hooks._NOT_SIMPLE)
            out = hooks._through(lambda: calls.append(1), tree)
        if out is None:
            return None, calls, None
        leaves, spec = hooks.tree_flatten(out)
        grad_leaves = [t for t in leaves if torch.is_tensor(t) and t.requires_grad]
        assert all(t is not a and t is not b for t in grad_leaves)  # passed through the node
        sum((t * (k + 1)).sum() for k, t in enumerate(grad_leaves)).backward()
        values = [t.detach().clone() if torch.is_tensor(t) else t for t in leaves]
        return (spec, values), calls, (a.grad, b.grad)

    fast, fast_calls, fast_grads = run(True)
    slow, slow_calls, slow_grads = run(False)
    assert (fast is None) == (slow is None) == (case in ("output without grad", "no grad anywhere"))
    if fast is None:
        return
    assert fast[0] == slow[0]
    assert len(fast[1]) == len(slow[1]) and all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(fast[1], slow[1]))
    assert fast_calls == slow_calls == [1]
    for x, y in zip(fast_grads, slow_grads):
        assert (x is None and y is None) or torch.equal(x, y)
