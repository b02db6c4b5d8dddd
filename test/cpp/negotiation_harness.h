// Controllers of `size` ranks as threads over an in-memory control plane, each
// cycle's requests given by a script: what the negotiation tests run and check.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "in_memory_control_plane.h"
#include "negotiation/controller.h"

namespace hvdz {
namespace testing {

inline Request Req(const std::string& name, std::vector<int64_t> shape, OpType op = OpType::kAllreduce,
                   DataType dt = DataType::kFloat32) {
  Request r;
  r.name = name;
  r.shape = std::move(shape);
  r.op = op;
  r.dtype = r.out_dtype = dt;
  return r;
}

// What one rank saw, cycle by cycle.
struct Trace {
  std::vector<std::vector<Response>> cycles;
  std::vector<bool> slow;
  std::vector<CycleResult> results;
  size_t cache_entries = 0;
};

using Script = std::function<std::vector<Request>(int rank, int cycle)>;

// `track_arrivals`: each controller reports arrivals (rank 0 only does).
inline std::vector<Trace> RunRanks(int size, const Params& p, int cycles, const Script& script, int sleep_ms = 0,
                                   bool track_arrivals = false) {
  Hub hub(size);
  std::vector<Trace> out(size);
  Spawn(size, [&](int rank) {
    InMemoryControlPlane cp(hub, rank);
    Logger log(LogLevel::kFatal, rank);
    Controller c(cp, p, log);
    c.TrackArrivals(track_arrivals);
    for (int k = 0; k < cycles; ++k) {
      auto reqs = script(rank, k);
      for (auto& r : reqs) r.rank = rank;
      CycleResult res;
      Status s = c.RunCycle(reqs, false, &res);
      EXPECT_TRUE(s.ok()) << s.reason();
      out[rank].cycles.push_back(res.responses);
      out[rank].slow.push_back(res.slow_path);
      out[rank].results.push_back(res);
      if (sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    }
    out[rank].cache_entries = c.cache().num_entries();
  });
  return out;
}

inline std::vector<std::string> Names(const std::vector<Response>& rs) {
  std::vector<std::string> n;
  for (const auto& r : rs) n.push_back(r.name);
  return n;
}

// Every rank must see the same names, in the same order, in every cycle.
inline void ExpectIdentical(const std::vector<Trace>& t) {
  for (size_t r = 1; r < t.size(); ++r)
    for (size_t k = 0; k < t[0].cycles.size(); ++k)
      EXPECT_EQ(Names(t[r].cycles[k]), Names(t[0].cycles[k])) << "rank " << r << " cycle " << k;
}

// The first response named `name`, and the cycle it came in.
inline const Response* Find(const Trace& t, const std::string& name, int* cycle = nullptr) {
  for (size_t k = 0; k < t.cycles.size(); ++k)
    for (const auto& r : t.cycles[k])
      if (r.name == name) {
        if (cycle) *cycle = static_cast<int>(k);
        return &r;
      }
  return nullptr;
}

}  // namespace testing
}  // namespace hvdz
