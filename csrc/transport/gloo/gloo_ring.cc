#include "transport/gloo/gloo_ring.h"

#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>

#include "transport/gloo/gloo_tensors.h"

namespace hvdz {
namespace {

// Every ring message carries this tag. Gloo matches the messages between two ranks
// that share a tag in the order they were posted, and every rank posts the same
// messages in the same order.
constexpr int kRingTag = 0;

int Mod(int a, int n) { return ((a % n) + n) % n; }

// dst = dst op src, element by element.
void Reduce(void* dst, const void* src, int64_t count, DataType dtype, ReduceOp op) {
  at::Tensor d = Wrap(dst, count, dtype);
  const at::Tensor s = Wrap(src, count, dtype);
  switch (op) {
    case ReduceOp::kMin: at::minimum_out(d, d, s); return;
    case ReduceOp::kMax: at::maximum_out(d, d, s); return;
    case ReduceOp::kProduct: d.mul_(s); return;
    default: d.add_(s); return;  // Sum: Average reaches a communicator as Sum with a postscale
  }
}

// Calls f(offset, bytes) for each piece of `bytes`, pieces of at most `piece` bytes.
template <typename F>
void ForPieces(int64_t bytes, int64_t piece, F f) {
  for (int64_t off = 0; off < bytes; off += piece) f(off, std::min(piece, bytes - off));
}

// The messages of one ring step: every receive and send is posted before any is
// waited for; receives are waited for in order, and each one's `then` (its
// reduction) runs as soon as it has landed. Throws what Gloo throws.
class Step {
 public:
  Step(c10d::Backend& b, std::chrono::milliseconds timeout) : b_(b), timeout_(timeout) {}

  void Recv(void* p, int64_t bytes, int from, std::function<void()> then = {}) {
    std::vector<at::Tensor> t{Wrap(p, bytes, DataType::kUInt8)};
    recvs_.push_back({b_.recv(t, from, kRingTag), std::move(then)});
  }
  void Send(const void* p, int64_t bytes, int to) {
    std::vector<at::Tensor> t{Wrap(p, bytes, DataType::kUInt8)};
    sends_.push_back(b_.send(t, to, kRingTag));
  }
  void Wait() {
    for (auto& r : recvs_) {
      Check(*r.work, "receive");
      if (r.then) r.then();
    }
    for (auto& s : sends_) Check(*s, "send");
  }

 private:
  struct Received {
    c10::intrusive_ptr<c10d::Work> work;
    std::function<void()> then;
  };
  void Check(c10d::Work& w, const char* what) {
    if (!w.wait(timeout_)) throw std::runtime_error(std::string(what) + " aborted");
  }

  c10d::Backend& b_;
  std::chrono::milliseconds timeout_;
  std::vector<Received> recvs_;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends_;
};

// Whole elements per piece.
int64_t PieceBytes(const RingOptions& o, int64_t elem) { return std::max<int64_t>(1, o.piece_bytes / elem) * elem; }

}  // namespace

// Step s sends the partial sum of segment r - s - 1 to the next rank and receives
// that of segment r - s - 2 from the previous one, adding this rank's own part of it;
// after n - 1 steps the segment received is r, complete. The partial sums alternate
// between a scratch segment and the output, so that the last step lands in the output.
Status GlooRing::ReduceScatter(const std::vector<RingCall>& given, DataType dtype, ReduceOp op) {
  const int n = b_->getSize(), r = b_->getRank();
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype)), piece = PieceBytes(options_, elem);
  try {
    if (n == 1) {
      for (const auto& c : given)
        if (c.send != c.recv) std::memmove(c.recv, c.send, c.count * elem);
      return Status::OK();
    }
    // An output inside its own input (in place, as NCCL allows) would be overwritten
    // by a receive before its own part is added: such a call lands in a temporary.
    std::vector<RingCall> calls(given);
    std::vector<at::Tensor> temps(calls.size());
    for (size_t k = 0; k < calls.size(); ++k) {
      const char* in = static_cast<const char*>(calls[k].send);
      const char* out = static_cast<const char*>(calls[k].recv);
      const int64_t bytes = calls[k].count * elem;
      if (out + bytes > in && out < in + n * bytes) {
        temps[k] = at::empty({bytes}, at::kByte);
        calls[k].recv = temps[k].data_ptr();
      }
    }
    at::Tensor scratch;
    std::vector<char*> other(calls.size(), nullptr);
    if (n > 2) {
      int64_t total = 0;
      for (const auto& c : calls) total += c.count * elem;
      scratch = at::empty({total}, at::kByte);
      char* p = static_cast<char*>(scratch.data_ptr());
      for (size_t k = 0; k < calls.size(); ++k) {
        other[k] = p;
        p += calls[k].count * elem;
      }
    }
    // The buffer that receives at step s: the output on the last step, and every other one before it.
    auto landing = [&](size_t k, int s) {
      return (n - 2 - s) % 2 == 0 ? static_cast<char*>(calls[k].recv) : other[k];
    };
    for (int s = 0; s < n - 1; ++s) {
      Step step(*b_, options_.timeout);
      const int send_seg = Mod(r - s - 1, n), recv_seg = Mod(r - s - 2, n);
      for (size_t k = 0; k < calls.size(); ++k) {
        const int64_t bytes = calls[k].count * elem;
        const char* mine = static_cast<const char*>(calls[k].send) + recv_seg * bytes;
        char* into = landing(k, s);
        ForPieces(bytes, piece, [&](int64_t off, int64_t len) {
          step.Recv(into + off, len, Mod(r - 1, n),
                    [=] { Reduce(into + off, mine + off, len / elem, dtype, op); });
        });
      }
      for (size_t k = 0; k < calls.size(); ++k) {
        const int64_t bytes = calls[k].count * elem;
        const char* from = s == 0 ? static_cast<const char*>(calls[k].send) + send_seg * bytes : landing(k, s - 1);
        ForPieces(bytes, piece, [&](int64_t off, int64_t len) { step.Send(from + off, len, Mod(r + 1, n)); });
      }
      step.Wait();
    }
    for (size_t k = 0; k < calls.size(); ++k)
      if (temps[k].defined()) std::memcpy(given[k].recv, calls[k].recv, calls[k].count * elem);
    return Status::OK();
  } catch (const std::exception& e) {
    return Status::Aborted(std::string("Gloo reducescatter (ring of sends) failed: ") + e.what());
  }
}

// Step s sends segment r - s (this rank's own on the first step, straight from the
// input) to the next rank and receives segment r - s - 1 from the previous one.
Status GlooRing::Allgather(const std::vector<RingCall>& calls, DataType dtype) {
  const int n = b_->getSize(), r = b_->getRank();
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype)), piece = PieceBytes(options_, elem);
  auto own_slot = [&](const RingCall& c) { return static_cast<char*>(c.recv) + r * c.count * elem; };
  try {
    for (int s = 0; s < n - 1; ++s) {
      Step step(*b_, options_.timeout);
      const int send_seg = Mod(r - s, n), recv_seg = Mod(r - s - 1, n);
      for (const auto& c : calls) {
        char* out = static_cast<char*>(c.recv);
        const int64_t bytes = c.count * elem;
        ForPieces(bytes, piece, [&](int64_t off, int64_t len) { step.Recv(out + recv_seg * bytes + off, len, Mod(r - 1, n)); });
      }
      for (const auto& c : calls) {
        const int64_t bytes = c.count * elem;
        const char* from = s == 0 ? static_cast<const char*>(c.send) : static_cast<char*>(c.recv) + send_seg * bytes;
        ForPieces(bytes, piece, [&](int64_t off, int64_t len) { step.Send(from + off, len, Mod(r + 1, n)); });
      }
      if (s == 0) {  // while the first messages travel
        for (const auto& c : calls)
          if (c.send != own_slot(c)) std::memcpy(own_slot(c), c.send, c.count * elem);
      }
      step.Wait();
    }
    if (n == 1) {
      for (const auto& c : calls)
        if (c.send != own_slot(c)) std::memmove(own_slot(c), c.send, c.count * elem);
    }
    return Status::OK();
  } catch (const std::exception& e) {
    return Status::Aborted(std::string("Gloo allgather (ring of sends) failed: ") + e.what());
  }
}

}  // namespace hvdz
