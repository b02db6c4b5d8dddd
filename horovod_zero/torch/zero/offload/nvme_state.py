"""offload_optimizer="nvme": the fp32 master shards and the Adam moments live in
files under nvme_path (nvme.py's NvmeSwapper); host memory keeps only this
step's gradient shards and the param_dtype copies (HostOffload), and a bounded
staging area.

[Note: NVMe state at rest]
- At rest the master flat buffers keep their tensors (the inner optimizer's
  param groups hold views of them) but their storage is resized to 0 bytes, and
  the inner optimizer's state is empty: both are on disk. Step counts, a few bytes
  per parameter, stay in memory.
- step() reads each sub-group once (master, exp_avg, exp_avg_sq), steps the shards
  in it with the C++ Adam straight from the host gradient shards, writing their
  param_dtype copies, and writes it back once. Gradients never go to disk. The
  swapper reads the next sub-group and writes the previous one meanwhile.
- Whatever reads or replaces the whole state (state_dict, load_state_dict,
  checkpoints, export) runs inside materialized(): the master buffers and torch's
  state entries are filled from disk for the block (that needs the host memory of
  the whole shard state for its duration), and written back after it if asked."""

import contextlib

import torch

from horovod_zero import settings
from horovod_zero.torch.zero.offload.cpu_adam import adam_step_flat, chosen_isa, not_covered_reason
from horovod_zero.torch.zero.offload.nvme import NvmeSwapper, check_nvme_path

_MOMENTS = ("exp_avg", "exp_avg_sq")


class NvmeState:
    """The NVMe-resident state, and the stepper HostOffload uses for it."""

    fast = True

    def __init__(self, path, storage, optimizer):
        reason = not_covered_reason(optimizer)
        if reason is not None:
            raise ValueError(f"offload_optimizer='nvme' steps torch.optim.Adam and AdamW with the C++ CPU Adam; "
                             f"{reason}. Use offload_optimizer='cpu' for other optimizers.")
        check_nvme_path(path)
        self._path = path
        self._st = storage
        self._optimizer = optimizer
        self._swapper = None
        self.steps = []  # per shard: steps taken (torch's state["step"])

    # --- construction -------------------------------------------------------------

    def add_shards(self, shards):
        """Moves the master shards built so far to disk (the moments start as zeros there:
        the files are new, and fresh file space reads as zeros)."""
        if self._swapper is not None:
            raise ValueError("add_param_group() with offload_optimizer='nvme': the state files are laid out at "
                             "construction. Put every param group in the optimizer before wrapping it.")
        masters = self._st.master
        aio = settings.read_section("nvme")
        self._swapper = NvmeSwapper(self._path, self._st.rank, [m.numel() for m in masters],
                                    queue_depth=aio["nvme_queue_depth"], request_bytes=aio["nvme_request_bytes"])
        for g, m in enumerate(masters):
            self._swapper.write_region(g, "master", m)
            m.untyped_storage().resize_(0)
        self.steps += [0] * len(shards)

    # --- the step ---------------------------------------------------------------------

    def step(self, storage, items, outs, scale, threads=0):
        """items: (shard index, host gradient); writes outs[index] for each, stepping on
        `threads` threads (0: torch's intra-op threads)."""
        grads = dict(items)
        groups, shards = self._optimizer.param_groups, storage.shards
        sub_groups = self._swapper.sub_groups()
        by_group = {}
        for s in shards:
            by_group.setdefault(s.group, []).append(s)

        def step_sub_group(k, views):
            g, lo, hi = sub_groups[k]
            for s in by_group.get(g, ()):
                a, b = max(lo, s.offset), min(hi, s.offset + s.shard)
                if a >= b or s.index not in grads:
                    continue
                group = groups[g]
                at, to = slice(a - lo, b - lo), slice(a - s.offset, b - s.offset)
                adam_step_flat(views["master"][at], grads[s.index][to], views["exp_avg"][at],
                               views["exp_avg_sq"][at], outs[s.index][to], lr=group["lr"], betas=group["betas"],
                               eps=group["eps"], weight_decay=group["weight_decay"], step=self.steps[s.index] + 1,
                               decoupled=group.get("decoupled_weight_decay", False),
                               maximize=group.get("maximize", False), grad_scale=scale, threads=threads)

        self._swapper.for_each(sub_groups, step_sub_group)
        for i in grads:
            self.steps[i] += 1

    def describe(self):
        return f"C++ {type(self._optimizer).__name__} ({chosen_isa()}) on NVMe"

    def stats(self):
        sw = self._swapper
        return {"disk_read_bytes": sw.bytes_read if sw else 0, "disk_write_bytes": sw.bytes_written if sw else 0}

    # --- the whole state in memory, for checkpoints -------------------------------------

    @contextlib.contextmanager
    def materialized(self, write_back):
        st, opt = self._st, self._optimizer
        moments = {name: [] for name in _MOMENTS}
        for g, m in enumerate(st.master):
            m.untyped_storage().resize_(m.numel() * m.element_size())
            self._swapper.read_region(g, "master", m)
            for name in _MOMENTS:
                buf = torch.empty_like(m)
                self._swapper.read_region(g, name, buf)
                moments[name].append(buf)
        for s, mp in zip(st.shards, st.master_params):
            if self.steps[s.index] > 0:  # torch creates state at a parameter's first step
                at = slice(s.offset, s.offset + s.shard)
                opt.state[mp] = {"step": torch.tensor(float(self.steps[s.index])),
                                 **{name: moments[name][s.group][at] for name in _MOMENTS}}
        try:
            yield
            if write_back:
                self._write_back(moments)
        finally:
            opt.state.clear()
            for m in st.master:
                m.untyped_storage().resize_(0)

    def _write_back(self, moments):
        st, opt = self._st, self._optimizer
        with torch.no_grad():
            for s, mp in zip(st.shards, st.master_params):
                state = opt.state.get(mp) or {}
                at = slice(s.offset, s.offset + s.shard)
                self.steps[s.index] = int(float(state["step"])) if "step" in state else 0
                for name in _MOMENTS:
                    dst = moments[name][s.group][at]
                    if name in state:
                        if state[name].data_ptr() != dst.data_ptr():  # replaced (load_state_dict)
                            dst.copy_(state[name].reshape(-1))
                    else:
                        dst.zero_()
        for g, m in enumerate(st.master):
            self._swapper.write_region(g, "master", m)
            for name in _MOMENTS:
                self._swapper.write_region(g, name, moments[name][g])

    def close(self):
        if self._swapper is not None:
            self._swapper.close()
