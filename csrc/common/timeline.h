// Chrome-trace JSON timeline (HOROVOD_TIMELINE): one "complete" event per phase of
// each tensor (NEGOTIATE, COPY_IN, COLLECTIVE, COPY_OUT), one track per tensor.
// Written only by the background thread, so it takes no lock.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <unordered_map>

namespace hvdz {

using Clock = std::chrono::steady_clock;

class Timeline {
 public:
  Timeline() = default;
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Opens `path` (nothing happens when it is empty). Returns false if it can't.
  bool Open(const std::string& path, int rank);
  bool enabled() const { return file_ != nullptr; }
  void Span(const std::string& tensor, const char* phase, Clock::time_point start,
            Clock::time_point end, const std::string& args = "");
  void Close();

 private:
  int TrackOf(const std::string& tensor);
  std::FILE* file_ = nullptr;
  int rank_ = 0;
  bool first_ = true;
  Clock::time_point origin_;
  std::unordered_map<std::string, int> tracks_;
};

}  // namespace hvdz
