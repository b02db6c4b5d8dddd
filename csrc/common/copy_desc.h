// One element-range copy of a batched copy-in or copy-out. All descriptors of a
// batch share source dtype, destination dtype and scale, so one kernel launch
// (or one CPU loop) serves the whole batch, casting and scaling on the way.
#pragma once

#include <cstdint>

namespace hvdz {

struct CopyDesc {
  const void* src;
  void* dst;
  int64_t count;  // elements
};

}  // namespace hvdz
