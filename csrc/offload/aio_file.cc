#include "offload/aio_file.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace hvdz {
namespace {

constexpr int64_t kMinAlignment = 4096;
constexpr int kMaxQueueDepth = 4096;
constexpr int64_t kMaxRequestBytes = 1 << 30;  // the kernel moves at most ~2 GiB per read or write

std::string ErrnoText(int err) {
  char buf[256];
  // GNU strerror_r: returns the text, not always in buf.
  const char* s = strerror_r(err, buf, sizeof(buf));
  return std::string(s) + " (errno " + std::to_string(err) + ")";
}

std::string NoDirectIo(const std::string& path) {
  return "The file system of '" + path +
         "' does not support direct I/O (O_DIRECT), which NVMe offload needs: use a directory on a local disk "
         "(e.g. an ext4 or xfs NVMe mount).";
}

// What the file system asks of direct I/O buffers and offsets (statx's
// STATX_DIOALIGN, Linux 6.1+), never less than a page; a page where unknown.
Status DirectIoAlignment(int fd, const std::string& path, int64_t* out) {
  *out = kMinAlignment;
#ifdef STATX_DIOALIGN
  struct statx sx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
    if (sx.stx_dio_offset_align == 0) return Status::InvalidArgument(NoDirectIo(path));
    *out = std::max<int64_t>({kMinAlignment, sx.stx_dio_mem_align, sx.stx_dio_offset_align});
  }
#else
  (void)fd;
  (void)path;
#endif
  return Status::OK();
}

// fallocate reserves the blocks, so a full disk fails here rather than in the
// middle of a step; file systems without it get a sparse file.
Status Reserve(int fd, const std::string& path, int64_t nbytes) {
  if (nbytes == 0 || fallocate(fd, 0, 0, nbytes) == 0) return Status::OK();
  const int err = errno;
  if ((err == EOPNOTSUPP || err == ENOSYS) && ftruncate(fd, nbytes) == 0) return Status::OK();
  return Status::Error("Cannot reserve " + std::to_string(nbytes) + " bytes for '" + path + "': " + ErrnoText(err));
}

int64_t FileSize(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

}  // namespace

Status AioFile::Open(const std::string& path, int64_t nbytes, const AioOptions& options,
                     std::unique_ptr<AioFile>* out) {
  if (nbytes < 0) return Status::InvalidArgument("AioFile size must be >= 0, got " + std::to_string(nbytes) + ".");
  if (options.queue_depth < 1 || options.queue_depth > kMaxQueueDepth)
    return Status::InvalidArgument("AioFile queue depth must be in [1, " + std::to_string(kMaxQueueDepth) + "], got " +
                                   std::to_string(options.queue_depth) + ".");
  if (options.request_bytes < 1 || options.request_bytes > kMaxRequestBytes)
    return Status::InvalidArgument("AioFile request size must be in [1, " + std::to_string(kMaxRequestBytes) +
                                   "] bytes, got " + std::to_string(options.request_bytes) + ".");
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EINVAL) return Status::InvalidArgument(NoDirectIo(path));
    return Status::Error("Cannot open '" + path + "' for direct I/O: " + ErrnoText(err));
  }
  int64_t alignment = kMinAlignment;
  Status s = DirectIoAlignment(fd, path, &alignment);
  const int64_t want = (nbytes + alignment - 1) / alignment * alignment;
  if (s.ok() && FileSize(fd) < want) s = Reserve(fd, path, want);
  if (!s.ok()) {
    close(fd);
    return s;
  }
  AioOptions opts = options;
  opts.request_bytes = std::max(alignment, opts.request_bytes / alignment * alignment);
  std::unique_ptr<AioFile> f(new AioFile(path, fd, std::max(want, FileSize(fd)), alignment, opts));
  const int r = io_uring_queue_init(static_cast<unsigned>(opts.queue_depth), f->ring_.get(), 0);
  if (r < 0) {
    f->ring_.reset();  // nothing to exit
    return Status::Error("Cannot set up io_uring for '" + path + "': " + ErrnoText(-r) +
                         ". NVMe offload needs io_uring (Linux 5.1+, not disabled by "
                         "/proc/sys/kernel/io_uring_disabled or a seccomp policy).");
  }
  f->reaper_ = std::thread(&AioFile::Reap, f.get());
  *out = std::move(f);
  return Status::OK();
}

AioFile::AioFile(std::string path, int fd, int64_t size, int64_t alignment, const AioOptions& options)
    : path_(std::move(path)), fd_(fd), size_(size), alignment_(alignment), options_(options),
      ring_(new io_uring()), slots_(options.queue_depth) {
  for (int i = options.queue_depth - 1; i >= 0; --i) free_slots_.push_back(static_cast<uint64_t>(i));
}

AioFile::~AioFile() { Close(); }

Status AioFile::Close() {
  {
    std::unique_lock<std::mutex> l(mu_);
    if (closed_) return Status::OK();
    // The kernel may still write into callers' buffers: wait for every request.
    done_cv_.wait(l, [&] { return queued_.empty() && unsent_.empty() && in_kernel_ == 0; });
    closed_ = true;
  }
  work_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  if (ring_) io_uring_queue_exit(ring_.get());
  ring_.reset();
  close(fd_);
  return Status::OK();
}

int64_t AioFile::bytes_read() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_read_;
}

int64_t AioFile::bytes_written() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_written_;
}

int AioFile::transfers_in_flight() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int>(transfers_.size());
}

Status AioFile::Read(void* buf, int64_t nbytes, int64_t offset, int64_t* ticket) {
  return Start(static_cast<char*>(buf), nbytes, offset, /*write=*/false, ticket);
}

Status AioFile::Write(const void* buf, int64_t nbytes, int64_t offset, int64_t* ticket) {
  // io_uring takes a non-const pointer for both directions; a write only reads it.
  return Start(static_cast<char*>(const_cast<void*>(buf)), nbytes, offset, /*write=*/true, ticket);
}

Status AioFile::CheckAligned(const void* buf, int64_t nbytes, int64_t offset, bool write) const {
  const std::string what = std::string(write ? "write to" : "read from") + " '" + path_ + "'";
  const std::string a = std::to_string(alignment_);
  if (reinterpret_cast<uintptr_t>(buf) % alignment_ != 0)
    return Status::InvalidArgument("Direct I/O " + what + ": the buffer address is not a multiple of " + a +
                                   " bytes; allocate it aligned.");
  if (nbytes < 0 || nbytes % alignment_ != 0)
    return Status::InvalidArgument("Direct I/O " + what + ": the length " + std::to_string(nbytes) +
                                   " is not a non-negative multiple of " + a + " bytes; pad it.");
  if (offset < 0 || offset % alignment_ != 0)
    return Status::InvalidArgument("Direct I/O " + what + ": the offset " + std::to_string(offset) +
                                   " is not a non-negative multiple of " + a + " bytes.");
  if (offset + nbytes > size_)
    return Status::InvalidArgument("Direct I/O " + what + ": bytes [" + std::to_string(offset) + ", " +
                                   std::to_string(offset + nbytes) + ") end past the file's " +
                                   std::to_string(size_) + " bytes.");
  return Status::OK();
}

Status AioFile::Start(char* buf, int64_t nbytes, int64_t offset, bool write, int64_t* ticket) {
  HVDZ_RETURN_IF_ERROR(CheckAligned(buf, nbytes, offset, write));
  {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return Status::PreconditionError("'" + path_ + "' is closed.");
    if (!broken_.ok()) return broken_;
    *ticket = next_ticket_++;
    int64_t n = 0;
    for (int64_t done = 0; done < nbytes; done += options_.request_bytes, ++n) {
      const int64_t len = std::min(options_.request_bytes, nbytes - done);
      queued_.push_back({*ticket, buf + done, len, offset + done});
    }
    transfers_[*ticket] = Transfer{write, nbytes, offset, n, Status::OK()};
    FillLocked();
  }
  work_cv_.notify_one();
  return Status::OK();
}

// Moves queued requests into free ring entries and hands them to the kernel.
// Called with mu_ held, by callers and by the reaper; the reaper alone reads the
// completion side, so the two sides of the ring are each used by one thread at a time.
void AioFile::FillLocked() {
  while (broken_.ok() && !queued_.empty() && !free_slots_.empty()) {
    Request q = queued_.front();
    queued_.pop_front();
    Transfer& t = transfers_.at(q.ticket);
    if (!t.status.ok()) {  // an earlier request of it failed: drop the rest
      ResolveLocked(t, Status::OK());
      continue;
    }
    io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
    if (sqe == nullptr) {  // cannot happen: there are as many entries as slots
      queued_.push_front(q);
      break;
    }
    const uint64_t slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot] = q;
    if (t.write)
      io_uring_prep_write(sqe, fd_, q.buf, static_cast<unsigned>(q.len), static_cast<uint64_t>(q.offset));
    else
      io_uring_prep_read(sqe, fd_, q.buf, static_cast<unsigned>(q.len), static_cast<uint64_t>(q.offset));
    io_uring_sqe_set_data64(sqe, slot);
    unsent_.push_back(slot);
  }
  SubmitLocked();
}

// The kernel takes prepared entries in order; what it leaves (EAGAIN, EBUSY) the
// reaper sends again. Any other failure means the ring cannot be used: the
// entries not taken fail now, those already taken complete as usual.
void AioFile::SubmitLocked() {
  if (unsent_.empty() || !broken_.ok()) return;
  int r;
  do {
    r = io_uring_submit(ring_.get());
  } while (r == -EINTR);
  if (r >= 0) {
    for (int i = 0; i < r && !unsent_.empty(); ++i, ++in_kernel_) unsent_.pop_front();
    return;
  }
  if (r == -EAGAIN || r == -EBUSY) return;
  broken_ = Status::Error("Submitting I/O for '" + path_ + "' failed: " + ErrnoText(-r));
  while (!unsent_.empty()) {
    const uint64_t slot = unsent_.front();
    unsent_.pop_front();
    Transfer& t = transfers_.at(slots_[slot].ticket);
    free_slots_.push_back(slot);
    ResolveLocked(t, broken_);
  }
  while (!queued_.empty()) {
    ResolveLocked(transfers_.at(queued_.front().ticket), broken_);
    queued_.pop_front();
  }
}

void AioFile::ResolveLocked(Transfer& t, const Status& s) {
  if (t.status.ok() && !s.ok()) t.status = s;
  if (--t.unresolved == 0) done_cv_.notify_all();
}

Status AioFile::RequestError(const Transfer& t, const Request& q, const std::string& what) const {
  return Status::Error(std::string(t.write ? "Writing " : "Reading ") + std::to_string(q.len) + " bytes at offset " +
                       std::to_string(q.offset) + " of '" + path_ + "' failed: " + what);
}

void AioFile::CompleteLocked(uint64_t slot, int res) {
  Request q = slots_[slot];
  free_slots_.push_back(slot);
  --in_kernel_;
  Transfer& t = transfers_.at(q.ticket);
  if (res == -EINTR || res == -EAGAIN) {  // not done at all: send it again
    queued_.push_front(q);
    return;
  }
  if (res < 0) return ResolveLocked(t, RequestError(t, q, ErrnoText(-res)));
  if (res == 0)
    return ResolveLocked(t, RequestError(t, q, t.write ? "nothing was written" : "the file ends there"));
  (t.write ? bytes_written_ : bytes_read_) += res;
  if (res < q.len) {  // short: continue from where it stopped
    if (res % alignment_ != 0)
      return ResolveLocked(t, RequestError(t, q, "the kernel moved " + std::to_string(res) +
                                                     " bytes, not a multiple of the alignment, so the rest cannot follow"));
    q.buf += res;
    q.offset += res;
    q.len -= res;
    queued_.push_front(q);
    return;
  }
  ResolveLocked(t, Status::OK());
}

// [Note: the reaper]
// The reaper waits for completions only while the kernel holds requests, so an
// idle file costs no wake-ups and Close() needs no message through the ring.
// Completions free entries, which it refills from the queue at once: a transfer
// keeps `queue_depth` requests in the kernel while its caller is busy elsewhere.
void AioFile::Reap() {
  std::unique_lock<std::mutex> l(mu_);
  while (true) {
    if (in_kernel_ == 0) {
      if (closed_) return;
      if (!unsent_.empty() && broken_.ok()) {  // the kernel said "again later"
        work_cv_.wait_for(l, std::chrono::milliseconds(1));
        SubmitLocked();
      } else {
        work_cv_.wait(l);
      }
      continue;
    }
    l.unlock();
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqe(ring_.get(), &cqe);
    l.lock();
    if (r < 0) {
      // Interrupted, or the kernel was briefly short of resources: wait again.
      l.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(r == -EINTR ? 0 : 1));
      l.lock();
      continue;
    }
    unsigned head, n = 0;
    io_uring_for_each_cqe(ring_.get(), head, cqe) {
      CompleteLocked(io_uring_cqe_get_data64(cqe), cqe->res);
      ++n;
    }
    io_uring_cq_advance(ring_.get(), n);
    FillLocked();
    if (queued_.empty() && unsent_.empty() && in_kernel_ == 0) done_cv_.notify_all();
  }
}

Status AioFile::WaitUntil(int64_t ticket, std::chrono::steady_clock::time_point deadline, bool* done) {
  std::unique_lock<std::mutex> l(mu_);
  auto it = transfers_.find(ticket);
  if (it == transfers_.end())
    return Status::InvalidArgument("No transfer with ticket " + std::to_string(ticket) + " on '" + path_ +
                                   "' (never started, or already waited for).");
  Transfer& t = it->second;  // references survive rehashing
  *done = done_cv_.wait_until(l, deadline, [&] { return t.unresolved == 0; });
  if (!*done) return Status::OK();
  Status s = t.status;
  transfers_.erase(ticket);
  return s;
}

Status AioFile::Wait(int64_t ticket) {
  bool done = false;
  while (true) {  // in slices: a far deadline overflows some clocks' conversions
    Status s = WaitUntil(ticket, std::chrono::steady_clock::now() + std::chrono::hours(1), &done);
    if (done || !s.ok()) return s;
  }
}

}  // namespace hvdz
