// The runtime's own threads poll with short sleeps; these keep the sleeps short.
#pragma once

namespace hvdz {

// Linux lets a sleeping thread oversleep by its timer slack, 50 us by default: the
// finalizer's 20 us poll became ~70 us, added to every small collective. Called at
// the start of each of the runtime's threads (it applies to the calling thread).
void UseFineTimerSlack();

// Names the calling thread (at most 15 characters) so that top -H and
// /proc/<pid>/task/*/comm tell the runtime's threads from torch's and Gloo's.
void NameThisThread(const char* name);

}  // namespace hvdz
