// AioFile: one file read and written with O_DIRECT through an io_uring, for the
// NVMe swapper of optimizer state (horovod_zero/torch/zero/offload/nvme.py).
//
// A transfer (Read or Write) is split into requests of at most `request_bytes`, of
// which at most `queue_depth` are in the kernel at once; the rest wait in a queue.
// A reaper thread collects completions and tops the kernel's queue up again, so a
// transfer makes progress while its caller computes, and the caller collects it
// with Wait(ticket). Short transfers are continued, and requests the kernel answers
// with EINTR or EAGAIN are sent again. Buffers, offsets and lengths must be
// multiples of alignment(): the file system's direct-I/O alignment, at least 4096.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"

struct io_uring;  // liburing's ring; only aio_file.cc sees liburing.h

namespace hvdz {

struct AioOptions {
  int queue_depth = 8;             // requests in the kernel at once
  int64_t request_bytes = 1 << 20; // largest request; rounded down to the alignment
};

class AioFile {
 public:
  // Opens `path` for direct I/O, creating it when missing, and reserves at least
  // `nbytes` (rounded up to the alignment) on disk with fallocate.
  static Status Open(const std::string& path, int64_t nbytes, const AioOptions& options,
                     std::unique_ptr<AioFile>* out);
  ~AioFile();  // Close(): waits for whatever is in flight
  AioFile(const AioFile&) = delete;
  AioFile& operator=(const AioFile&) = delete;

  // Start a transfer of `nbytes` between `buf` and the file at `offset`; `*ticket`
  // names it for Wait. The buffer must stay valid until the ticket is waited for.
  Status Read(void* buf, int64_t nbytes, int64_t offset, int64_t* ticket);
  Status Write(const void* buf, int64_t nbytes, int64_t offset, int64_t* ticket);

  // Waits until the transfer is done or `deadline` passes. Done: *done is true, the
  // transfer's status is returned and the ticket is forgotten. Not yet: *done is
  // false, OK is returned and the ticket stays valid.
  Status WaitUntil(int64_t ticket, std::chrono::steady_clock::time_point deadline, bool* done);
  Status Wait(int64_t ticket);

  // Waits for every transfer in flight, then closes the ring and the file (the file
  // stays on disk). Later transfers are refused.
  Status Close();

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  int64_t alignment() const { return alignment_; }
  int queue_depth() const { return options_.queue_depth; }
  int64_t request_bytes() const { return options_.request_bytes; }
  int64_t bytes_read() const;
  int64_t bytes_written() const;
  int transfers_in_flight() const;  // tickets not yet waited for

 private:
  struct Request {
    int64_t ticket;
    char* buf;
    int64_t len;
    int64_t offset;
  };
  struct Transfer {
    bool write;
    int64_t nbytes;
    int64_t offset;
    int64_t unresolved;  // requests not yet completed or dropped
    Status status;
  };

  AioFile(std::string path, int fd, int64_t size, int64_t alignment, const AioOptions& options);
  Status Start(char* buf, int64_t nbytes, int64_t offset, bool write, int64_t* ticket);
  Status CheckAligned(const void* buf, int64_t nbytes, int64_t offset, bool write) const;
  void Reap();
  void FillLocked();
  void SubmitLocked();
  void CompleteLocked(uint64_t slot, int res);
  void ResolveLocked(Transfer& t, const Status& s);
  Status RequestError(const Transfer& t, const Request& q, const std::string& what) const;

  const std::string path_;
  const int fd_;
  const int64_t size_;
  const int64_t alignment_;
  const AioOptions options_;
  std::unique_ptr<io_uring> ring_;

  mutable std::mutex mu_;
  std::condition_variable done_cv_;  // a transfer resolved, or the ring drained
  std::condition_variable work_cv_;  // the reaper has requests in the kernel to wait for
  std::unordered_map<int64_t, Transfer> transfers_;
  std::deque<Request> queued_;       // not yet given to the ring
  std::vector<Request> slots_;       // one per ring entry; the index is the request's user_data
  std::vector<uint64_t> free_slots_;
  std::deque<uint64_t> unsent_;      // slots prepared in the ring, not yet taken by the kernel
  int in_kernel_ = 0;                // slots taken by the kernel, completion not yet reaped
  int64_t next_ticket_ = 1;
  int64_t bytes_read_ = 0;
  int64_t bytes_written_ = 0;
  Status broken_;                    // a failed submission: nothing more is sent
  bool closed_ = false;
  std::thread reaper_;
};

}  // namespace hvdz
