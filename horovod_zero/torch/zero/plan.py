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


def build_plan(param_groups, names, size) -> List[List[ParamShard]]:
    """Per param group, its parameters' shards, in optimizer order."""
    plan, index = [], 0
    for g, group in enumerate(param_groups):
        shards, offset = [], 0
        for p in group["params"]:
            n = p.numel()
            shard = -(-n // size)
            shards.append(ParamShard(index, names[p], g, p.shape, n, shard, offset, size))
            offset += shard
            index += 1
        plan.append(shards)
    return plan
