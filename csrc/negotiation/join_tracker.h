// Who has called join(), as every rank reads it from the negotiation headers.
//
// [Note: join]
// A rank that runs out of data calls hvd.join(). From then on its header carries a
// "joined" flag in every cycle until every rank has joined. Headers are allgathered,
// so every rank knows, cycle by cycle, the same set of joined ranks, and no message
// of its own is needed:
// - A tensor is ready once every rank that has not joined has submitted it: a cached
//   one when those ranks all set its bit, an uncached one when the coordinator has
//   their requests (Coordinator::Sweep finds those that waited only on a rank that
//   has just joined). It must have been submitted by at least one rank.
// - A joined rank that lacks a ready allreduce takes part with zeros of its shape
//   (the runtime makes them), so Sum adds nothing and Average divides by the whole
//   world size, as Horovod does; Min, Max and Product see the zeros too, as in
//   Horovod. Any other op that a joined rank lacks fails with an error response
//   naming it, on every rank that submitted it.
// - In the cycle in which every rank's flag is set, join() returns on every rank
//   with the rank that joined last: the highest rank among those whose flag
//   appeared in the latest cycle that had new flags.
#pragma once

#include <vector>

namespace hvdz {

class JoinTracker {
 public:
  struct Update {
    bool grew = false;  // some rank joined in this cycle
    bool all = false;   // every rank has joined: join() completes now
    int last = -1;      // with `all`: the rank that joined last
  };
  explicit JoinTracker(int size) : prev_(size, false) {}
  // `joined`: this cycle's flags, one per rank.
  Update Observe(const std::vector<bool>& joined);

 private:
  std::vector<bool> prev_;
  int last_ = -1;
};

}  // namespace hvdz
