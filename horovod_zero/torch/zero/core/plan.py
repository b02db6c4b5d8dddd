"""How parameters are sharded: every parameter flattened and split into `size`
equal shards (the last one zero-padded); rank r owns shard r of every parameter.
A rank's fp32 master shards of one param group live in one flat buffer."""

from dataclasses import dataclass
from typing import List

import torch


@dataclass(frozen=True)
class ParamShard:
    index: int          # position in the optimizer's parameter order; names the collectives
    name: str
    group: int          # param group index
    shape: torch.Size
    numel: int
    shard: int          # elements per rank: ceil(numel / size)
    offset: int         # start of this parameter's shard in its group's flat master buffer
    size: int           # world size

    @property
    def padded(self) -> int:
        return self.shard * self.size

    def my_range(self, rank):
        """[start, end) of the parameter's elements that rank's shard holds (the rest is padding)."""
        start = min(rank * self.shard, self.numel)
        return start, min(start + self.shard, self.numel)


def plan_group(params, names, size, group, first_index) -> List[ParamShard]:
    """The shards of one param group's parameters; their indices start at first_index."""
    shards, offset = [], 0
    for i, p in enumerate(params):
        n = p.numel()
        shard = -(-n // size)
        shards.append(ParamShard(first_index + i, names[p], group, p.shape, n, shard, offset, size))
        offset += shard
    return shards

