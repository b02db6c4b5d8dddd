#include "transport/gloo/gloo_transport.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "transport/gloo/gloo_ring.h"
#include "transport/gloo/gloo_tensors.h"

namespace hvdz {
namespace {

// Below this many bytes (size * count summed over a group's calls) a reduce-scatter
// or allgather uses Gloo's own collective: a ring step's handshakes wake more
// threads, which costs a small op more than the bytes do. Measured on 2 CPU ranks
// of a loaded 2-core machine (lone ops, median us, Gloo's -> ring): 256 KiB
// reducescatter 1400-2000 -> 3700-4000, allgather 900-1700 -> 400-4000; 1 MiB
// reducescatter 3300-4300 -> 850-4000, allgather 1700-4200 -> 800-4000; 4 MiB
// 7600-9600 -> 2500-7300 and 5400-7000 -> 3800-7600.
constexpr int64_t kRingMinBytes = 1 << 20;

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::kMax: return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kProduct: return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
    default: return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
}

// For ops that only move data: int16, which this Gloo cannot handle, as bytes.
at::Tensor WrapMoved(const void* p, int64_t count, DataType t) {
  const MovedAs m = MoveAs(t);
  return Wrap(p, count * m.per_element, m.dtype);
}

// Runs one Gloo call to completion; Gloo's exceptions (timeouts, closed
// connections) become a Status here and never reach the background loop.
template <typename F>
Status Run(const char* what, std::chrono::milliseconds timeout, F issue) {
  try {
    c10::intrusive_ptr<c10d::Work> w = issue();
    w->wait(timeout);
    return Status::OK();
  } catch (const std::exception& e) {
    return Status::Aborted(std::string("Gloo ") + what + " failed: " + e.what());
  }
}

class Base {
 public:
  Base(GlooBackend b, double timeout_s)
      : b_(std::move(b)), timeout_(static_cast<int64_t>(timeout_s * 1000)) {}

 protected:
  GlooBackend b_;
  std::chrono::milliseconds timeout_;
};

class GlooControlPlane : public ControlPlane, Base {
 public:
  using Base::Base;
  int rank() const override { return b_->getRank(); }
  int size() const override { return b_->getSize(); }
  const char* kind() const override { return "gloo"; }

  Status Allgather(const std::vector<uint8_t>& mine, std::vector<uint8_t>* all) override {
    all->assign(mine.size() * size(), 0);
    if (mine.empty()) return Status::OK();
    at::Tensor in = Wrap(mine.data(), mine.size(), DataType::kUInt8);
    at::Tensor out = Wrap(all->data(), all->size(), DataType::kUInt8);
    c10d::AllgatherOptions o;
    o.timeout = timeout_;
    return Run("allgather (negotiation)", timeout_, [&] { return b_->_allgather_base(out, in, o); });
  }

  Status Gatherv(const std::vector<uint8_t>& mine, std::vector<std::vector<uint8_t>>* at_root) override {
    // Lengths first, then every payload padded to the longest; small and rare (slow path only).
    std::vector<uint8_t> len(8), lens;
    int64_t n = static_cast<int64_t>(mine.size());
    std::memcpy(len.data(), &n, 8);
    HVDZ_RETURN_IF_ERROR(Allgather(len, &lens));
    std::vector<int64_t> sizes(size());
    std::memcpy(sizes.data(), lens.data(), 8 * size());
    int64_t longest = *std::max_element(sizes.begin(), sizes.end());
    std::vector<uint8_t> padded(mine), all;
    padded.resize(longest, 0);
    HVDZ_RETURN_IF_ERROR(Allgather(padded, &all));
    if (rank() != 0) return Status::OK();
    at_root->clear();
    for (int r = 0; r < size(); ++r)
      at_root->emplace_back(all.begin() + r * longest, all.begin() + r * longest + sizes[r]);
    return Status::OK();
  }

  Status Broadcast(std::vector<uint8_t>* buf) override {
    int64_t n = static_cast<int64_t>(buf->size());
    at::Tensor len = Wrap(&n, 1, DataType::kInt64);
    HVDZ_RETURN_IF_ERROR(BroadcastTensor(len));
    buf->resize(n);
    if (n == 0) return Status::OK();
    at::Tensor t = Wrap(buf->data(), n, DataType::kUInt8);
    return BroadcastTensor(t);
  }

 private:
  Status BroadcastTensor(at::Tensor& t) {
    std::vector<at::Tensor> ts{t};
    c10d::BroadcastOptions o;
    o.rootRank = 0;
    o.timeout = timeout_;
    return Run("broadcast (negotiation)", timeout_, [&] { return b_->broadcast(ts, o); });
  }
};

class GlooCommunicator : public Communicator, Base {
 public:
  GlooCommunicator(GlooBackend b, double timeout_s) : Base(b, timeout_s), ring_(b, RingOptions{timeout_}) {}

  Status Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) override {
    std::vector<at::Tensor> ts{Wrap(buf, count, dtype)};
    c10d::AllreduceOptions o;
    o.reduceOp = ToC10d(op);
    o.timeout = timeout_;
    return Run("allreduce", timeout_, [&] { return b_->allreduce(ts, o); });
  }

  // Reduce-scatter and allgather are rings of sends ([Note: rings over Gloo's
  // sends]); inside a group they wait for GroupEnd, which runs them together.
  Status Allgather(const void* in, void* out, int64_t count, DataType dtype) override {
    return Add({OpType::kAllgather, MoveAs(dtype).dtype, ReduceOp::kSum},
               {in, out, count * MoveAs(dtype).per_element});
  }

  Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op) override {
    return Add({OpType::kReducescatter, dtype, op}, {in, out, count});
  }

  bool Groups(OpType op) const override { return op == OpType::kReducescatter || op == OpType::kAllgather; }
  Status GroupStart() override {
    grouping_ = true;
    return Status::OK();
  }
  Status GroupEnd() override {
    grouping_ = false;
    return Flush();
  }

  Status Broadcast(void* buf, int64_t count, DataType dtype, int root) override {
    std::vector<at::Tensor> ts{WrapMoved(buf, count, dtype)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = timeout_;
    return Run("broadcast", timeout_, [&] { return b_->broadcast(ts, o); });
  }

  Status Alltoall(const void* in, void* out, const std::vector<int64_t>& send_counts,
                  const std::vector<int64_t>& recv_counts, DataType dtype) override {
    const int64_t k = MoveAs(dtype).per_element;
    std::vector<int64_t> send(send_counts), recv(recv_counts);
    int64_t n_send = 0, n_recv = 0;
    for (auto& c : send) n_send += (c *= k);
    for (auto& c : recv) n_recv += (c *= k);
    at::Tensor src = WrapMoved(in, n_send / k, dtype);
    at::Tensor dst = WrapMoved(out, n_recv / k, dtype);
    c10d::AllToAllOptions o;
    o.timeout = timeout_;
    return Run("alltoall", timeout_, [&] { return b_->alltoall_base(dst, src, recv, send, o); });
  }

 private:
  struct Kind {
    OpType op;
    DataType dtype;
    ReduceOp reduce;
    bool operator==(const Kind& o) const { return op == o.op && dtype == o.dtype && reduce == o.reduce; }
  };

  Status Add(const Kind& kind, const RingCall& call) {
    if (!pending_.empty() && !(kind == kind_)) HVDZ_RETURN_IF_ERROR(Flush());  // groups hold one kind
    kind_ = kind;
    pending_.push_back(call);
    return grouping_ ? Status::OK() : Flush();
  }

  Status Flush() {
    if (pending_.empty()) return Status::OK();
    std::vector<RingCall> calls;
    calls.swap(pending_);
    int64_t bytes = 0;
    for (const auto& c : calls) bytes += c.count * b_->getSize() * static_cast<int64_t>(DataTypeSize(kind_.dtype));
    if (bytes >= kRingMinBytes) {
      return kind_.op == OpType::kAllgather ? ring_.Allgather(calls, kind_.dtype)
                                            : ring_.ReduceScatter(calls, kind_.dtype, kind_.reduce);
    }
    for (const auto& c : calls)
      HVDZ_RETURN_IF_ERROR(kind_.op == OpType::kAllgather ? GlooAllgather(c) : GlooReduceScatter(c, kind_.reduce));
    return Status::OK();
  }

  // Small ops: Gloo's own collectives, one per call. They wake fewer threads than a
  // ring step's handshakes, which is what a small op's time is made of.
  Status GlooAllgather(const RingCall& c) {
    const int64_t bytes = c.count * static_cast<int64_t>(DataTypeSize(kind_.dtype));
    at::Tensor src = Wrap(c.send, c.count, kind_.dtype);
    // Gloo copies the input into its slot itself; give it a separate input when they alias.
    const char* in = static_cast<const char*>(c.send);
    const char* out = static_cast<const char*>(c.recv);
    if (in >= out && in < out + bytes * b_->getSize()) src = src.clone();
    at::Tensor dst = Wrap(c.recv, c.count * b_->getSize(), kind_.dtype);
    c10d::AllgatherOptions o;
    o.timeout = timeout_;
    return Run("allgather", timeout_, [&] { return b_->_allgather_base(dst, src, o); });
  }

  Status GlooReduceScatter(const RingCall& c, ReduceOp op) {
    at::Tensor src = Wrap(c.send, c.count * b_->getSize(), kind_.dtype);
    at::Tensor dst = Wrap(c.recv, c.count, kind_.dtype);
    c10d::ReduceScatterOptions o;
    o.reduceOp = ToC10d(op);
    o.timeout = timeout_;
    return Run("reducescatter", timeout_, [&] { return b_->_reduce_scatter_base(dst, src, o); });
  }

  GlooRing ring_;
  bool grouping_ = false;
  Kind kind_{};
  std::vector<RingCall> pending_;  // calls of one kind waiting for GroupEnd
};

}  // namespace

std::unique_ptr<ControlPlane> MakeGlooControlPlane(GlooBackend backend, double timeout_s) {
  return std::unique_ptr<ControlPlane>(new GlooControlPlane(std::move(backend), timeout_s));
}

std::unique_ptr<Communicator> MakeGlooCommunicator(GlooBackend backend, double timeout_s) {
  return std::unique_ptr<Communicator>(new GlooCommunicator(std::move(backend), timeout_s));
}

}  // namespace hvdz
