#include "common/set_scope.h"

#include "common/types.h"

namespace hvdz {

std::vector<int> SetScope::World(const std::vector<int>& set_ranks) const {
  std::vector<int> out;
  out.reserve(set_ranks.size());
  for (int r : set_ranks) out.push_back(World(r));
  return out;
}

std::string SetScope::Name() const {
  if (id == 0) return "the global process set";
  return "process set " + std::to_string(id) + " (ranks " +
         ShapeString(std::vector<int64_t>(world_ranks.begin(), world_ranks.end())) + ")";
}

}  // namespace hvdz
