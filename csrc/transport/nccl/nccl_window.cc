// [Note: copy-engine allgather]
// NCCL's allgather kernels take SMs from the compute they overlap, and at 8B on
// 4 GPUs both slow down: each backward block's gathers and reduce-scatters take
// longer than its compute. NCCL 2.28 can run an allgather on the copy engines
// instead, with no kernel at all, when the communicator asks for no CTAs
// (NCCL_CTA_POLICY_ZERO), every rank is on one node, and the send and receive
// buffers lie in a window registered with NCCL_WIN_COLL_SYMMETRIC: each rank then
// writes its part straight into its peers' windows at the same offset.
//
// So a communicator may own one such window, registered once as its device context is
// made (on the gather lane's communicator where there is one): a CUDA
// allgather whose fused buffer fits runs through it (ops/plan_fused.cc), copied in
// and out on the collective stream like any fusion buffer, its rank-major layout
// starting at the window's base on every rank, which is what makes the offsets
// symmetric. The window is memory outside torch's allocator for the communicator's
// lifetime, counted by runtime_info()'s "gather_window_bytes".
//
// Registration is collective, so the ranks agree first, over the control plane,
// that every one of them can take part; otherwise none registers and allgathers
// keep their kernels. On more than one node NCCL would run the kernels anyway.
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/cuda_status.h"
#include "transport/nccl/nccl_communicator.h"

namespace hvdz {
namespace {

uint64_t HostHash() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return std::hash<std::string>()(name);
}

// Every rank's yes or no, host and window size: false (with `why`) unless all say
// yes on one host with the same size. A size that differed would send a group through
// the window on one rank and through per-tensor calls on another.
bool AllAgree(ControlPlane& cp, bool mine, int64_t window_bytes, const char* what, std::string* why) {
  std::vector<uint8_t> msg(1 + 2 * sizeof(uint64_t));
  msg[0] = mine ? 1 : 0;
  const uint64_t host = HostHash();
  std::memcpy(msg.data() + 1, &host, sizeof(host));
  std::memcpy(msg.data() + 1 + sizeof(host), &window_bytes, sizeof(window_bytes));
  std::vector<uint8_t> all;
  Status s = cp.Allgather(msg, &all);
  if (!s.ok()) {
    *why = s.reason();
    return false;
  }
  for (int q = 0; q < cp.size(); ++q) {
    const uint8_t* m = all.data() + q * msg.size();
    uint64_t h;
    int64_t bytes;
    std::memcpy(&h, m + 1, sizeof(h));
    std::memcpy(&bytes, m + 1 + sizeof(h), sizeof(bytes));
    if (bytes != window_bytes) {
      *why = "ranks of the set ask for windows of different sizes (" + std::to_string(window_bytes) + " and " +
             std::to_string(bytes) + " bytes): set HOROVOD_ZERO_CE_ALLGATHER_BYTES alike on every rank";
      return false;
    }
    if (m[0] == 0) {
      *why = std::string("rank ") + std::to_string(q) + " of the set " + what;
      return false;
    }
    if (h != host) {
      *why = "the set spans more than one host, where NCCL's copy-engine allgather does not run";
      return false;
    }
  }
  return true;
}

}  // namespace

// Asked on every rank, even one with no window, so that ranks set differently learn it
// together instead of one waiting alone in the agreement.
bool NcclCommunicator::WindowWanted(ControlPlane& cp, int64_t window_bytes, std::string* note) {
  int version = 0, driver = 0;
  // At least the warm-up gather's 16 bytes a rank (OpenWindow).
  const bool can = window_bytes >= 16 * cp.size() && NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0) &&
                   ncclGetVersion(&version) == ncclSuccess && version >= NCCL_VERSION(2, 28, 0) &&
                   cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12050;
  return AllAgree(cp, can, window_bytes, "has an NCCL older than 2.28 (built or loaded) or a CUDA driver older than "
                  "12.5, or the window is under 16 bytes a rank", note);
}

Status NcclCommunicator::OpenWindow(ControlPlane& cp, int64_t window_bytes) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  void* buf = nullptr;
  const ncclResult_t got = ncclMemAlloc(&buf, static_cast<size_t>(window_bytes));
  if (!AllAgree(cp, got == ncclSuccess, window_bytes, "could not allocate it (ncclMemAlloc)", &window_note_)) {
    if (buf != nullptr) ncclMemFree(buf);
    return Status::OK();
  }
  ncclWindow_t win = nullptr;
  Status s = NcclStatus(ncclCommWindowRegister(comm_, buf, static_cast<size_t>(window_bytes), &win,
                                               NCCL_WIN_COLL_SYMMETRIC),
                        "ncclCommWindowRegister");
  if (s.ok() && win == nullptr) s = Status::Error("ncclCommWindowRegister returned no window");
  if (s.ok()) {
    window_buf_ = buf;
    window_handle_ = win;
    window_bytes_ = window_bytes;
    // NCCL sets up its copy-engine state (more registered memory, collectively) at the
    // first such allgather: one of 16 bytes a rank now, so that no training step pays it.
    s = Allgather(static_cast<char*>(buf) + cp.rank() * 16, buf, 16, DataType::kUInt8);
  } else {
    ncclMemFree(buf);
  }
  std::string why;
  if (AllAgree(cp, s.ok(), window_bytes, "could not register the window or queue its first gather", &why))
    return Status::OK();
  // A peer's first gather may wait forever for this rank's: abort, so that nothing waits for it.
  Abort();
  return Status::Error("The copy-engine allgather window (HOROVOD_ZERO_CE_ALLGATHER_BYTES) could not be set up: " +
                       why + (s.ok() ? "" : " (here: " + s.reason() + ")") + ". Unset the variable.");
#else
  (void)cp;
  (void)window_bytes;
  return Status::OK();
#endif
}

// After the stream has drained; never after an abort (see the destructor).
void NcclCommunicator::CloseWindow() {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  if (window_buf_ == nullptr) return;
  ncclCommWindowDeregister(comm_, static_cast<ncclWindow_t>(window_handle_));
  ncclMemFree(window_buf_);
  window_buf_ = nullptr;
  window_handle_ = nullptr;
#endif
}

}  // namespace hvdz
