// One negotiation cycle: turns the requests this rank has submitted into the list
// of responses that every rank executes, identical and in the same order.
//
// [Note: the two paths]
// Fast path: each rank sets one bit per cached response it has a request for; the
// bit vectors are allgathered, and the positions set on every rank are ready.
// Slow path (taken only in a cycle where some rank has an uncached request, or
// rank 0 has stall errors to announce): request lists are gathered to rank 0, whose
// Coordinator checks that ranks agree and broadcasts the responses. New responses
// enter every rank's cache in that broadcast order, which keeps caches identical.
// A rank whose request does not match the cached response of the same name sets an
// "invalid" bit instead; every rank then evicts that entry and re-sends any request
// it had waiting on it through the slow path.
//
// Each header also says whether its rank asks to shut down, whether it has
// joined (see [Note: join] in join_tracker.h), whether it waits on work in
// another process set (see [Note: process sets] in runtime/process_set.h), and on
// rank 0 whether an announcement follows: bytes every rank receives in the same
// cycle (the autotuner's new settings: [Note: autotuning] in autotune/autotuner.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/logging.h"
#include "common/message.h"
#include "common/params.h"
#include "common/set_scope.h"
#include "negotiation/coordinator.h"
#include "negotiation/join_tracker.h"
#include "negotiation/response_cache.h"
#include "negotiation/stall_inspector.h"
#include "transport/control_plane.h"

namespace hvdz {

// Rank `rank` (a world rank) submitted tensor `name`: the coordinator first saw it in this cycle.
struct Arrival {
  std::string name;
  int rank = -1;
};

struct CycleResult {
  std::vector<Response> responses;
  // The coordinator's (rank 0's) only, while TrackArrivals is on: see [Note: arrivals].
  std::vector<Arrival> arrivals;
  bool shutdown = false;
  std::vector<int> shutdown_ranks;  // the ranks that asked to stop in this cycle
  bool slow_path = false;
  // This rank had joined in this cycle: it stands in with zeros for the allreduces
  // it lacks. `join_done`: every rank has joined; join() returns `last_joined`.
  bool self_joined = false;
  bool join_done = false;
  int last_joined = -1;
  // Rank 0's announcement (Controller::Announce), on every rank; empty: none this cycle.
  std::vector<uint8_t> announcement;
  // Some rank has work in another process set, which waits for this rank's next
  // exchange in this set: see [Note: process sets] in runtime/process_set.h.
  bool peers_pending = false;
};

class Controller {
 public:
  // `scope`: the process set `cp` connects, for the ranks messages name.
  Controller(ControlPlane& cp, const Params& params, const Logger& log, const SetScope& scope = SetScope());
  // `pending_elsewhere`: this rank has work in another process set (new, or
  // waiting on other ranks), which other ranks meet in this set's exchanges.
  Status RunCycle(const std::vector<Request>& new_requests, bool want_shutdown, CycleResult* out,
                  bool pending_elsewhere = false);

  // Whether this rank has submitted tensors that are not ready yet, or has joined
  // (the others' allreduces need it in every exchange), i.e. it is waiting on other
  // ranks and should cycle again soon.
  bool HasPending() const { return !pending_hits_.empty() || !unsent_.empty() || !awaiting_.empty() || joined_; }
  // Rank 0: every rank receives `bytes` (non-empty) in the next cycle's
  // CycleResult::announcement. A later call before then replaces it.
  void Announce(std::vector<uint8_t> bytes) { announcement_ = std::move(bytes); }
  // [Note: arrivals]
  // Rank 0 can say when each rank submitted each tensor, as Horovod's timeline marks
  // every rank's readiness in NEGOTIATE: a tensor negotiated late waits for the last
  // rank to submit it, and the timeline then names that rank. A rank's submission is
  // seen in the first cycle whose header carries its bit (or whose request list, on
  // the slow path, carries its request), so the time is the cycle's. Each (rank, tensor)
  // is reported once until the tensor is answered, however its request travels meanwhile
  // (a cache entry evicted or invalidated sends it again on the slow path). Tracking
  // starts by learning the cache bits pending, which may have arrived before it: those
  // rounds lack those ranks' marks (examples/timeline_late.py leaves them out). Off by
  // default: it costs a pass over every rank's bits in each cycle.
  void TrackArrivals(bool on);
  const ResponseCache& cache() const { return cache_; }
  uint64_t slow_path_cycles() const { return slow_path_cycles_; }

 private:
  enum Flag : uint32_t {
    kShutdown = 1,
    kHasUncached = 2,
    kCoordinatorNews = 4,
    kJoined = 8,
    kPendingElsewhere = 16,
    kAnnouncement = 32,
  };
  struct Header {
    uint32_t flags = 0;
    std::vector<uint64_t> hits;
    std::vector<uint64_t> invalid;
  };

  void Classify(const Request& r);
  std::vector<uint8_t> EncodeHeader(uint32_t flags) const;
  Header DecodeHeader(const uint8_t* p) const;
  size_t HeaderBytes() const { return 8 + 16 * words_; }
  void Invalidate(const std::vector<uint64_t>& invalid_any);
  // Bits set by some rank, and by every rank that has not joined.
  void Coverage(const std::vector<Header>& all, const std::vector<bool>& joined, std::vector<uint64_t>* some,
                std::vector<uint64_t>* every) const;
  void CollectReady(const std::vector<Header>& all, const std::vector<uint64_t>& invalid_any,
                    const std::vector<bool>& joined, CycleResult* out);
  // Rank 0, tracking arrivals: see [Note: arrivals].
  void NoteArrival(const std::string& name, int rank, bool report, CycleResult* out);
  void NoteHits(const std::vector<Header>& all, CycleResult* out);
  void ForgetAnswered(const std::vector<Response>& responses);
  void InspectStalls(const std::vector<Header>& all, const std::vector<uint64_t>& invalid_any,
                     const std::vector<bool>& joined);
  // `out_cycle`: where the requests' arrivals go.
  Status SlowPath(const std::vector<bool>& joined, std::vector<Response>* out, CycleResult* out_cycle);
  void LogDecisions(const std::vector<Response>& resps) const;  // rank 0, debug level
  void Admit(const std::vector<Response>& fresh);
  void Requeue(uint32_t pos);

  ControlPlane& cp_;
  const Logger& log_;
  ResponseCache cache_;
  Coordinator coordinator_;
  StallInspector stalls_;
  JoinTracker join_;
  size_t words_;
  std::vector<Request> unsent_;
  std::map<uint32_t, Request> pending_hits_;  // position -> request waiting on other ranks
  std::unordered_set<std::string> awaiting_;  // sent to the coordinator, not answered yet
  std::vector<uint64_t> my_invalid_;
  std::vector<Response> stall_errors_;  // rank 0: announced in the next slow path
  uint64_t slow_path_cycles_ = 0;
  bool joined_ = false;  // this rank has called join() and it has not returned yet
  std::vector<uint8_t> announcement_;  // rank 0: to broadcast in the next cycle
  const SetScope scope_;
  // Rank 0, while tracking arrivals: per rank, the tensors reported and not answered yet.
  bool tracking_ = false;
  bool priming_ = false;  // the first cycle tracked: learns the cache bits, reports none
  std::vector<std::unordered_set<std::string>> reported_;
};

}  // namespace hvdz
