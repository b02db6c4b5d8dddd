#include "negotiation/shm_control_plane.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

namespace hvdz {
namespace {

// Layout: one line per rank (its sequence counter, then its pid), one line for the
// wake-up words (see [Note: sleeping in a round]), then the slots.
constexpr size_t kLine = 64;
// A slot: total payload length, this round's chunk length, the chunk.
constexpr size_t kSlotHeader = 16;
constexpr size_t kSlotStride = kSlotHeader + ShmControlPlane::kSlotBytes;

size_t SegmentBytes(int size) { return kLine * (size + 1) + 2 * kSlotStride * size; }

// Sleeps while *word == expected, at most `d`; a shared (not process-private) futex,
// so that a FUTEX_WAKE from another process reaches it.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds d) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(d.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(d.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

using SteadyClock = std::chrono::steady_clock;

// Gone, or a zombie its launcher has not reaped yet: either way it will never arrive.
bool ProcessAlive(pid_t pid) {
  if (kill(pid, 0) != 0) return errno != ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  auto close = line.rfind(')');  // the state follows the command name, which may hold spaces
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z';
}

}  // namespace

ShmControlPlane::ShmControlPlane(int rank, int size, double timeout_s, void* base, size_t bytes)
    : rank_(rank), size_(size), timeout_s_(timeout_s), base_(base), bytes_(bytes) {}

ShmControlPlane::~ShmControlPlane() { munmap(base_, bytes_); }

std::atomic<uint64_t>& ShmControlPlane::Seq(int r) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base_) + kLine * r);
}

std::atomic<int64_t>& ShmControlPlane::Pid(int r) {
  return *reinterpret_cast<std::atomic<int64_t>*>(static_cast<char*>(base_) + kLine * r + 8);
}

// A peer whose process is gone will never arrive: say so now rather than at the
// timeout. Only trusted when every peer's pid was visible at attach time (ranks
// in other PID namespaces would look dead).
std::string ShmControlPlane::DeadPeers(uint64_t target) {
  std::string dead;
  if (!pids_visible_) return dead;
  for (int r = 0; r < size_; ++r) {
    if (Seq(r).load(std::memory_order_acquire) >= target) continue;
    if (!ProcessAlive(static_cast<pid_t>(Pid(r).load()))) dead += (dead.empty() ? "" : ", ") + std::to_string(r);
  }
  return dead;
}

std::atomic<uint32_t>& ShmControlPlane::Arrivals() {
  return *reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(base_) + kLine * size_);
}

std::atomic<uint32_t>& ShmControlPlane::Sleepers() {
  return *reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(base_) + kLine * size_ + 4);
}

uint8_t* ShmControlPlane::Slot(int parity, int r) {
  return static_cast<uint8_t*>(base_) + kLine * (size_ + 1) + (parity * size_ + r) * kSlotStride;
}

bool ShmControlPlane::AllReached(uint64_t target) {
  for (int r = 0; r < size_; ++r)
    if (Seq(r).load(std::memory_order_acquire) < target) return false;
  return true;
}

// [Note: sleeping in a round]
// A rank that has work enters the round at once, while its peers may be idle and
// sleeping out a long idle period (runtime.cc); it must wait for them without
// burning a core. Past the first 100 us it sleeps on a futex, and every arrival
// wakes the sleepers. The order makes a lost wake-up impossible: a sleeper counts
// itself in Sleepers, reads Arrivals, checks the counters once more, then sleeps
// only while Arrivals is unchanged; an arriver publishes its counter, bumps
// Arrivals, then wakes if anyone counted itself. (Sequentially consistent, so one
// of the two sees the other.) Arrivers skip the system call when nobody sleeps.
void ShmControlPlane::Sleep(uint64_t target, std::chrono::nanoseconds at_most) {
  Sleepers().fetch_add(1);
  const uint32_t seen = Arrivals().load();
  if (!AllReached(target)) FutexWait(&Arrivals(), seen, at_most);
  Sleepers().fetch_sub(1);
}

Status ShmControlPlane::Create(const std::string& name, int rank, int size, double timeout_s,
                               std::unique_ptr<ShmControlPlane>* out) {
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");
  static_assert(sizeof(std::atomic<uint32_t>) == 4, "the futex word is a plain 32-bit integer");
  const size_t bytes = SegmentBytes(size);
  const auto deadline = SteadyClock::now() + std::chrono::duration<double>(timeout_s);
  int fd = -1;
  if (rank == 0) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      shm_unlink(name.c_str());
      fd = -1;
    }
  } else {
    // Wait for rank 0 to create it at full size.
    while (true) {
      fd = shm_open(name.c_str(), O_RDWR, 0600);
      struct stat st;
      if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= bytes) break;
      if (fd >= 0) close(fd);
      fd = -1;
      if (SteadyClock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (fd < 0) return Status::Error("Cannot open shared memory '" + name + "' for negotiation: " + std::strerror(errno));
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return Status::Error(std::string("mmap of the negotiation segment failed: ") + std::strerror(errno));
  out->reset(new ShmControlPlane(rank, size, timeout_s, base, bytes));
  ShmControlPlane& cp = **out;
  cp.Pid(rank).store(static_cast<int64_t>(getpid()));
  // Everyone attached: the name can go, so nothing is left behind if a rank dies.
  Status s = cp.Arrive();
  if (rank == 0) shm_unlink(name.c_str());
  for (int r = 0; r < size && s.ok(); ++r)
    cp.pids_visible_ = cp.pids_visible_ && kill(static_cast<pid_t>(cp.Pid(r).load()), 0) == 0;
  return s;
}

Status ShmControlPlane::Arrive() {
  const uint64_t target = ++round_;
  Seq(rank_).store(target, std::memory_order_release);
  Arrivals().fetch_add(1);
  if (Sleepers().load() != 0) FutexWakeAll(&Arrivals());
  const auto start = SteadyClock::now();
  auto last_check = start;
  while (true) {
    if (AllReached(target)) return Status::OK();
    // Peers with work arrive within microseconds: spin for them, then yield. Idle
    // peers may sleep out their idle period: sleep until an arrival wakes us, waking
    // every 100 ms to look for dead peers (these phases are bounded by time, not by
    // iterations).
    const auto now = SteadyClock::now();
    const double waited_us = std::chrono::duration<double, std::micro>(now - start).count();
    if (waited_us < 20) continue;
    if (waited_us < 100) {
      sched_yield();
      continue;
    }
    if (now - last_check >= std::chrono::milliseconds(100)) {
      last_check = now;
      HVDZ_RETURN_IF_ERROR(CheckPeers(target, waited_us));
    }
    Sleep(target, last_check + std::chrono::milliseconds(100) - now);
  }
}

// A dead peer, or the timeout, ends the wait with an error naming the missing ranks.
Status ShmControlPlane::CheckPeers(uint64_t target, double waited_us) {
  std::string dead = DeadPeers(target);
  if (!dead.empty())
    return Status::Aborted("ranks [" + dead + "] exited (their processes are gone) before negotiation round " +
                           std::to_string(target) + " (shared-memory control plane)");
  if (waited_us <= timeout_s_ * 1e6) return Status::OK();
  std::ostringstream os;
  os << "ranks [";
  const char* sep = "";
  for (int r = 0; r < size_; ++r)
    if (Seq(r).load(std::memory_order_acquire) < target) {
      os << sep << r;
      sep = ", ";
    }
  os << "] did not reach negotiation round " << target << " within " << static_cast<int>(timeout_s_)
     << " s (shared-memory control plane)";
  return Status::Aborted(os.str());
}

Status ShmControlPlane::Exchange(const uint8_t* data, size_t n, std::vector<std::vector<uint8_t>>* all) {
  all->assign(size_, {});
  size_t offset = 0, longest = 0;
  do {
    uint8_t* slot = Slot(static_cast<int>(round_ % 2), rank_);
    const uint64_t total = n, chunk = offset < n ? std::min(kSlotBytes, n - offset) : 0;
    std::memcpy(slot, &total, 8);
    std::memcpy(slot + 8, &chunk, 8);
    if (chunk) std::memcpy(slot + kSlotHeader, data + offset, chunk);
    const int parity = static_cast<int>(round_ % 2);
    HVDZ_RETURN_IF_ERROR(Arrive());
    for (int r = 0; r < size_; ++r) {
      const uint8_t* s = Slot(parity, r);
      uint64_t t, c;
      std::memcpy(&t, s, 8);
      std::memcpy(&c, s + 8, 8);
      longest = std::max<size_t>(longest, t);
      (*all)[r].insert((*all)[r].end(), s + kSlotHeader, s + kSlotHeader + c);
    }
    offset += kSlotBytes;
  } while (offset < longest);
  return Status::OK();
}

Status ShmControlPlane::Allgather(const std::vector<uint8_t>& mine, std::vector<uint8_t>* all) {
  std::vector<std::vector<uint8_t>> parts;
  HVDZ_RETURN_IF_ERROR(Exchange(mine.data(), mine.size(), &parts));
  all->clear();
  for (auto& p : parts) all->insert(all->end(), p.begin(), p.end());
  return Status::OK();
}

Status ShmControlPlane::Gatherv(const std::vector<uint8_t>& mine, std::vector<std::vector<uint8_t>>* at_root) {
  std::vector<std::vector<uint8_t>> parts;
  HVDZ_RETURN_IF_ERROR(Exchange(mine.data(), mine.size(), &parts));
  if (rank_ == 0) *at_root = std::move(parts);
  return Status::OK();
}

Status ShmControlPlane::Broadcast(std::vector<uint8_t>* buf) {
  std::vector<std::vector<uint8_t>> parts;
  const bool root = rank_ == 0;
  HVDZ_RETURN_IF_ERROR(Exchange(root ? buf->data() : nullptr, root ? buf->size() : 0, &parts));
  *buf = std::move(parts[0]);
  return Status::OK();
}

}  // namespace hvdz
