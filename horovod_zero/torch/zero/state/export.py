"""Export of the model's full fp32 weights, streamed: rank 0 writes safetensors files
(an 8-byte header length, a JSON header of names, dtypes, shapes and offsets, then the
raw bytes), one parameter at a time as it is gathered from the master shards, so no
process ever holds the whole model. The headers are known before any tensor moves:
the shapes come from the shard plan. Above max_file_bytes the weights go to several
files with an index, in Hugging Face's layout (model-00001-of-00003.safetensors and
model.safetensors.index.json), which its loaders read as they are."""

import json
import os
import struct

import torch

from horovod_zero.torch import enqueue as ops
from horovod_zero.torch.objects import broadcast_object

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPES = {v: k for k, v in _CODES.items()}


def _entries(model, view):
    """(name, shape, dtype, source) in state_dict order: source is a shard index (gathered
    from the master shards) or a tensor the model holds whole (buffers, untrained parameters)."""
    index = {p: s.index for s, p in zip(view.shards, view.params)}
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        p = params.get(name)
        if p is not None and p in index:
            s = view.shards[index[p]]
            out.append((name, tuple(s.shape), torch.float32, s.index))
        else:
            out.append((name, tuple(t.shape), t.dtype, t))
    return out


def _nbytes(entry):
    _, shape, dtype, _ = entry
    return dtype.itemsize * int(torch.Size(shape).numel())


def _header(entries):
    # "format": "pt" is what Hugging Face's loaders check for a PyTorch file.
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entry in entries:
        name, shape, dtype, _ = entry
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + _nbytes(entry)]}
        offset += _nbytes(entry)
    raw = json.dumps(header).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def _layout(path, entries, max_file_bytes):
    """[(file, its entries)] and the index file (None when one file holds everything).
    `path`: a file (name.safetensors: the files are name-0000k-of-0000N.safetensors beside it)
    or a directory (model.safetensors, or model-0000k-of-0000N.safetensors, in it)."""
    if os.path.isdir(path) or path.endswith(os.sep):
        directory, stem, single = path, "model", os.path.join(path, "model.safetensors")
    else:
        directory, base = os.path.split(path)
        stem, single = (base[:-len(".safetensors")] if base.endswith(".safetensors") else base), path
    groups, size = [[]], 0
    for e in entries:
        if groups[-1] and size + _nbytes(e) > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += _nbytes(e)
    if len(groups) == 1:
        return [(single, groups[0])], None
    n = len(groups)
    files = [os.path.join(directory, f"{stem}-{k:05d}-of-{n:05d}.safetensors") for k in range(1, n + 1)]
    return list(zip(files, groups)), os.path.join(directory, f"{stem}.safetensors.index.json")


def save_model(path, model, opt, format="safetensors", max_file_bytes=5 << 30):
    """Writes the model's full weights (fp32 for the trained parameters) from rank 0,
    streamed parameter by parameter: to `path` (a .safetensors file, or a directory that
    gets model.safetensors), or, above `max_file_bytes` (5 GiB, as Hugging Face), to
    several files and their index beside it. Atomically: temporary files renamed into place
    once all are written. Every rank must call it. Read it with load_model(), safetensors
    or Hugging Face's loaders."""
    if format != "safetensors":
        raise ValueError(f"format={format!r}: save_model writes 'safetensors'.")
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes={max_file_bytes}: give the largest file size in bytes, above 0.")
    view = opt.sharded_state
    with view.materialized():  # NVMe offload: the master shards are on disk
        _save_model(path, model, view, max_file_bytes)


class _Writer:
    """Rank 0's side of an export: the files being written, the first failure (told to
    every rank at the end: the gathers go on, so no rank waits), and the renames."""

    def __init__(self, files, index):
        self.files, self.index, self.failure, self.done = files, index, None, []
        self._f = None

    def _try(self, fn):
        if self.failure is None:
            try:
                fn()
            except OSError as e:
                self.failure = e

    def open(self, path, entries):
        def go():
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._f = open(f"{path}.tmp.{os.getpid()}", "wb")
            self.done.append(path)
            head = _header(entries)
            self._f.write(struct.pack("<Q", len(head)) + head)
        self._try(go)

    def write(self, t):
        self._try(lambda: self._f.write(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))

    def close(self):
        def go():
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        if self._f is not None:
            self._try(go)
        self._f = None

    def finish(self):
        """Renames every file into place (the index last), or removes them after a failure."""
        tmps = [f"{p}.tmp.{os.getpid()}" for p in self.done]
        if self.failure is None and self.index is not None:
            weight_map = {name: os.path.basename(p) for p, entries in self.files for name, _, _, _ in entries}
            total = sum(_nbytes(e) for _, entries in self.files for e in entries)
            self._try(lambda: _write_json(self.index, {"metadata": {"total_size": total}, "weight_map": weight_map}))
        if self.failure is None:
            self._try(lambda: [os.replace(t, p) for t, p in zip(tmps, self.done)])
        else:
            for t in tmps:
                if os.path.exists(t):
                    os.remove(t)


def _write_json(path, obj):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def _save_model(path, model, view, max_file_bytes):
    files, index = _layout(path, _entries(model, view), max_file_bytes)
    scope = view.scope
    writer = _Writer(files, index) if scope.is_root() else None
    for file, entries in files:
        if writer:
            writer.open(file, entries)
        for name, shape, _, source in entries:
            if isinstance(source, int):
                s = view.shards[source]
                shard = view.masters[source].detach().float().contiguous()
                t = ops.synchronize(ops._allgather_async(shard, f"zero.export.{source}", None, view.shard_set))
                t = t[:s.numel]
            else:
                t = source.detach()
            if writer:
                writer.write(t)
        if writer:
            writer.close()
    if writer:
        writer.finish()
    failure = writer.failure if writer else None
    problem = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}",
                               root_rank=scope.root, name="zero.export.saved", process_set=scope.process_set)
    if problem is not None:
        raise RuntimeError(f"Rank 0 could not write the model to {path!r}: {problem}") from failure


def _files_of(path):
    """The safetensors files save_model() wrote for `path` (one, or those its index names)."""
    if os.path.isdir(path):
        single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    elif path.endswith(".index.json"):
        single, index = None, path
    else:
        stem = path[:-len(".safetensors")] if path.endswith(".safetensors") else path
        single, index = path, f"{stem}.safetensors.index.json"
    if single is not None and os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(os.path.dirname(index), name) for name in dict.fromkeys(weight_map.values())]
    raise FileNotFoundError(f"No safetensors file or index at {path!r}.")


def load_model(path, device="cpu"):
    """The tensors save_model() wrote for `path` (one file or several with an index), by
    name: a state dict for model.load_state_dict()."""
    out = {}
    for file in _files_of(path):
        out.update(_read(file, device))
    return out


def _read(file, device):
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        dtype = _DTYPES[e["dtype"]]
        raw = torch.frombuffer(bytearray(data[a:b]), dtype=torch.uint8) if b > a else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(e["shape"]).to(device)
    return out
