// Which NCCL communicator of a process set runs a CUDA collective, when ranks use
// several devices each (model parallelism).
//
// [Note: model parallelism]
// A process may hold tensors on several CUDA devices, as Horovod allows: a model
// split over two GPUs has its gradients allreduced on each. A response carries
// every rank's device (Response::devices), and a set has one NCCL communicator per
// distinct list of devices, its device map, as Horovod keys its communicators: the
// one made for [0, 2] reduces rank 0's cuda:0 with rank 1's cuda:2, and a tensor on
// [1, 3] gets another. The maps are made from responses alone, in response order,
// so every rank holds the same ones and makes a new one (a collective) at the same
// point. A rank that joined and did not submit a tensor has device -1 in the
// response: the tensor runs on the first map that agrees with every known device,
// or, with none, on a new map where the joined rank stands in on a device of its own
// (StandInDevice). Before a new map's communicator is made, the ranks agree that each
// can make it, so that a rank that cannot fails with the others rather than leaving
// them in the NCCL id's broadcast.
// Fusion groups only responses with equal devices (fusion/fusion_plan.cc). Maps
// share a device's collective stream, as process sets do (runtime/process_set.h),
// so their kernels run in response order on every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ops/device_context.h"

namespace hvdz {

// One CUDA communicator of a set: every rank's device (the devices of the response
// that made it), this rank's, and its context.
struct DeviceMap {
  std::vector<int32_t> devices;
  int device;
  std::unique_ptr<DeviceContext> ctx;
};

// The index in `maps` (in the order they were made) of the map that `devices` runs
// on, or -1 when it needs a new one.
int FindDeviceMap(const std::vector<DeviceMap>& maps, const std::vector<int32_t>& devices);

// The device a joined rank stands in on for a new map: the first of `preferred` (its
// own devices, the likeliest first), else of the host's `device_count`, that no rank of
// `devices` uses. Only when every rank is on this host (`one_host`): elsewhere a rank's
// index names another machine's GPU, and the first of `preferred` is taken, as Horovod
// takes the join device. -1 when there is none.
int StandInDevice(const std::vector<int32_t>& devices, const std::vector<int>& preferred, bool one_host,
                  int device_count);

// `devices` as the ranks `members` (indices into it) see it.
std::vector<int32_t> ProjectDevices(const std::vector<int32_t>& devices, const std::vector<int>& members);

}  // namespace hvdz
