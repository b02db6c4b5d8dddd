// Finds tensors that some ranks submitted and others did not: warns after
// HOROVOD_STALL_CHECK_TIME_SECONDS naming the missing ranks (world ranks) and the
// process set, and past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (> 0) turns them into
// error responses.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "common/logging.h"
#include "common/message.h"
#include "common/timeline.h"
#include "negotiation/coordinator.h"

namespace hvdz {

class StallInspector {
 public:
  // `size` ranks of process set `scope`; WaitingTensor::present_ranks are its ranks.
  StallInspector(double check_seconds, double shutdown_seconds, int size, const SetScope& scope, const Logger& log)
      : check_s_(check_seconds), shutdown_s_(shutdown_seconds), size_(size), scope_(scope), log_(log) {}

  void Inspect(const std::vector<WaitingTensor>& waiting, Clock::time_point now,
               std::vector<Response>* errors);

 private:
  struct Seen {
    Clock::time_point first;
    Clock::time_point last_warn;
    bool warned = false;
  };
  std::string Describe(const WaitingTensor& w, double seconds) const;

  double check_s_;
  double shutdown_s_;
  int size_;
  SetScope scope_;
  const Logger& log_;
  std::unordered_map<std::string, Seen> seen_;
};

}  // namespace hvdz
