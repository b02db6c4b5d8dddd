"""torch.distributed.checkpoint's save and load protocol, run over this runtime's
collectives instead of a torch.distributed process group. DCP's planners and its
FileSystemWriter/Reader do the work (the files are DCP's own, so torch's dcp.load and
dcp.save read and write the same checkpoints); this file only moves their plans
between the ranks, the way dcp.save and dcp.load do:

- save: every rank makes its local plan; the plans are allgathered and every rank
  derives the same global plan from them (deterministic, so it need not be sent);
  each rank writes its own files; the write results are gathered and the first rank
  writes the metadata.
- load: the first rank reads the metadata and checks that every file it names
  exists; every rank then reads the chunks it needs from whichever files hold them.

Each phase ends in a collective that also carries each rank's failure, so a rank
that fails makes every rank raise, naming it, rather than leaving the others waiting."""

import os

from horovod_zero.torch import basics
from horovod_zero.torch.objects import allgather_object, broadcast_object
from horovod_zero.torch.zero.state.dcp_layout import FlatSlice

METADATA = ".metadata"


# torch.distributed.checkpoint is imported where a checkpoint is first saved or loaded, not
# with horovod_zero: it takes about a second, which every process of a job would pay.

def _save_planner():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = self.state_dict[index.fqn]
            return obj.chunk(index.offset) if isinstance(obj, FlatSlice) else super().lookup_object(index)
    return SavePlanner()


def _load_planner():
    """Takes the state dict flat (keys as DCP writes them: model.x, optim.state.x.exp_avg)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # Not DefaultLoadPlanner's: it first passes the values through _init_state_dict, which
            # puts None in place of every value that is no tensor (our FlatSlices among them).
            self.original_state_dict = self.state_dict = state_dict
            self.metadata, self.is_coordinator = metadata, is_coordinator

        def lookup_tensor(self, index):
            obj = self.state_dict[index.fqn]
            return obj.chunk(index.offset) if isinstance(obj, FlatSlice) else super().lookup_tensor(index)
    return LoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _writer(path):
    from torch.distributed.checkpoint import FileSystemWriter
    return FileSystemWriter(path, single_file_per_rank=True, sync_files=True)


def _reader(path):
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader(path)


def _position(scope):
    """This rank's place in the scope's rank order (files are named by it)."""
    return scope.process_set.rank() if scope.process_set is not None else basics.rank()


def exchange(scope, name, value=None, failure=None, what=""):
    """Every rank's `value`, in rank order; raises on every rank when any rank failed."""
    mine = ("error", f"{type(failure).__name__}: {failure}") if failure is not None else ("ok", value)
    everyone = allgather_object(mine, name=name, process_set=scope.process_set)
    ranks = scope.process_set.ranks if scope.process_set is not None else range(len(everyone))  # the job's ranks
    errors = [f"rank {r}: {v}" for r, (tag, v) in zip(ranks, everyone) if tag == "error"]
    if errors:
        raise RuntimeError(f"{what} failed on {len(errors)} rank(s), so no rank goes on: " + "; ".join(errors)) \
            from failure
    return [v for _, v in everyone]


def announce(scope, name, failure, what):
    """The first rank's outcome (a failure or None), on every rank; raises on all if it failed."""
    problem = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}",
                               root_rank=scope.root, name=name, process_set=scope.process_set)
    if problem is not None:
        raise RuntimeError(f"{what}: {problem}") from failure


class PlannedSave:
    """A save whose plan every rank agreed on: write() writes this rank's files (no
    collective, so it may run on another thread) and finish() (every rank) writes
    the metadata once all have written."""

    def __init__(self, make_state, path, scope, tag):
        self.path, self.scope, self.tag = path, scope, tag
        self._writer = _writer(path)
        self._planner = _save_planner()
        first = scope.is_root()
        local, failure = None, None
        try:
            state_dict = make_state()  # here, so that a rank that fails to make it is heard
            self._planner.set_up_planner(state_dict=state_dict, storage_meta=self._writer.storage_meta(),
                                         is_coordinator=first)
            self._writer.set_up_storage_writer(first, rank=_position(scope), use_collectives=True)
            local = self._writer.prepare_local_plan(self._planner.create_local_plan())
        except Exception as e:  # every rank must hear of it
            failure = e
        plans = exchange(scope, f"{tag}.plan", local, failure, f"Planning the checkpoint {path!r}")
        plans, self._metadata = self._planner.create_global_plan(plans)
        plans = self._writer.prepare_global_plan(plans)
        self._plan = self._planner.finish_plan(plans[_position(scope)])
        self._results, self._failure = None, None

    def write(self):
        """Writes this rank's files; a failure is kept for finish() to report."""
        try:
            pending = self._writer.write_data(self._plan, self._planner)
            pending.wait()
            self._results = pending.value()
        except Exception as e:  # reported to every rank by finish()
            self._failure = e
        finally:
            self._planner = None  # and with it the state it wrote (an async save's staged copy)

    def finish(self):
        results = exchange(self.scope, f"{self.tag}.written", self._results, self._failure,
                            f"Writing the checkpoint {self.path!r}")
        failure = None
        if self.scope.is_root():
            try:
                self._writer.finish(metadata=self._metadata, results=results)
            except Exception as e:  # every rank must hear of it
                failure = e
        announce(self.scope, f"{self.tag}.finished", failure, f"Writing the metadata of {self.path!r} failed")


def missing_files(path, metadata):
    """The data files the metadata names that are not in `path`."""
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    return [f for f in files if not os.path.isfile(os.path.join(path, f))]


def read_metadata(path, scope, tag):
    """The checkpoint's metadata on every rank (read once, by the first rank), after it
    checked that every file the metadata names is there."""
    metadata, failure = None, None
    if scope.is_root():
        try:
            if not os.path.isfile(os.path.join(path, METADATA)):
                raise FileNotFoundError(f"{path!r} has no {METADATA} file: it is no complete DCP checkpoint")
            metadata = _reader(path).read_metadata()
            gone = missing_files(path, metadata)
            if gone:
                raise FileNotFoundError(
                    f"the checkpoint {path!r} is incomplete: its metadata names {gone[:4]}"
                    f"{' and more' if len(gone) > 4 else ''}, which are not there (a rank's files were lost or not "
                    "copied)")
        except Exception as e:  # every rank raises alike
            failure = e
    payload = broadcast_object(("error", f"{type(failure).__name__}: {failure}") if failure is not None
                               else ("ok", metadata), root_rank=scope.root, name=f"{tag}.metadata",
                               process_set=scope.process_set)
    if payload[0] == "error":
        raise RuntimeError(f"No rank loads the checkpoint: {payload[1]}") from failure
    return payload[1]


def read(flat_state, path, metadata, scope, tag):
    """Fills `flat_state` (flat DCP keys -> FlatSlice, tensor, or a placeholder for an
    object) from the checkpoint: tensors in place, objects replaced by their values."""
    failure = None
    try:
        reader = _reader(path)
        planner = _load_planner()
        planner.set_up_planner(flat_state, metadata, scope.is_root())
        reader.set_up_storage_reader(metadata, scope.is_root(), rank=_position(scope), use_collectives=True)
        plan = planner.finish_plan(reader.prepare_local_plan(planner.create_local_plan()))
        reader.read_data(plan, planner).wait()
    except Exception as e:  # every rank raises alike
        failure = e
    exchange(scope, f"{tag}.read", None, failure, f"Reading the checkpoint {path!r} (what was read before the "
             "failure may be in the model and optimizer: load a good checkpoint before training on)")


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

