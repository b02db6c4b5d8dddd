#include "common/thread_affinity.h"

#include <string>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

namespace hvdz {

bool PinThisThread(const std::vector<int>& cpus) {
  if (cpus.empty()) return true;
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) return false;
    CPU_SET(c, &set);
  }
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
#else
  return false;
#endif
}

void WarnIfUnpinned(bool pinned, const char* thread, const std::vector<int>& cpus, const Logger& log) {
  if (pinned) return;
  std::string list;
  for (int c : cpus) list += (list.empty() ? "" : ",") + std::to_string(c);
  HVDZ_LOG(log, kWarning) << "HOROVOD_THREAD_AFFINITY: could not pin " << thread << " to CPUs " << list
                          << " (outside this process's CPU set?); it runs unpinned.";
}

}  // namespace hvdz
