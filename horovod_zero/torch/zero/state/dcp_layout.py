"""Our shards in torch.distributed.checkpoint's terms. A rank holds a flat slice of each
parameter (elements [start, stop) of the flattened tensor); DCP describes a tensor's
pieces as rectangular chunks of its shape. A contiguous range of a row-major tensor
is a union of at most 2 * ndim - 1 rectangles, each itself contiguous, so each chunk
is a plain view of the flat slice: saving copies nothing, and loading writes into
the shard in place."""

from typing import List, Tuple

import torch

Rect = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


def rectangles(shape, start, stop) -> List[Rect]:
    """The rectangles, in flat order, that cover elements [start, stop) of a row-major
    tensor of `shape`."""
    shape = tuple(shape)
    if stop <= start:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = 1
    for d in shape[1:]:
        inner *= d
    first, last = start // inner, (stop - 1) // inner
    zeros = (0,) * (len(shape) - 1)

    def within(row, a, b):  # part of one row: the rectangles of the row's sub-tensor
        return [((row,) + o, (1,) + s) for o, s in rectangles(shape[1:], a, b)]

    if first == last:
        return within(first, start - first * inner, stop - first * inner)
    out = []
    full_from, full_to = first, last + 1
    if start % inner:
        out += within(first, start % inner, inner)
        full_from = first + 1
    if stop % inner:
        full_to = last
    if full_to > full_from:
        out.append(((full_from,) + zeros, (full_to - full_from,) + shape[1:]))
    if stop % inner:
        out += within(last, 0, stop % inner)
    return out


def _flat_index(shape, offsets):
    i = 0
    for d, o in zip(shape, offsets):
        i = i * d + o
    return i


class FlatSlice:
    """Elements [start, stop) of a tensor of `shape`, held contiguously in `local` (its
    first element is element `start`). DCP's planners read its chunks through the
    __create_write_items__ / __create_chunk_list__ protocol that DTensor implements;
    the planners in dcp_io.py look its chunks up (chunk())."""

    def __init__(self, local, shape, start, stop):
        self.local, self.shape, self.start, self.stop = local, torch.Size(shape), start, stop
        self._rects = rectangles(self.shape, start, stop)
        if not self._rects and self.shape.numel() == 0 and start == 0:
            self._rects = [((0,) * len(self.shape), tuple(self.shape))]  # an empty tensor still has its key

    def size(self):
        return self.shape

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in self._rects]

    def __create_write_items__(self, fqn, _obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), torch.Size(s)),
                                                      properties=props, size=self.shape))
                for o, s in self._rects]

    def chunk(self, offsets) -> torch.Tensor:
        """The view of `local` that holds the chunk starting at `offsets`."""
        for o, s in self._rects:
            if tuple(o) == tuple(offsets):
                begin = _flat_index(self.shape, o) - self.start
                return self.local[begin:begin + torch.Size(s).numel()].view(s)
        raise ValueError(f"no chunk of this rank starts at {tuple(offsets)} (it holds elements "
                         f"[{self.start}, {self.stop}) of a tensor of shape {tuple(self.shape)})")
