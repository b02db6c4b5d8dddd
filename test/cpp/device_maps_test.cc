#include <gtest/gtest.h>

#include "runtime/device_maps.h"

namespace hvdz {
namespace {

using Maps = std::vector<DeviceMap>;

// Maps with these device lists (no communicators: only the lists are looked at).
Maps M(std::initializer_list<std::vector<int32_t>> lists) {
  Maps out;
  for (const auto& d : lists) out.push_back({d, -1, nullptr});
  return out;
}

TEST(DeviceMaps, EachListOfDevicesHasACommunicatorOfItsOwn) {
  // Two ranks with two GPUs each: rank 0 on cuda:0 and 1, rank 1 on cuda:2 and 3.
  Maps maps = M({{0, 2}, {1, 3}});
  EXPECT_EQ(FindDeviceMap(maps, {0, 2}), 0);
  EXPECT_EQ(FindDeviceMap(maps, {1, 3}), 1);
  // Pairing rank 0's cuda:0 with rank 1's cuda:3 is a third communicator, as in Horovod.
  EXPECT_EQ(FindDeviceMap(maps, {0, 3}), -1);
  EXPECT_EQ(FindDeviceMap(Maps(), {0, 2}), -1);
}

TEST(DeviceMaps, AJoinedRankStandsInOnAMapTheOthersUse) {
  Maps maps = M({{0, 2}, {1, 3}});
  EXPECT_EQ(FindDeviceMap(maps, {1, -1}), 1);
  EXPECT_EQ(FindDeviceMap(maps, {-1, 2}), 0);
  // None agrees: a new one, on the joined rank's join device.
  EXPECT_EQ(FindDeviceMap(maps, {4, -1}), -1);
  // A map made while a rank had joined serves that tensor again, and once the rank
  // submits it, the exact devices get their own.
  maps.push_back({{4, -1}, -1, nullptr});
  EXPECT_EQ(FindDeviceMap(maps, {4, -1}), 2);
  EXPECT_EQ(FindDeviceMap(maps, {4, 5}), -1);
}

TEST(DeviceMaps, AJoinedRankStandsInOnAGpuNoOtherRankOfTheMapUses) {
  // One host, 2 GPUs, each rank on both, swapped: rank 1's first choice (its join
  // device, cuda:1) is rank 0's GPU in this map, so it takes the next of its own.
  EXPECT_EQ(StandInDevice({1, -1}, {1, 1, 0}, true, 2), 0);
  // Nothing preferred is free: any GPU of the host that the map does not use.
  EXPECT_EQ(StandInDevice({1, -1}, {1}, true, 2), 0);
  EXPECT_EQ(StandInDevice({0, 1, -1}, {-1, 0}, true, 2), -1);
  // Ranks on other hosts may use the same index: the first preferred one is taken.
  EXPECT_EQ(StandInDevice({1, -1}, {-1, 1, 0}, false, 2), 1);
  // Devices this process cannot see are never taken.
  EXPECT_EQ(StandInDevice({0, -1}, {7, 1}, true, 2), 1);
}

TEST(DeviceMaps, ASubsetSeesItsMembersDevices) {
  EXPECT_EQ(ProjectDevices({0, 2, 4}, {0, 2}), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(ProjectDevices({0, 2}, {1, 5}), (std::vector<int32_t>{2, -1}));
}

}  // namespace
}  // namespace hvdz
