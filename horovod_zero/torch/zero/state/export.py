"""Export of the model's full fp32 weights, streamed: rank 0 writes one file in the
safetensors layout (an 8-byte header length, a JSON header of names, dtypes,
shapes and offsets, then the raw bytes), one parameter at a time as it is
gathered from the master shards, so no process ever holds the whole model. The
header is known before any tensor moves: the shapes come from the shard plan."""

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


def _header(entries):
    header, offset = {}, 0
    for name, shape, dtype, _ in entries:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def save_model(path, model, opt):
    """Writes the model's full weights (fp32 for the trained parameters) to `path` from
    rank 0, streamed parameter by parameter, atomically (a temporary file renamed over
    `path`). Every rank must call it. Read it with load_model() or safetensors."""
    view = opt.sharded_state
    with view.materialized():  # NVMe offload: the master shards are on disk
        _save_model(path, model, view)


def _save_model(path, model, view):
    entries = _entries(model, view)
    tmp, f, failure = f"{path}.tmp.{os.getpid()}", None, None
    scope = view.scope
    if scope.is_root():
        try:
            f = open(tmp, "wb")
            head = _header(entries)
            f.write(struct.pack("<Q", len(head)) + head)
        except OSError as e:  # told to every rank below; the gathers go on so no rank waits
            failure, f = e, None
    for name, shape, _, source in entries:
        if isinstance(source, int):
            s = view.shards[source]
            shard = view.masters[source].detach().float().contiguous()
            t = ops.synchronize(ops._allgather_async(shard, f"zero.export.{source}", None, view.shard_set))[:s.numel]
        else:
            t = source.detach()
        if f is not None and failure is None:
            try:
                f.write(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            except OSError as e:
                failure = e
    if f is not None:
        try:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            if failure is None:
                os.replace(tmp, path)
        except OSError as e:
            failure = failure or e
        if failure is not None and os.path.exists(tmp):
            os.remove(tmp)
    problem = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}",
                               root_rank=scope.root, name="zero.export.saved", process_set=scope.process_set)
    if problem is not None:
        raise RuntimeError(f"Rank 0 could not write the model to {path!r}: {problem}") from failure


def load_model(path, device="cpu"):
    """The tensors of a file written by save_model(), by name: a state dict for
    model.load_state_dict()."""
    with open(path, "rb") as f:
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
