// Control plane and CPU data plane over torch.distributed's Gloo backend (the Gloo
// inside the torch wheel, built once by the Python layer on the job's store).
// Included only by torch translation units: this file and the binding adapter.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <memory>

#include "transport/communicator.h"
#include "transport/control_plane.h"

namespace hvdz {

using GlooBackend = c10::intrusive_ptr<c10d::Backend>;

std::unique_ptr<ControlPlane> MakeGlooControlPlane(GlooBackend backend, double timeout_s);
std::unique_ptr<Communicator> MakeGlooCommunicator(GlooBackend backend, double timeout_s);

}  // namespace hvdz
