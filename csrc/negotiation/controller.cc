#include "negotiation/controller.h"

#include <algorithm>
#include <cstring>

namespace hvdz {
namespace {

bool TestBit(const std::vector<uint64_t>& v, uint32_t pos) { return (v[pos / 64] >> (pos % 64)) & 1; }
void SetBit(std::vector<uint64_t>* v, uint32_t pos) { (*v)[pos / 64] |= uint64_t{1} << (pos % 64); }

const std::string& NameOf(const Response& r) { return r.name; }
const std::string& NameOfRequest(const Request& r) { return r.name; }

template <typename F>
void ForEachBit(const std::vector<uint64_t>& v, F f) {
  for (size_t w = 0; w < v.size(); ++w) {
    for (uint64_t bits = v[w]; bits; bits &= bits - 1) {
      f(static_cast<uint32_t>(w * 64 + __builtin_ctzll(bits)));
    }
  }
}

}  // namespace

Controller::Controller(ControlPlane& cp, const Params& params, const Logger& log, const SetScope& scope)
    : cp_(cp),
      log_(log),
      cache_(static_cast<uint32_t>(params.cache_capacity)),
      coordinator_(cp.size(), scope),
      stalls_(params.stall_check_seconds, params.stall_shutdown_seconds, cp.size(), scope, log),
      join_(cp.size()),
      words_((static_cast<size_t>(params.cache_capacity) + 63) / 64),
      scope_(scope) {}

void Controller::TrackArrivals(bool on) {
  on = on && cp_.rank() == 0;
  if (on == tracking_) return;
  tracking_ = priming_ = on;
  reported_.assign(on ? cp_.size() : 0, {});
}

// Keyed by name, not cache position: a position evicted, invalidated or failed may come
// back through the slow path, or hold another tensor, and neither is a new arrival.
void Controller::NoteArrival(const std::string& name, int rank, bool report, CycleResult* out) {
  if (reported_[rank].insert(name).second && report) out->arrivals.push_back({name, scope_.World(rank)});
}

void Controller::NoteHits(const std::vector<Header>& all, CycleResult* out) {
  if (!tracking_) return;
  for (size_t r = 0; r < all.size(); ++r)
    ForEachBit(all[r].hits, [&](uint32_t pos) {
      if (cache_.Holds(pos)) NoteArrival(cache_.Get(pos).name, static_cast<int>(r), !priming_, out);
    });
}

// A tensor answered (ready, or failed) arrives anew when it is submitted again. The first
// cycle tracked only learns the cache bits pending, which may predate the timeline.
void Controller::ForgetAnswered(const std::vector<Response>& responses) {
  if (!tracking_) return;
  for (const auto& resp : responses)
    for (auto& names : reported_) names.erase(resp.name);
  priming_ = false;
}

void Controller::Classify(const Request& r) {
  if (r.op == OpType::kJoin) {
    joined_ = true;  // announced in every header until every rank has joined
    return;
  }
  uint32_t pos = 0;
  switch (cache_.Find(r, &pos)) {
    case ResponseCache::Lookup::kHit:
      HVDZ_LOG(log_, kDebug) << "Cache hit: " << OpTypeName(r.op) << " '" << r.name << "' (position " << pos
                             << "), ready once every rank has it";
      pending_hits_[pos] = r;
      return;
    case ResponseCache::Lookup::kInvalid:
      HVDZ_LOG(log_, kDebug) << "Cache entry of '" << r.name << "' no longer matches its " << OpTypeName(r.op)
                             << " request: evicting it on every rank and negotiating again";
      SetBit(&my_invalid_, pos);
      unsent_.push_back(r);
      return;
    case ResponseCache::Lookup::kMiss:
      HVDZ_LOG(log_, kDebug) << "Cache miss: " << OpTypeName(r.op) << " '" << r.name
                             << "' goes to the coordinator";
      unsent_.push_back(r);
      return;
  }
}

std::vector<uint8_t> Controller::EncodeHeader(uint32_t flags) const {
  std::vector<uint8_t> buf(HeaderBytes(), 0);
  std::memcpy(buf.data(), &flags, sizeof(flags));
  std::vector<uint64_t> hits(words_, 0);
  for (const auto& kv : pending_hits_) SetBit(&hits, kv.first);
  std::memcpy(buf.data() + 8, hits.data(), 8 * words_);
  std::memcpy(buf.data() + 8 + 8 * words_, my_invalid_.data(), 8 * words_);
  return buf;
}

Controller::Header Controller::DecodeHeader(const uint8_t* p) const {
  Header h;
  std::memcpy(&h.flags, p, sizeof(h.flags));
  h.hits.resize(words_);
  h.invalid.resize(words_);
  std::memcpy(h.hits.data(), p + 8, 8 * words_);
  std::memcpy(h.invalid.data(), p + 8 + 8 * words_, 8 * words_);
  return h;
}

void Controller::Requeue(uint32_t pos) {
  auto it = pending_hits_.find(pos);
  if (it == pending_hits_.end()) return;
  unsent_.push_back(it->second);
  pending_hits_.erase(it);
}

void Controller::Invalidate(const std::vector<uint64_t>& invalid_any) {
  ForEachBit(invalid_any, [&](uint32_t pos) {
    cache_.Erase(pos);
    Requeue(pos);
  });
}

void Controller::Coverage(const std::vector<Header>& all, const std::vector<bool>& joined,
                          std::vector<uint64_t>* some, std::vector<uint64_t>* every) const {
  some->assign(words_, 0);
  every->assign(words_, ~uint64_t{0});
  for (size_t r = 0; r < all.size(); ++r) {
    for (size_t w = 0; w < words_; ++w) {
      (*some)[w] |= all[r].hits[w];
      if (!joined[r]) (*every)[w] &= all[r].hits[w];
    }
  }
}

// Ready: set by every rank that has not joined, and by at least one rank.
void Controller::CollectReady(const std::vector<Header>& all, const std::vector<uint64_t>& invalid_any,
                              const std::vector<bool>& joined, CycleResult* out) {
  std::vector<uint64_t> some, ready;
  Coverage(all, joined, &some, &ready);
  for (size_t w = 0; w < words_; ++w) ready[w] &= some[w] & ~invalid_any[w];
  // Only while some rank has joined can a ready tensor lack a rank's submission.
  const bool any_joined = std::find(joined.begin(), joined.end(), true) != joined.end();
  ForEachBit(ready, [&](uint32_t pos) {
    out->responses.push_back(cache_.Get(pos));
    Response& resp = out->responses.back();
    if (any_joined && resp.op != OpType::kAllreduce) {
      std::vector<int> missing;
      for (size_t r = 0; r < all.size(); ++r)
        if (joined[r] && !TestBit(all[r].hits, pos)) missing.push_back(static_cast<int>(r));
      if (!missing.empty()) resp.error = MissingJoinedError(resp.name, resp.op, missing);
    }
    cache_.Touch(pos);
    pending_hits_.erase(pos);
  });
  if (!out->responses.empty())
    HVDZ_LOG(log_, kDebug) << "Cached responses ready on every rank: " << NameList(out->responses, NameOf);
}

void Controller::InspectStalls(const std::vector<Header>& all, const std::vector<uint64_t>& invalid_any,
                               const std::vector<bool>& joined) {
  std::vector<WaitingTensor> waiting;
  coordinator_.AppendWaiting(&waiting);
  std::vector<uint64_t> some, every;
  Coverage(all, joined, &some, &every);
  // join() waits on the ranks that have not joined, like a tensor they have not submitted.
  WaitingTensor join{kJoinName, {}};
  for (size_t r = 0; r < joined.size(); ++r)
    if (joined[r]) join.present_ranks.push_back(static_cast<int>(r));
  if (!join.present_ranks.empty() && join.present_ranks.size() < joined.size()) waiting.push_back(join);
  for (size_t w = 0; w < words_; ++w) some[w] &= ~every[w] & ~invalid_any[w];
  ForEachBit(some, [&](uint32_t pos) {
    if (!cache_.Holds(pos)) return;
    WaitingTensor wt{cache_.Get(pos).name, {}};
    for (size_t r = 0; r < all.size(); ++r)
      if (TestBit(all[r].hits, pos)) wt.present_ranks.push_back(static_cast<int>(r));
    waiting.push_back(std::move(wt));
  });
  size_t before = stall_errors_.size();
  stalls_.Inspect(waiting, Clock::now(), &stall_errors_);
  for (size_t i = before; i < stall_errors_.size(); ++i) coordinator_.Drop(stall_errors_[i].name);
}

void Controller::LogDecisions(const std::vector<Response>& resps) const {
  if (!log_.Enabled(LogLevel::kDebug)) return;
  std::vector<const Response*> ok, errors;
  for (const auto& r : resps) {
    if (r.ok()) ok.push_back(&r);
    else errors.push_back(&r);
  }
  std::vector<WaitingTensor> waiting;
  coordinator_.AppendWaiting(&waiting);
  HVDZ_LOG(log_, kDebug) << "Coordinator: " << ok.size() << " tensor(s) ready on every rank"
                         << (ok.empty() ? "" : ": ") << NameList(ok, [](const Response* r) { return r->name; })
                         << "; " << waiting.size() << " still waiting for other ranks"
                         << (waiting.empty() ? "" : ": ")
                         << NameList(waiting, [](const WaitingTensor& w) { return w.name; });
  for (const Response* e : errors) HVDZ_LOG(log_, kDebug) << "Coordinator: error for '" << e->name << "': " << e->error;
}

Status Controller::SlowPath(const std::vector<bool>& joined, std::vector<Response>* out, CycleResult* out_cycle) {
  ++slow_path_cycles_;
  HVDZ_LOG(log_, kDebug) << "Slow path: " << unsent_.size() << " request(s) of this rank to the coordinator"
                         << (unsent_.empty() ? "" : ": ") << NameList(unsent_, NameOfRequest);
  std::vector<uint8_t> payload;
  SerializeRequests(unsent_, &payload);
  for (const auto& r : unsent_) awaiting_.insert(r.name);
  unsent_.clear();
  std::vector<std::vector<uint8_t>> gathered;
  HVDZ_RETURN_IF_ERROR(cp_.Gatherv(payload, &gathered));
  std::vector<uint8_t> reply;
  if (cp_.rank() == 0) {
    std::vector<Response> resps;
    for (size_t r = 0; r < gathered.size(); ++r) {
      std::vector<Request> reqs;
      if (!ParseRequests(gathered[r].data(), gathered[r].size(), &reqs))
        return Status::Error("Corrupt request list received by the coordinator.");
      if (tracking_)
        for (const auto& q : reqs) NoteArrival(q.name, static_cast<int>(r), true, out_cycle);
      coordinator_.Add(reqs, &resps);
    }
    // After every rank's list: a rank that joined in this cycle may have sent the
    // tensor in the same list as its join.
    coordinator_.Sweep(joined, &resps);
    resps.insert(resps.end(), stall_errors_.begin(), stall_errors_.end());
    stall_errors_.clear();
    LogDecisions(resps);
    SerializeResponses(resps, &reply);
  }
  HVDZ_RETURN_IF_ERROR(cp_.Broadcast(&reply));
  if (!ParseResponses(reply.data(), reply.size(), out))
    return Status::Error("Corrupt response list received from the coordinator.");
  return Status::OK();
}

void Controller::Admit(const std::vector<Response>& fresh) {
  for (const auto& resp : fresh) {
    awaiting_.erase(resp.name);
    if (resp.ok()) {
      std::vector<uint32_t> evicted;
      cache_.Put(resp, &evicted);
      for (auto pos : evicted) Requeue(pos);
      continue;
    }
    // An error (mismatch or stall) ends this tensor wherever it waits; a stalled
    // join() fails, and this rank stops standing in for others.
    if (resp.name == kJoinName) joined_ = false;
    for (auto it = pending_hits_.begin(); it != pending_hits_.end();) {
      it = it->second.name == resp.name ? pending_hits_.erase(it) : std::next(it);
    }
  }
}

Status Controller::RunCycle(const std::vector<Request>& new_requests, bool want_shutdown, CycleResult* out,
                            bool pending_elsewhere) {
  my_invalid_.assign(words_, 0);
  for (const auto& r : new_requests) Classify(r);

  uint32_t flags = want_shutdown ? kShutdown : 0;
  if (!unsent_.empty()) flags |= kHasUncached;
  if (cp_.rank() == 0 && !stall_errors_.empty()) flags |= kCoordinatorNews;
  const bool was_joined = joined_;  // what the others read in this cycle's header
  if (was_joined) flags |= kJoined;
  if (pending_elsewhere) flags |= kPendingElsewhere;
  if (cp_.rank() == 0 && !announcement_.empty()) flags |= kAnnouncement;
  std::vector<uint8_t> all_bytes;
  HVDZ_RETURN_IF_ERROR(cp_.Allgather(EncodeHeader(flags), &all_bytes));

  std::vector<Header> all;
  uint32_t any_flags = 0;
  std::vector<uint64_t> invalid_any(words_, 0);
  std::vector<bool> joined(cp_.size(), false);
  for (int r = 0; r < cp_.size(); ++r) {
    all.push_back(DecodeHeader(all_bytes.data() + r * HeaderBytes()));
    any_flags |= all.back().flags;
    joined[r] = (all.back().flags & kJoined) != 0;
    if (all.back().flags & kShutdown) out->shutdown_ranks.push_back(r);
    for (size_t w = 0; w < words_; ++w) invalid_any[w] |= all.back().invalid[w];
  }
  out->shutdown = (any_flags & kShutdown) != 0;
  out->peers_pending = (any_flags & kPendingElsewhere) != 0;
  const JoinTracker::Update join = join_.Observe(joined);
  if (any_flags & kAnnouncement) {
    out->announcement.swap(announcement_);  // rank 0's; the others' is replaced
    HVDZ_RETURN_IF_ERROR(cp_.Broadcast(&out->announcement));
  }

  Invalidate(invalid_any);
  NoteHits(all, out);
  CollectReady(all, invalid_any, joined, out);
  if (cp_.rank() == 0) InspectStalls(all, invalid_any, joined);

  // A new join may complete tensors the coordinator holds: every rank sees it in
  // the headers, so every rank takes the slow path.
  if ((any_flags & (kHasUncached | kCoordinatorNews)) || join.grew) {
    out->slow_path = true;
    std::vector<Response> fresh;
    HVDZ_RETURN_IF_ERROR(SlowPath(joined, &fresh, out));
    Admit(fresh);
    out->responses.insert(out->responses.end(), fresh.begin(), fresh.end());
  }
  ForgetAnswered(out->responses);
  out->self_joined = was_joined;
  if (join.all) {
    out->join_done = true;
    out->last_joined = join.last;
    joined_ = false;
  }
  return Status::OK();
}

}  // namespace hvdz
