#include "common/thread_timing.h"

#ifdef __linux__
#include <pthread.h>
#include <sys/prctl.h>
#endif

namespace hvdz {

void UseFineTimerSlack() {
#ifdef __linux__
  prctl(PR_SET_TIMERSLACK, 1000UL);  // 1 us, in ns; best effort
#endif
}

void NameThisThread(const char* name) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), name);  // best effort: longer names are refused
#else
  (void)name;
#endif
}

}  // namespace hvdz
