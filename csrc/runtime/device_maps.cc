#include "runtime/device_maps.h"

#include <algorithm>
#include <cstddef>

namespace hvdz {

int FindDeviceMap(const std::vector<DeviceMap>& maps, const std::vector<int32_t>& devices) {
  for (size_t i = 0; i < maps.size(); ++i)
    if (maps[i].devices == devices) return static_cast<int>(i);
  if (std::find(devices.begin(), devices.end(), -1) == devices.end()) return -1;
  // A joined rank stands in on a map the others already use rather than a new one.
  for (size_t i = 0; i < maps.size(); ++i) {
    const auto& m = maps[i].devices;
    bool agrees = m.size() == devices.size();
    for (size_t r = 0; agrees && r < devices.size(); ++r) agrees = devices[r] < 0 || devices[r] == m[r];
    if (agrees) return static_cast<int>(i);
  }
  return -1;
}

int StandInDevice(const std::vector<int32_t>& devices, const std::vector<int>& preferred, bool one_host,
                  int device_count) {
  // Two ranks of one NCCL communicator on one GPU is an error (NCCL: duplicate GPU).
  auto free = [&](int d) {
    return d >= 0 && d < device_count && (!one_host || std::find(devices.begin(), devices.end(), d) == devices.end());
  };
  for (int d : preferred)
    if (free(d)) return d;
  if (!one_host) return -1;
  for (int d = 0; d < device_count; ++d)
    if (free(d)) return d;
  return -1;
}

std::vector<int32_t> ProjectDevices(const std::vector<int32_t>& devices, const std::vector<int>& members) {
  std::vector<int32_t> out;
  for (int w : members) out.push_back(w >= 0 && w < static_cast<int>(devices.size()) ? devices[w] : -1);
  return out;
}

}  // namespace hvdz
