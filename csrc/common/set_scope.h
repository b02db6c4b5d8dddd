// Which ranks one negotiation covers, so that its messages name world ranks: the
// whole job (the global process set), or a process set, whose rank i is world rank
// world_ranks[i]. See [Note: process sets] in runtime/process_set.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hvdz {

struct SetScope {
  int32_t id = 0;
  std::vector<int> world_ranks;  // empty: the global set, where a set rank is the world rank

  int World(int set_rank) const {
    if (world_ranks.empty()) return set_rank;
    return set_rank >= 0 && set_rank < static_cast<int>(world_ranks.size()) ? world_ranks[set_rank] : -1;
  }
  std::vector<int> World(const std::vector<int>& set_ranks) const;
  // "process set 1 (ranks [0, 2])"; "the global process set" for id 0.
  std::string Name() const;
  // What messages append after a tensor's name: "" for the global set, else " in " + Name().
  std::string Where() const { return world_ranks.empty() ? std::string() : " in " + Name(); }
};

}  // namespace hvdz
