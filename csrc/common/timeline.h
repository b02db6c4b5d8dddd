// Chrome-trace JSON timeline (HOROVOD_TIMELINE, hvd.start_timeline): one "complete"
// event per phase of each tensor (NEGOTIATE, COPY_IN, COLLECTIVE, COPY_OUT), one
// track per tensor, and with mark_cycles an instant CYCLE_START event per cycle.
// Written only by the background thread, so spans take no lock.
//
// [Note: timeline at run time]
// hvd.start_timeline / stop_timeline come from a framework thread while the
// background thread writes spans. The caller opens the new file itself (a bad path
// fails at the call) and hands it over with Switch(); the background thread swaps
// it in between cycles (Apply(), one atomic load when nothing is pending), closing
// the old file complete, so a span never lands in a file being closed. Switch()
// returns once the swap is done, as Horovod's start_timeline does. After the
// background thread has stopped (Orphan()), a Switch applies itself.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/status.h"

namespace hvdz {

using Clock = std::chrono::steady_clock;

class Timeline {
 public:
  Timeline() = default;
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Before the background thread starts: opens `path` (nothing happens when it is
  // empty). Returns false if it can't.
  bool Open(const std::string& path, int rank, bool mark_cycles = false);
  bool enabled() const { return file_ != nullptr; }
  void Span(const std::string& tensor, const char* phase, Clock::time_point start,
            Clock::time_point end, const std::string& args = "");
  // An instant event named by the rank, on the tensor's track: the coordinator saw that
  // rank's submission of it now (Horovod's NEGOTIATE marks; [Note: arrivals]).
  void RankReady(const std::string& tensor, int rank);
  // Background thread, at the start of each cycle: a pending switch, then the
  // cycle's marker if asked for.
  void StartCycle() {
    if (pending_.load(std::memory_order_acquire)) Apply();
    if (mark_cycles_ && file_ != nullptr) Marker("CYCLE_START");
  }
  // Any thread but the background one: write to `path` from the next cycle on
  // (empty: stop writing). The same path as now only changes `mark_cycles`.
  // `wake` makes the background thread cycle; waits at most `timeout`.
  Status Switch(const std::string& path, bool mark_cycles, const std::function<void()>& wake,
                Clock::duration timeout);
  // The background thread has stopped: applies what is pending; later switches apply at once.
  void Orphan();
  void Close();

 private:
  void Apply();
  void ApplyLocked();
  void Begin(std::FILE* f, const std::string& path);
  void End();
  void Marker(const char* name);
  const char* Separator();  // between two events of a file
  int TrackOf(const std::string& tensor);
  double Micros(Clock::time_point t) const;

  // The background thread's, changed under mu_ (path_ also read under it).
  std::FILE* file_ = nullptr;
  std::string path_;
  bool mark_cycles_ = false;
  bool first_ = true;
  std::unordered_map<std::string, int> tracks_;
  int rank_ = 0;
  const Clock::time_point origin_ = Clock::now();  // every file of a job counts from here

  // A switch handed over, under mu_.
  std::mutex switch_mu_;  // one Switch at a time
  std::mutex mu_;
  std::condition_variable applied_;
  std::atomic<bool> pending_{false};
  std::FILE* next_file_ = nullptr;
  std::string next_path_;
  bool next_mark_cycles_ = false;
  bool orphaned_ = false;
};

}  // namespace hvdz
