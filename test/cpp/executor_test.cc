// The executor on host memory, ranks as threads over ThreadCommunicator: lone,
// fused and direct programs of every op in several dtypes, checked against values
// computed here from the inputs, with the calls, copies, fusion buffers and
// counters each program should cost; and failures that fail their own group only.
#include <gtest/gtest.h>

#include <cmath>
#include <deque>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "host_memory.h"
#include "in_memory_control_plane.h"
#include "ops/executor.h"
#include "thread_communicator.h"

namespace hvdz {
namespace {

using testing::LoadElement;
using testing::StoreElement;

// kSlot (allgather): the input is this rank's slot of the given output, as ZeRO's
// step writes it ([Note: the step writes the gather's input]).
enum class Out { kInPlace, kGiven, kAllocated, kAllocationFails, kSlot };

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // rank 0's input
  Out output = Out::kGiven;
  bool grow_rows = false;  // allgather: rank r has r more rows than rank 0
};

// What one rank should see for a group; -1: not checked.
struct Cost {
  int in_descs = -1;        // descriptors copied in (on the root, for broadcast)
  int in_descs_others = -1;  // broadcast: on the other ranks
  int out_descs = -1;
  int buffers = -1;
  int calls = 1;
  bool grouped = false;
  int64_t bytes = -1;  // counted on the wire
};

struct GroupSpec {
  OpType op = OpType::kAllreduce;
  DataType dtype = DataType::kFloat32, out_dtype = DataType::kFloat32;
  std::vector<TensorSpec> tensors;
  ReduceOp reduce_op = ReduceOp::kSum;
  double prescale = 1.0, postscale = 1.0;
  int root = 0;
  Cost cost;
};

GroupSpec Group(OpType op, DataType dt, DataType out, std::vector<TensorSpec> ts) {
  GroupSpec g;
  g.op = op;
  g.dtype = dt;
  g.out_dtype = out;
  g.tensors = std::move(ts);
  return g;
}

bool Reduces(const GroupSpec& g) { return g.op == OpType::kAllreduce || g.op == OpType::kReducescatter; }

// Small multiples of 1/4 (integers for integer dtypes) with signs that differ
// between ranks, so that Min and Max pick different ranks: exact in every dtype
// used here, and so are their sums and the scales below.
double Input(const GroupSpec& g, int rank, size_t t, int64_t i) {
  double v = (rank + 1) * 3 + static_cast<double>(t) * 7 + static_cast<double>(i % 11);
  if ((i + rank) % 2 == 1) v = -v;
  return IsFloatingPoint(g.dtype) ? v * 0.25 : v;
}

std::vector<int64_t> InputShape(const TensorSpec& t, int rank) {
  auto s = t.shape;
  if (t.grow_rows) s[0] += rank;
  return s;
}

int64_t Rows(const std::vector<int64_t>& shape) { return shape[0]; }
int64_t Row(const std::vector<int64_t>& shape) { return NumElements(shape) / shape[0]; }

// Reducescatter: rank q gets dim0 / size rows, one more for the first dim0 % size.
int64_t RowsOf(int64_t dim0, int size, int q) { return dim0 / size + (q < dim0 % size ? 1 : 0); }
int64_t FirstRowOf(int64_t dim0, int size, int q) {
  int64_t first = 0;
  for (int p = 0; p < q; ++p) first += RowsOf(dim0, size, p);
  return first;
}

std::vector<int64_t> OutputShape(const GroupSpec& g, const TensorSpec& t, int rank, int size) {
  auto s = InputShape(t, rank);
  if (g.op == OpType::kAllgather) {
    s[0] = 0;
    for (int q = 0; q < size; ++q) s[0] += Rows(InputShape(t, q));
  } else if (g.op == OpType::kReducescatter) {
    s[0] = RowsOf(Rows(t.shape), size, rank);
  }
  return s;
}

double Expected(const GroupSpec& g, size_t ti, int rank, int size, int64_t j) {
  const TensorSpec& t = g.tensors[ti];
  auto reduce = [&](auto value) {
    double acc = 0;
    for (int r = 0; r < size; ++r) {
      const double v = value(r) * g.prescale;
      if (r == 0) acc = v;
      else if (g.reduce_op == ReduceOp::kMin) acc = std::min(acc, v);
      else if (g.reduce_op == ReduceOp::kMax) acc = std::max(acc, v);
      else acc += v;
    }
    if (g.reduce_op == ReduceOp::kAverage) acc /= size;
    return acc * g.postscale;
  };
  switch (g.op) {
    case OpType::kAllreduce: return reduce([&](int r) { return Input(g, r, ti, j); });
    case OpType::kReducescatter: {
      const int64_t first = FirstRowOf(Rows(t.shape), size, rank) * Row(t.shape);
      return reduce([&](int r) { return Input(g, r, ti, first + j); });
    }
    case OpType::kAllgather: {
      int64_t start = 0;
      for (int q = 0; q < size; ++q) {
        const int64_t n = NumElements(InputShape(t, q));
        if (j < start + n) return Input(g, q, ti, j - start);
        start += n;
      }
      return NAN;
    }
    case OpType::kBroadcast: return Input(g, g.root, ti, j);
  }
  return NAN;
}

double Tolerance(DataType t, double expected) {
  const double mag = std::max(1.0, std::fabs(expected));
  switch (t) {
    case DataType::kFloat16:
    case DataType::kBFloat16: return 1e-2 * mag;
    case DataType::kFloat32: return 1e-6 * mag;
    case DataType::kFloat64: return 1e-12 * mag;
    default: return 0;
  }
}

struct HostTensor {
  HostTensor(DataType t, std::vector<int64_t> s)
      : dtype(t), shape(std::move(s)), bytes(NumElements(shape) * DataTypeSize(t)) {}
  TensorDesc desc() { return {bytes.data(), dtype, shape, kCpuDevice}; }
  DataType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// One rank: its communicator, context and executor, and what its groups left.
struct Rank {
  Rank(testing::CollectiveHub& hub, int rank, bool groups)
      : rank(rank),
        size(hub.size()),
        comm(hub, rank, groups),
        cpu(comm, alloc, int64_t{1} << 30),
        ctx(cpu),
        exec(rank, hub.size(), /*direct_max_tensors=*/-1, timeline, counters) {}

  HostTensor& Keep(DataType t, std::vector<int64_t> shape) {
    kept.emplace_back(t, std::move(shape));
    return kept.back();
  }
  void Run(const GroupSpec& g);
  void ExpectResults(const GroupSpec& g);
  void ExpectCost(const GroupSpec& g, size_t copies_before, size_t buffers_before, size_t launches_before);

  int rank, size;
  testing::ThreadCommunicator comm;
  testing::MallocAllocator alloc;
  CpuContext cpu;
  testing::RecordingContext ctx;
  Timeline timeline;
  Counters counters;
  Executor exec;
  std::deque<HostTensor> kept;  // inputs and outputs; a deque keeps them in place
  std::map<std::string, HostTensor*> outputs;
  std::map<std::string, Status> done;
};

Response MakeResponse(const GroupSpec& g, const TensorSpec& t, int size) {
  Response r;
  r.name = t.name;
  r.op = g.op;
  r.reduce_op = g.reduce_op;
  r.dtype = g.dtype;
  r.out_dtype = g.out_dtype;
  r.root = g.root;
  r.prescale = g.prescale;
  r.postscale = g.postscale;
  r.shape = InputShape(t, 0);
  if (g.op == OpType::kAllgather)
    for (int q = 0; q < size; ++q) r.first_dims.push_back(Rows(InputShape(t, q)));
  return r;
}

void Rank::Run(const GroupSpec& g) {
  std::vector<Response> resps;
  for (const auto& t : g.tensors) resps.push_back(MakeResponse(g, t, size));
  std::vector<const Response*> group;
  std::vector<TensorEntry> entries;
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    const TensorSpec& t = g.tensors[i];
    group.push_back(&resps[i]);
    HostTensor& in = Keep(g.dtype, InputShape(t, rank));
    for (int64_t j = 0; j < NumElements(in.shape); ++j) StoreElement(in.bytes.data(), g.dtype, j, Input(g, rank, i, j));
    TensorEntry e;
    e.request.name = t.name;
    e.input = in.desc();
    const std::string name = t.name;
    const DataType out_dt = g.out_dtype;
    switch (t.output) {
      case Out::kInPlace:
        e.output = e.input;
        outputs[name] = &in;
        break;
      case Out::kGiven: {
        HostTensor& out = Keep(out_dt, OutputShape(g, t, rank, size));
        for (int64_t j = 0; j < NumElements(out.shape); ++j) StoreElement(out.bytes.data(), out_dt, j, -1000);
        e.output = out.desc();
        outputs[name] = &out;
        break;
      }
      case Out::kSlot: {  // even splits only: rank r's slot starts r inputs in
        HostTensor& out = Keep(out_dt, OutputShape(g, t, rank, size));
        for (int64_t j = 0; j < NumElements(out.shape); ++j) StoreElement(out.bytes.data(), out_dt, j, -1000);
        uint8_t* slot = out.bytes.data() + rank * in.bytes.size();
        std::copy(in.bytes.begin(), in.bytes.end(), slot);
        e.input.data = slot;
        e.output = out.desc();
        outputs[name] = &out;
        break;
      }
      case Out::kAllocated:
        e.allocate_output = [this, name, out_dt](const std::vector<int64_t>& shape, void*, TensorDesc* out) {
          HostTensor& o = Keep(out_dt, shape);
          *out = o.desc();
          outputs[name] = &o;
          return Status::OK();
        };
        break;
      case Out::kAllocationFails:
        e.allocate_output = [](const std::vector<int64_t>&, void*, TensorDesc*) {
          return Status::Error("allocation refused");
        };
        break;
    }
    e.callback = [this, name](const Status& s, std::shared_ptr<void>) { done[name] = s; };
    entries.push_back(std::move(e));
  }
  exec.Execute(ctx, group, std::move(entries));
}

void Rank::ExpectResults(const GroupSpec& g) {
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    const std::string& name = g.tensors[i].name;
    ASSERT_TRUE(done.count(name)) << name << " was never reported";
    ASSERT_TRUE(done[name].ok()) << name << ": " << done[name].reason();
    ASSERT_TRUE(outputs.count(name)) << name;
    const HostTensor& out = *outputs[name];
    EXPECT_EQ(out.shape, OutputShape(g, g.tensors[i], rank, size)) << name;
    int64_t wrong = 0, first = -1;
    for (int64_t j = 0; j < NumElements(out.shape); ++j) {
      const double want = Expected(g, i, rank, size, j);
      if (!(std::fabs(LoadElement(out.bytes.data(), out.dtype, j) - want) <= Tolerance(out.dtype, want))) {
        if (wrong++ == 0) first = j;
      }
    }
    EXPECT_EQ(wrong, 0) << name << " on rank " << rank << ": first wrong element " << first << " is "
                        << (first >= 0 ? LoadElement(out.bytes.data(), out.dtype, first) : 0) << ", want "
                        << (first >= 0 ? Expected(g, i, rank, size, first) : 0);
  }
}

void Rank::ExpectCost(const GroupSpec& g, size_t copies_before, size_t buffers_before, size_t launches_before) {
  const Cost& c = g.cost;
  const std::string what = g.tensors.front().name + " on rank " + std::to_string(rank);
  int in = 0, out = 0;
  for (size_t k = copies_before; k < ctx.copies.size(); ++k)
    (ctx.copies[k].stage == CopyStage::kBeforeCollective ? in : out) += static_cast<int>(ctx.copies[k].descs);
  const int want_in = g.op == OpType::kBroadcast && rank != g.root && c.in_descs_others >= 0 ? c.in_descs_others : c.in_descs;
  if (want_in >= 0) {
    EXPECT_EQ(in, want_in) << what << ": descriptors copied in";
  }
  if (c.out_descs >= 0) {
    EXPECT_EQ(out, c.out_descs) << what << ": descriptors copied out";
  }
  if (c.buffers >= 0) {
    EXPECT_EQ(static_cast<int>(ctx.buffers.size() - buffers_before), c.buffers) << what;
  }
  ASSERT_EQ(comm.launches().size(), launches_before + 1) << what << ": one launch per group";
  const auto& launch = comm.launches().back();
  EXPECT_EQ(launch.grouped, c.grouped) << what;
  EXPECT_EQ(static_cast<int>(launch.calls.size()), c.calls) << what;
  // Once per launch, whatever the number of calls in it.
  auto stats = counters.Snapshot();
  ASSERT_EQ(stats.size(), 1u) << what;
  const auto& key = stats.begin()->first;
  EXPECT_EQ(std::get<1>(key), g.op) << what;
  EXPECT_EQ(std::get<3>(key), g.out_dtype) << what;
  EXPECT_EQ(stats.begin()->second.collectives, 1u) << what;
  EXPECT_EQ(stats.begin()->second.tensors, g.tensors.size()) << what;
  if (c.bytes >= 0) {
    EXPECT_EQ(static_cast<int64_t>(stats.begin()->second.bytes), c.bytes) << what;
  }
}

// Runs `groups` in order on every rank and checks each one's results and cost.
void RunAndCheck(const std::vector<GroupSpec>& groups, bool comm_groups, int size = 3,
                 std::vector<OpType> group_only = {}, bool comm_averages = false) {
  testing::CollectiveHub hub(size);
  testing::Spawn(size, [&](int r) {
    Rank k(hub, r, comm_groups);
    k.comm.GroupOnly(group_only);
    k.comm.AverageNatively(comm_averages);
    for (const auto& g : groups) {
      const size_t copies = k.ctx.copies.size(), buffers = k.ctx.buffers.size(), launches = k.comm.launches().size();
      k.counters.Reset();
      k.Run(g);
      k.ExpectResults(g);
      k.ExpectCost(g, copies, buffers, launches);
    }
  });
}

TensorSpec T(std::string name, std::vector<int64_t> shape, Out out = Out::kGiven, bool grow_rows = false) {
  return {std::move(name), std::move(shape), out, grow_rows};
}

constexpr auto kAR = OpType::kAllreduce;
constexpr auto kAG = OpType::kAllgather;
constexpr auto kRS = OpType::kReducescatter;
constexpr auto kBC = OpType::kBroadcast;
constexpr auto kF16 = DataType::kFloat16;
constexpr auto kBF16 = DataType::kBFloat16;
constexpr auto kF32 = DataType::kFloat32;
constexpr auto kF64 = DataType::kFloat64;
constexpr auto kI32 = DataType::kInt32;
constexpr auto kI64 = DataType::kInt64;

// Bytes below are worked out by hand from [Note: rank-major layout]: each
// tensor's offset in a segment is aligned to 64 bytes, segments padded to the
// longest; 3 ranks.
TEST(Executor, MixedLoneAndFusedGroupsMatchTheReference) {
  std::vector<GroupSpec> gs;
  {  // fused: 5 -> 16, 16 + 6 -> 32 floats
    auto g = Group(kAR, kF32, kF32, {T("ar.a", {5}, Out::kInPlace), T("ar.b", {3, 2}, Out::kAllocated)});
    g.prescale = 0.5, g.postscale = 2.0;
    g.cost = {2, -1, 2, 1, 1, false, 32 * 4};
    gs.push_back(g);
  }
  {  // Average: Sum, then postscale / size on the way out
    auto g = Group(kAR, kF64, kF64, {T("ar.avg", {7}, Out::kAllocated)});
    g.reduce_op = ReduceOp::kAverage;
    g.cost = {1, -1, 1, 0, 1, false, 7 * 8};
    gs.push_back(g);
  }
  {  // in place, no scale, no cast: no copy at all
    auto g = Group(kAR, kI32, kI32, {T("ar.max", {6}, Out::kInPlace)});
    g.reduce_op = ReduceOp::kMax;
    g.cost = {0, -1, 0, 0, 1, false, 6 * 4};
    gs.push_back(g);
  }
  {  // a cast on the way in
    auto g = Group(kAR, kF32, kF16, {T("ar.min16", {4})});
    g.reduce_op = ReduceOp::kMin;
    g.cost = {1, -1, 0, 0, 1, false, 4 * 2};
    gs.push_back(g);
  }
  {  // fused, uneven rows, cast: per rank 30|33|36 -> 32|64|64, + 4 -> 64|96|96 bf16
    auto g = Group(kAG, kF32, kBF16, {T("ag.a", {10, 3}, Out::kAllocated, true), T("ag.b", {2, 2})});
    g.cost = {2, -1, 6, 1, 1, false, 3 * 96 * 2};
    gs.push_back(g);
  }
  {  // lone and even: copied into its slot of the output, gathered in place
    auto g = Group(kAG, kF32, kF32, {T("ag.even", {2, 3}, Out::kAllocated)});
    g.cost = {1, -1, 0, 0, 1, false, 18 * 4};
    gs.push_back(g);
  }
  {  // lone but uneven: through the buffer, 1|2|3 -> 8 int64 per segment
    auto g = Group(kAG, kI64, kI64, {T("ag.uneven", {1}, Out::kGiven, true)});
    g.cost = {1, -1, 3, 1, 1, false, 3 * 8 * 8};
    gs.push_back(g);
  }
  {  // fused, 25 rows over 3 ranks: 18|16|16 -> 32|16|16, + 2 -> 48|32|32 floats
    auto g = Group(kRS, kF32, kF32, {T("rs.a", {25, 2}), T("rs.b", {6}, Out::kAllocated)});
    g.reduce_op = ReduceOp::kAverage, g.prescale = 0.5;
    g.cost = {6, -1, 2, 1, 1, false, 3 * 48 * 4};
    gs.push_back(g);
  }
  {  // lone and even: straight from input to output, postscale in place
    auto g = Group(kRS, kF32, kF32, {T("rs.even", {6, 2})});
    g.postscale = 0.25;
    g.cost = {0, -1, 1, 0, 1, false, 12 * 4};
    gs.push_back(g);
  }
  {  // lone but uneven: 2|1|1 -> 8 doubles per segment
    auto g = Group(kRS, kF64, kF64, {T("rs.uneven", {4}, Out::kAllocated)});
    g.reduce_op = ReduceOp::kMax;
    g.cost = {3, -1, 1, 1, 1, false, 3 * 8 * 8};
    gs.push_back(g);
  }
  {  // fused: only the root copies in; 5 -> 16, + 4 -> 32 floats
    auto g = Group(kBC, kF32, kF32, {T("bc.a", {5}, Out::kInPlace), T("bc.b", {2, 2}, Out::kAllocated)});
    g.root = 1;
    g.cost = {2, 0, 2, 1, 1, false, 32 * 4};
    gs.push_back(g);
  }
  {  // lone, in place: no copy on any rank
    auto g = Group(kBC, kI64, kI64, {T("bc.inplace", {3}, Out::kInPlace)});
    g.root = 2;
    g.cost = {0, 0, 0, 0, 1, false, 3 * 8};
    gs.push_back(g);
  }
  {  // lone with a cast: the root casts into its output
    auto g = Group(kBC, kF32, kBF16, {T("bc.cast", {4}, Out::kAllocated)});
    g.cost = {1, 0, 0, 0, 1, false, 4 * 2};
    gs.push_back(g);
  }
  RunAndCheck(gs, /*comm_groups=*/false);
}

// Sizes against plan_direct.cc's constants: groups average at least 1 MiB per
// tensor; tensors under 4 MiB share one buffer when there are 8 or more of them.
TEST(Executor, DirectGroupsRunInPlaceAsOneGroupedLaunch) {
  const int64_t n = 300000;  // 1.2 MB of floats
  std::vector<GroupSpec> gs;
  {  // only the tensor that is not in place is copied
    auto g = Group(kAR, kF32, kF32, {T("d.ar.a", {n}, Out::kInPlace), T("d.ar.b", {n})});
    g.cost = {1, -1, 0, 0, 2, true, 2 * n * 4};
    gs.push_back(g);
  }
  {  // nine small tensors share one buffer and one call; the large one (index 4) has its own
    std::vector<TensorSpec> ts;
    for (int i = 0; i < 9; ++i) ts.push_back(T("d.mix.s" + std::to_string(i), {65536}, Out::kAllocated));
    ts.insert(ts.begin() + 4, T("d.mix.big", {3000000}, Out::kInPlace));
    auto g = Group(kAR, kF32, kF32, ts);
    g.postscale = 2.0;
    g.cost = {9, -1, 10, 1, 2, true, (3000000 + 9 * 65536) * 4};
    gs.push_back(g);
  }
  {  // a cast: each input copied into its slot of the output, gathered in place
    auto g = Group(kAG, kF32, kBF16, {T("d.ag.a", {n}), T("d.ag.b", {2, n / 2}, Out::kAllocated)});
    g.cost = {2, -1, 0, 0, 2, true, 2 * 3 * n * 2};
    gs.push_back(g);
  }
  {  // no cast: sent from the inputs
    auto g = Group(kAG, kF32, kF32, {T("d.ag.c", {n}), T("d.ag.d", {n})});
    g.cost = {0, -1, 0, 0, 2, true, 2 * 3 * n * 4};
    gs.push_back(g);
  }
  {  // prescaled: scaled copies in one scratch buffer, postscale in place
    auto g = Group(kRS, kF32, kF32, {T("d.rs.a", {n}), T("d.rs.b", {3, n / 3}, Out::kAllocated)});
    g.reduce_op = ReduceOp::kAverage, g.prescale = 0.5;
    g.cost = {2, -1, 2, 1, 2, true, 2 * n * 4};
    gs.push_back(g);
  }
  {  // not prescaled: straight from input to output
    auto g = Group(kRS, kF32, kF32, {T("d.rs.c", {n}), T("d.rs.d", {n})});
    g.reduce_op = ReduceOp::kMin;
    g.cost = {0, -1, 0, 0, 2, true, 2 * n * 4};
    gs.push_back(g);
  }
  {
    auto g = Group(kBC, kI64, kI64, {T("d.bc.a", {n / 2}, Out::kInPlace), T("d.bc.b", {n / 2})});
    g.root = 1;
    g.cost = {1, 0, 0, 0, 2, true, n * 8};
    gs.push_back(g);
  }
  RunAndCheck(gs, /*comm_groups=*/true);
}

// The Gloo communicator groups reducescatter and allgather (its rings run a whole
// group through each step) but not allreduce: there the same sizes take the fusion
// buffer, as Gloo's ring over one buffer beats a call per tensor.
TEST(Executor, OnACommunicatorThatGroupsOnlyScatterAndGatherAllreduceFuses) {
  const int64_t n = 300000;  // 1.2 MB of floats
  std::vector<GroupSpec> gs;
  {
    auto g = Group(kRS, kF32, kF32, {T("g.rs.a", {n}), T("g.rs.b", {n}, Out::kAllocated)});
    g.cost = {0, -1, 0, 0, 2, true, 2 * n * 4};
    gs.push_back(g);
  }
  {
    auto g = Group(kAG, kF32, kF32, {T("g.ag.a", {n}), T("g.ag.b", {n}, Out::kAllocated)});
    g.cost = {0, -1, 0, 0, 2, true, 2 * 3 * n * 4};
    gs.push_back(g);
  }
  {
    auto g = Group(kAR, kF32, kF32, {T("g.ar.a", {n}), T("g.ar.b", {n}, Out::kAllocated)});
    g.cost = {2, -1, 2, 1, 1, false, 2 * n * 4};
    gs.push_back(g);
  }
  RunAndCheck(gs, /*comm_groups=*/true, 3, {kRS, kAG});
}

// See [Note: scale arithmetic]: on a communicator that averages (NCCL's ncclAvg),
// an allreduce's Average is the communicator's, and only a user's postscale is left
// to copy out; bf16 and reducescatter still add 1 / size to the postscale.
TEST(Executor, ACommunicatorThatAveragesTakesAllreduceAveragesButNotBf16OrReducescatter) {
  std::vector<GroupSpec> gs;
  {  // in place, nothing to copy at all
    auto g = Group(kAR, kF32, kF32, {T("avg.ar", {6}, Out::kInPlace)});
    g.reduce_op = ReduceOp::kAverage;
    g.cost = {0, -1, 0, 0, 1, false, 6 * 4};
    gs.push_back(g);
  }
  {  // the user's postscale only, in place
    auto g = Group(kAR, kF64, kF64, {T("avg.ar.post", {5}, Out::kInPlace)});
    g.reduce_op = ReduceOp::kAverage, g.postscale = 2.0;
    g.cost = {0, -1, 1, 0, 1, false, 5 * 8};
    gs.push_back(g);
  }
  {  // bf16: Sum, then postscale / size
    auto g = Group(kAR, kBF16, kBF16, {T("avg.ar.bf16", {4}, Out::kInPlace)});
    g.reduce_op = ReduceOp::kAverage;
    g.cost = {0, -1, 1, 0, 1, false, 4 * 2};
    gs.push_back(g);
  }
  {  // reducescatter: Sum, then postscale / size
    auto g = Group(kRS, kF32, kF32, {T("avg.rs", {6, 2})});
    g.reduce_op = ReduceOp::kAverage;
    g.cost = {0, -1, 1, 0, 1, false, 12 * 4};
    gs.push_back(g);
  }
  RunAndCheck(gs, /*comm_groups=*/false, 3, {}, /*comm_averages=*/true);
}

TEST(Executor, ALoneEvenAllgatherSendsFromItsSlotOfTheOutput) {
  testing::CollectiveHub hub(2);
  testing::Spawn(2, [&](int r) {
    Rank k(hub, r, false);
    k.Run(Group(kAG, kF32, kF32, {T("slot", {4})}));
    ASSERT_EQ(k.comm.launches().size(), 1u);
    const auto& call = k.comm.launches()[0].calls.at(0);
    EXPECT_EQ(call.send, k.outputs["slot"]->bytes.data() + r * 4 * sizeof(float));
    EXPECT_EQ(call.recv, k.outputs["slot"]->bytes.data());
    EXPECT_EQ(call.count, 4);
  });
}

TEST(Executor, AnAllgatherWhoseInputIsItsSlotOfTheOutputCopiesNothing) {
  // Alone (sent from its slot), and as each tensor of a direct group (in place, no cast).
  std::vector<GroupSpec> gs;
  {
    auto g = Group(kAG, kF32, kF32, {T("slot.lone", {256}, Out::kSlot)});
    g.cost = {0, -1, 0, 0, 1, false, 3 * 256 * 4};
    gs.push_back(g);
  }
  {
    auto g = Group(kAG, kBF16, kBF16, {T("slot.a", {1 << 20}, Out::kSlot), T("slot.b", {1 << 20}, Out::kSlot)});
    g.cost = {0, -1, 0, 0, 2, true, 3 * 2 * (1 << 20) * 2};
    gs.push_back(g);
  }
  RunAndCheck(gs, /*comm_groups=*/true);
}

// [Note: the gather lane]: a CUDA context picks an op's communicator and stream at
// BeginOp, so the executor names each op's type before it allocates outputs, waits for
// inputs or asks for the communicator or a buffer, once per op, in the order run.
TEST(Executor, NamesEachOpToTheContextBeforeUsingIt) {
  const int size = 2;
  testing::CollectiveHub hub(size);
  testing::Spawn(size, [&](int r) {
    Rank k(hub, r, /*groups=*/true);
    const std::vector<GroupSpec> groups = {
        Group(kAG, kF32, kBF16, {T("b.ag.a", {5}, Out::kAllocated), T("b.ag.b", {3, 2})}),
        Group(kRS, kF32, kF32, {T("b.rs", {6, 2}, Out::kAllocated)}),
        Group(kAR, kF32, kF32, {T("b.ar.a", {5}, Out::kInPlace), T("b.ar.b", {3})}),
        Group(kAG, kF32, kF32, {T("b.ag.lone", {7}, Out::kAllocated)}),
    };
    for (size_t i = 0; i < groups.size(); ++i) {
      const size_t comms = k.ctx.comm_after.size(), buffers = k.ctx.buffer_after.size();
      const size_t waits = k.ctx.wait_after.size(), outputs = k.ctx.output_after.size();
      k.Run(groups[i]);
      k.ExpectResults(groups[i]);
      ASSERT_EQ(k.ctx.begun.size(), i + 1);
      EXPECT_EQ(k.ctx.begun.back(), groups[i].op);
      ASSERT_GT(k.ctx.comm_after.size(), comms) << i;
      for (size_t j = comms; j < k.ctx.comm_after.size(); ++j) EXPECT_EQ(k.ctx.comm_after[j], i + 1) << i;
      for (size_t j = buffers; j < k.ctx.buffer_after.size(); ++j) EXPECT_EQ(k.ctx.buffer_after[j], i + 1) << i;
      ASSERT_EQ(k.ctx.wait_after.size(), waits + 1) << i;
      EXPECT_EQ(k.ctx.wait_after.back(), i + 1) << i;
      // the groups but the allreduce allocate an output: on the op's stream
      EXPECT_EQ(k.ctx.output_after.size() - outputs, groups[i].op == kAR ? 0u : 1u) << i;
      for (size_t j = outputs; j < k.ctx.output_after.size(); ++j) EXPECT_EQ(k.ctx.output_after[j], i + 1) << i;
    }
  });
}

// [Note: copy-engine allgather]: an allgather whose fused buffer fits the window runs
// there, rank-major from its base on every rank, ahead of the plans without a buffer
// (lone tensors, and a group large enough for a direct group), one after another in the
// same window, up to a buffer of exactly the window's size; one that does not fit, and
// every other op, plans as without a window.
TEST(Executor, AllgathersThatFitTheWindowRunThroughItFromItsBase) {
  const int size = 3;
  const int64_t n = 300000;  // 1.2 MB of floats a tensor: two make a direct group without a window
  testing::CollectiveHub hub(size);
  testing::Spawn(size, [&](int r) {
    Rank k(hub, r, /*groups=*/true);
    struct Case {
      size_t window;
      GroupSpec g;
      bool in_window;
    };
    std::vector<Case> cases = {
        {4096, Group(kAG, kF32, kBF16, {T("w.cast.a", {5}), T("w.cast.b", {3, 2}, Out::kAllocated, true)}), true},
        {4096, Group(kAG, kF32, kF32, {T("w.lone", {100})}), true},
        {4096, Group(kAG, kF32, kF32, {T("w.lone.again", {7}, Out::kAllocated)}), true},
        {4096, Group(kAG, kF32, kF32, {T("w.too.big", {400})}), false},
        {4096, Group(kRS, kF32, kF32, {T("w.rs", {6, 2})}), false},
        {size * 64 * 4, Group(kAG, kF32, kF32, {T("w.exact", {64})}), true},
        {size * 64 * 4, Group(kAG, kF32, kF32, {T("w.one.over", {65})}), false},
        {size * 2 * n * 4, Group(kAG, kF32, kF32, {T("w.direct.a", {n}), T("w.direct.b", {n})}), true},
        {0, Group(kAG, kF32, kF32, {T("w.direct.c", {n}), T("w.direct.d", {n})}), false},
    };
    for (const auto& c : cases) {
      k.ctx.window.assign(c.window, 0);
      const uint8_t* base = k.ctx.window.data();
      const int uses = k.ctx.window_uses;
      k.Run(c.g);
      k.ExpectResults(c.g);
      const std::string what = c.g.tensors.front().name + " on rank " + std::to_string(r);
      EXPECT_EQ(k.ctx.window_uses - uses, c.in_window ? 1 : 0) << what;
      const auto& calls = k.comm.launches().back().calls;
      if (c.in_window) {
        ASSERT_EQ(calls.size(), 1u) << what;
        EXPECT_EQ(calls[0].recv, base) << what;
        // in place: this rank's segment of the window
        EXPECT_EQ(static_cast<const uint8_t*>(calls[0].send), base + r * calls[0].count * DataTypeSize(c.g.out_dtype))
            << what;
      } else {
        EXPECT_TRUE(c.window == 0 || calls[0].recv < base || calls[0].recv >= base + c.window) << what;
      }
    }
    // Without the window the same sizes make a direct group: one call per tensor.
    EXPECT_EQ(k.comm.launches().back().calls.size(), 2u);
  });
}

// One group fails (a call, or an output allocation); its entries get the error,
// the groups before and after it complete, and only launched calls are counted.
TEST(Executor, AFailedGroupFailsItsOwnEntriesOnly) {
  std::vector<GroupSpec> gs = {
      Group(kAR, kF32, kF32, {T("ok.fused.a", {5}), T("ok.fused.b", {4}, Out::kInPlace)}),
      Group(kAR, kF32, kF32, {T("bad.call", {777})}),
      Group(kAG, kF32, kF32, {T("ok.gather", {2, 2}, Out::kAllocated)}),
      Group(kAR, kF32, kF32, {T("bad.alloc.a", {3}, Out::kAllocationFails), T("bad.alloc.b", {3})}),
      Group(kBC, kF32, kF32, {T("ok.bcast", {6}, Out::kInPlace)}),
  };
  testing::CollectiveHub hub(3);
  testing::Spawn(3, [&](int r) {
    Rank k(hub, r, false);
    k.comm.FailCallsOfCount(777);
    for (const auto& g : gs) k.Run(g);
    for (size_t i : {0, 2, 4}) k.ExpectResults(gs[i]);
    ASSERT_TRUE(k.done.count("bad.call"));
    EXPECT_NE(k.done["bad.call"].reason().find("injected failure"), std::string::npos) << k.done["bad.call"].reason();
    for (const char* name : {"bad.alloc.a", "bad.alloc.b"}) {
      ASSERT_TRUE(k.done.count(name)) << name;
      EXPECT_EQ(k.done[name].reason(), "allocation refused") << name;
    }
    EXPECT_EQ(k.comm.launches().size(), 3u);
    uint64_t collectives = 0;
    for (const auto& kv : k.counters.Snapshot()) collectives += kv.second.collectives;
    EXPECT_EQ(collectives, 3u);
  });
}

TEST(Executor, AFailedCallInsideADirectGroupStillClosesTheGroup) {
  const int64_t n = 300000;
  std::vector<GroupSpec> gs = {
      Group(kAR, kF32, kF32, {T("bad.a", {n}), T("bad.b", {n + 1}), T("bad.c", {n + 2})}),
      Group(kAR, kF32, kF32, {T("after.a", {n}, Out::kInPlace), T("after.b", {n + 2}, Out::kInPlace)}),
  };
  testing::CollectiveHub hub(3);
  testing::Spawn(3, [&](int r) {
    Rank k(hub, r, true);
    k.comm.FailCallsOfCount(n + 1);
    for (const auto& g : gs) k.Run(g);
    for (const char* name : {"bad.a", "bad.b", "bad.c"}) {
      ASSERT_TRUE(k.done.count(name)) << name;
      EXPECT_NE(k.done[name].reason().find("injected failure"), std::string::npos) << name;
    }
    // Had the failed group stayed open, the next GroupStart would have failed.
    EXPECT_EQ(k.comm.group_starts(), 2);
    EXPECT_EQ(k.comm.group_ends(), 2);
    k.ExpectResults(gs[1]);
    ASSERT_EQ(k.comm.launches().size(), 1u);
    EXPECT_EQ(k.comm.launches()[0].calls.size(), 2u);
  });
}

// Timeline spans per tensor, read back from rank 0's file.
std::map<std::string, std::multiset<std::string>> ReadSpans(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  std::map<int, std::string> tracks;
  const std::regex meta(R"re("ph":"M","pid":\d+,"tid":(\d+),"args":\{"name":"([^"]*)")re");
  for (std::sregex_iterator it(text.begin(), text.end(), meta), end; it != end; ++it)
    tracks[std::stoi((*it)[1])] = (*it)[2];
  std::map<std::string, std::multiset<std::string>> spans;
  const std::regex span(R"re(\{"name":"([A-Z_]+)","ph":"X","pid":\d+,"tid":(\d+))re");
  for (std::sregex_iterator it(text.begin(), text.end(), span), end; it != end; ++it)
    spans[tracks[std::stoi((*it)[2])]].insert((*it)[1]);
  return spans;
}

TEST(Executor, ACopyPhaseHasATimelineSpanWhenItCopies) {
  const std::string path = ::testing::TempDir() + "executor_timeline.json";
  std::vector<GroupSpec> gs = {
      Group(kAR, kF32, kF32, {T("t.inplace", {4}, Out::kInPlace)}),
      Group(kAR, kF32, kF32, {T("t.fused.a", {4}), T("t.fused.b", {3})}),
      Group(kRS, kF32, kF32, {T("t.scatter", {4})}),
      Group(kAG, kF32, kF32, {T("t.gather", {2})}),
  };
  testing::CollectiveHub hub(2);
  testing::Spawn(2, [&](int r) {
    Rank k(hub, r, false);
    if (r == 0) {
      ASSERT_TRUE(k.timeline.Open(path, 0));
    }
    for (const auto& g : gs) k.Run(g);
    k.timeline.Close();
  });
  auto spans = ReadSpans(path);
  using S = std::multiset<std::string>;
  EXPECT_EQ(spans["t.inplace"], S({"COLLECTIVE"}));
  EXPECT_EQ(spans["t.fused.a"], S({"COPY_IN", "COLLECTIVE", "COPY_OUT"}));
  EXPECT_EQ(spans["t.fused.b"], S({"COPY_IN", "COLLECTIVE", "COPY_OUT"}));
  EXPECT_EQ(spans["t.scatter"], S({"COLLECTIVE"}));
  EXPECT_EQ(spans["t.gather"], S({"COPY_IN", "COLLECTIVE"}));
}

}  // namespace
}  // namespace hvdz
