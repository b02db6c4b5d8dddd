#include "common/thread_timing.h"

#ifdef __linux__
#include <sys/prctl.h>
#endif

namespace hvdz {

void UseFineTimerSlack() {
#ifdef __linux__
  prctl(PR_SET_TIMERSLACK, 1000UL);  // 1 us, in ns; best effort
#endif
}

}  // namespace hvdz
