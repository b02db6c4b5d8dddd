"""Sharded storage of the optimizer's parameters: each parameter's flat padded
buffer (the allgather's output, in param_dtype on the parameters' device) and
this rank's fp32 master shard (a view of its param group's flat buffer on the
master device). The two devices are separate settings: offload keeps master
shards on the host while the parameters stay on the GPU.

[Note: stage 3 storage]
At stage 3 a parameter at rest is only its fp32 master shard. Its padded buffer
keeps its tensor but its storage is resized to 0 bytes, and the parameter's data
is an empty tensor, so using it outside a gather fails (a shape error, or a
clear one from the unit hooks) instead of reading stale values. unshard()
resizes the same storage back, so the views autograd saved in forward see the
values gathered again before backward; reshard() frees it, also under those
saved views (FSDP2 does the same with its unsharded parameters)."""

import torch

from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.zero.core.plan import plan_group


class ShardedStorage:
    def __init__(self, groups, param_device, master_device, param_dtype, init_chunk_bytes, sharded_params):
        # Which ranks share this rank's shards (hybrid.ShardGroups): this rank's place among
        # them, their number, the set that reduce-scatters and gathers them, and the optimizer's
        # whole scope.
        self.groups = groups
        self.rank, self.size = groups.rank, groups.size
        self.param_device, self.master_device = param_device, master_device
        self.param_dtype = param_dtype
        self._init_chunk_bytes = init_chunk_bytes  # HOROVOD_ZERO_INIT_CHUNK_BYTES
        self.sharded_params = sharded_params  # stage 3: full parameters exist only while gathered
        # Indexed by shard index (the parameter's position in the optimizer's order).
        self.shards, self.params, self.stores, self.master_params = [], [], [], []
        self.master, self.plan = [], []  # per param group: flat fp32 buffer, its ParamShards
        self.shard_of = {}
        self.init_path = "device"
        # Stage 3's hooks point each parameter at its full view, or at an empty tensor, twice
        # a step per parameter: made once each, they cost the host 0.4 us to assign instead of
        # 5 us (a view) or 2.5 us (an empty tensor). A view is made the first time its storage
        # is allocated (slicing checks the storage's size) and stays valid across resizes.
        self._views = {}  # shard index -> store[:numel].view(shape)
        self._empties = {}  # shard index -> an empty tensor of its dtype (none shared: nothing aliases)

    def add_groups(self, groups, first, names, batches=None):
        """Shards `groups` (param groups `first`, ... of the optimizer, still holding the
        model's parameters): each parameter is moved into its padded buffer and the
        group gets views of a flat fp32 master buffer instead. Returns the parameters.
        `batches(params)`, when given, yields the parameters in batches as they become real
        (a model built on the meta device, wrap/meta_init.py): each batch is sharded and
        its full values freed before the next is made."""
        params = [p for g in groups for p in g["params"]]
        index = len(self.shards)
        names = names or {p: f"param.{i}" for i, p in enumerate(params, index)}
        plan = []
        for g, group in enumerate(groups, first):
            plan.append(plan_group(group["params"], names, self.size, g, index + sum(map(len, plan))))
        shards = [s for g in plan for s in g]
        chunk = self._init_chunk(shards, params)
        self.init_path = "device" if chunk is None else f"chunked ({chunk} elements)"
        masters = [torch.zeros(sum(s.shard for s in gs), dtype=torch.float32, device=self.master_device) for gs in plan]
        slot = {p: (s, m[s.offset:s.offset + s.shard]) for gs, m, g in zip(plan, masters, groups)
                for s, p in zip(gs, g["params"])}
        stores = {}
        for batch in (batches(params) if batches is not None else [params]):
            _broadcast_initial_values([slot[p][0] for p in batch], batch, self.groups)
            for p in batch:
                s, master_slice = slot[p]
                stores[s.index] = self._rehome(s, p, master_slice, chunk)
                if self.sharded_params:
                    self._release(s, p, stores[s.index])
        for group, gs, master in zip(groups, plan, masters):
            views = [torch.nn.Parameter(master[s.offset:s.offset + s.shard], requires_grad=p.requires_grad)
                     for s, p in zip(gs, group["params"])]
            group["params"] = views
            self.master.append(master)
            self.master_params += views
        self.stores += [stores[s.index] for s in shards]
        self.plan += plan
        self.shards += shards
        self.params += params
        self.shard_of.update(zip(params, shards))
        return params

    def _init_chunk(self, shards, params):
        """None: build on the device directly. Otherwise the number of elements per chunk
        for the fallback, which stages each parameter through host memory so that its
        device copy is freed before its new storage is allocated."""
        if self._init_chunk_bytes:
            return max(1, self._init_chunk_bytes // 4)
        if self.param_device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.param_device)
        biggest = max((p.numel() for p in params), default=0)
        # Master and gradient shards in fp32, plus one parameter's new storage at a time.
        need = 8 * sum(s.shard for s in shards) + 4 * biggest
        return None if need < 0.9 * free else (64 << 20) // 4

    def _rehome(self, s, p, master_slice, chunk):
        """Moves p into zero-padded flat storage and fills its fp32 master shard."""
        lo, hi = s.my_range(self.rank)
        dtype = self.param_dtype or p.dtype
        if chunk is None:
            flat = p.detach().reshape(-1)
            master_slice[:hi - lo].copy_(flat[lo:hi])
            store = torch.zeros(s.padded, dtype=dtype, device=self.param_device)
            store[:s.numel].copy_(flat)
        else:
            host = p.detach().reshape(-1).to("cpu")  # a copy unless p is on the host already (device=)
            p.data = torch.empty(0, dtype=p.dtype, device=self.param_device)  # free the device copy first
            store = torch.zeros(s.padded, dtype=dtype, device=self.param_device)
            for a in range(0, s.numel, chunk):
                b = min(a + chunk, s.numel)
                store[a:b].copy_(host[a:b].to(self.param_device, non_blocking=False))
            for a in range(lo, hi, chunk):
                b = min(a + chunk, hi)
                master_slice[a - lo:b - lo].copy_(host[a:b].to(self.master_device))
        p.data = store[:s.numel].view(s.shape)  # the allgather lands here
        return store

    # --- stage 3: the full parameter exists only between unshard() and reshard() ----

    def is_unsharded(self, i):
        return self.stores[i].untyped_storage().nbytes() > 0

    def unshard(self, i):
        """Allocates parameter i's full storage (its contents are undefined until a
        gather lands in it) and points the parameter at it. Returns the buffer."""
        s, p, store = self.shards[i], self.params[i], self.stores[i]
        if not self.is_unsharded(i):
            store.untyped_storage().resize_(s.padded * store.element_size())
        view = self._views.get(i)
        if view is None:
            view = self._views[i] = store[:s.numel].view(s.shape)
        p.data = view
        return store

    def drop(self, i):
        """Stages 1 and 2, during the step: frees parameter i's storage; the parameter keeps
        its view of it, which allocate() (the next gather) makes valid again."""
        self.stores[i].untyped_storage().resize_(0)

    def allocate(self, i):
        """The buffer a gather of parameter i lands in, its storage allocated again if drop()
        freed it."""
        store = self.stores[i]
        if not self.is_unsharded(i):
            store.untyped_storage().resize_(self.shards[i].padded * store.element_size())
        return store

    def reshard(self, i):
        self._release(self.shards[i], self.params[i], self.stores[i])

    def _release(self, s, p, store):
        empty = self._empties.get(s.index)
        if empty is None:
            empty = self._empties[s.index] = torch.empty(0, dtype=store.dtype, device=store.device)
        p.data = empty
        store.untyped_storage().resize_(0)

    def holds_storage(self, i):
        """Whether parameter i still uses the storage its gathers land in (model.float(),
        .to() or `p.data =` after wrapping replace it)."""
        p, store = self.params[i], self.stores[i]
        if p.dtype != store.dtype:
            return False
        if self.sharded_params and not self.is_unsharded(i):
            return p.numel() == 0 and p.device == store.device
        if self.shards[i].numel == 0:
            return p.device == store.device
        # One address space for the host and every GPU: the same address is the same device.
        # (This runs for every parameter at each step; a device comparison costs more.)
        return p.data_ptr() == store.data_ptr()


def _broadcast_initial_values(shards, params, groups):
    """Every rank starts from rank 0's values, as DDP does at construction. The fp32
    master shards are built from them, so a broadcast_parameters() after wrapping
    (which would reach the parameters but not the masters) changes nothing."""
    with torch.no_grad():
        process_set, root, tag = groups.scope.process_set, groups.scope.root, groups.tag
        handles = [ops._enqueue_one(ops._core.OP_BROADCAST, p.data, p.data, f"{tag}.init.{s.index}", root=root,
                                    process_set=process_set) for s, p in zip(shards, params) if p.is_contiguous()]
        ops.synchronize(handles)
        for s, p in zip(shards, params):
            if not p.is_contiguous():
                p.data = ops.synchronize(ops._broadcast_async(p.data.contiguous(), root, f"{tag}.init.{s.index}",
                                                              process_set))
