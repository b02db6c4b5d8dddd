// HOROVOD_THREAD_AFFINITY: the runtime's own threads (negotiation cycle, CUDA
// finalizers) kept on CPUs of their own, away from the threads that launch the
// model's work; see [Note: the runtime's threads off the training threads' CPUs].
#pragma once

#include <vector>

#include "common/logging.h"

namespace hvdz {

// [Note: the runtime's threads off the training threads' CPUs]
// At small micro-batches the host sets the pace: autograd's thread is on a CPU for all of
// backward. Left to the scheduler, the runtime's threads (several ms of CPU a step, in
// short bursts) share and migrate across the CPUs that thread uses. On 2 x H200 at
// micro-batch 1, pinning them to CPUs of their own did not change the step, alternated
// with unpinned runs in one process (docs/benchmarks.md, "The runtime's threads on CPUs
// of their own"); a busier host may differ. Pinned only when asked, as Horovod pins its
// background thread: which CPUs are free is the launcher's and the user's knowledge.

// Pins the calling thread to `cpus`; empty: leaves it as it is. False when the kernel
// refuses (a CPU outside the process's set); the thread then stays unpinned.
bool PinThisThread(const std::vector<int>& cpus);

// A warning naming the thread and its CPUs when PinThisThread() returned false: the job
// runs on, unpinned.
void WarnIfUnpinned(bool pinned, const char* thread, const std::vector<int>& cpus, const Logger& log);

}  // namespace hvdz
