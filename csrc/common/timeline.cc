#include "common/timeline.h"

#include <cerrno>
#include <cstring>

namespace hvdz {
namespace {

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

}  // namespace

Timeline::~Timeline() { Close(); }

bool Timeline::Open(const std::string& path, int rank, bool mark_cycles) {
  std::lock_guard<std::mutex> lk(mu_);
  rank_ = rank;
  mark_cycles_ = mark_cycles;
  if (path.empty()) return true;
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  Begin(f, path);
  return true;
}

void Timeline::Begin(std::FILE* f, const std::string& path) {
  file_ = f;
  path_ = path;
  first_ = true;
  tracks_.clear();  // each file names its own tracks
  std::fputs("[\n", file_);
}

void Timeline::End() {
  if (!file_) return;
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
  path_.clear();
}

const char* Timeline::Separator() {
  const char* s = first_ ? "" : ",\n";
  first_ = false;
  return s;
}

double Timeline::Micros(Clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - origin_).count();
}

int Timeline::TrackOf(const std::string& tensor) {
  auto it = tracks_.find(tensor);
  if (it != tracks_.end()) return it->second;
  int tid = static_cast<int>(tracks_.size()) + 1;
  tracks_.emplace(tensor, tid);
  std::fprintf(file_, "%s{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}}",
               Separator(), rank_, tid, Escape(tensor).c_str());
  return tid;
}

void Timeline::Span(const std::string& tensor, const char* phase, Clock::time_point start,
                    Clock::time_point end, const std::string& args) {
  if (!file_) return;
  int tid = TrackOf(tensor);
  std::fprintf(file_, "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f%s%s%s}",
               Separator(), phase, rank_, tid, Micros(start), Micros(end) - Micros(start),
               args.empty() ? "" : ",\"args\":{", args.c_str(), args.empty() ? "" : "}");
}

void Timeline::RankReady(const std::string& tensor, int rank) {
  if (!file_) return;
  int tid = TrackOf(tensor);
  std::fprintf(file_, "%s{\"name\":\"%d\",\"ph\":\"i\",\"s\":\"t\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f}", Separator(),
               rank, rank_, tid, Micros(Clock::now()));
}

// An instant event across the whole trace ("s":"g"), as Horovod marks cycles.
void Timeline::Marker(const char* name) {
  std::fprintf(file_, "%s{\"name\":\"%s\",\"ph\":\"i\",\"s\":\"g\",\"pid\":%d,\"tid\":0,\"ts\":%.3f}", Separator(),
               name, rank_, Micros(Clock::now()));
}

Status Timeline::Switch(const std::string& path, bool mark_cycles, const std::function<void()>& wake,
                        Clock::duration timeout) {
  std::lock_guard<std::mutex> one(switch_mu_);
  bool same;
  {
    std::lock_guard<std::mutex> lk(mu_);
    same = path == path_;  // reopening the file in use would truncate it
  }
  std::FILE* f = nullptr;
  if (!same && !path.empty()) {
    f = std::fopen(path.c_str(), "w");
    if (f == nullptr)
      return Status::InvalidArgument("Cannot open the timeline file '" + path + "': " + std::strerror(errno) +
                                     ". Pass a path in a directory this process can write to.");
  }
  std::unique_lock<std::mutex> lk(mu_);
  next_file_ = f;
  next_path_ = path;
  next_mark_cycles_ = mark_cycles;
  pending_.store(true, std::memory_order_release);
  if (orphaned_) {
    ApplyLocked();
    return Status::OK();
  }
  lk.unlock();
  wake();
  lk.lock();
  if (applied_.wait_for(lk, timeout, [this] { return !pending_.load(std::memory_order_acquire); }))
    return Status::OK();
  pending_.store(false, std::memory_order_release);  // withdrawn: nothing changed
  if (next_file_ != nullptr) std::fclose(next_file_);
  next_file_ = nullptr;
  return Status::Aborted("The timeline was not " + std::string(path.empty() ? "stopped" : "started") + " within " +
                         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(timeout).count()) +
                         " s: the background thread did not begin a cycle (it waits on the other ranks). "
                         "Nothing changed; call it again once the other ranks run.");
}

void Timeline::Apply() {
  std::lock_guard<std::mutex> lk(mu_);
  ApplyLocked();
}

void Timeline::ApplyLocked() {
  if (!pending_.load(std::memory_order_acquire)) return;
  if (next_path_ != path_) {
    End();  // the old file complete
    if (next_file_ != nullptr) Begin(next_file_, next_path_);
  }
  next_file_ = nullptr;
  mark_cycles_ = next_mark_cycles_;
  pending_.store(false, std::memory_order_release);
  applied_.notify_all();
}

void Timeline::Orphan() {
  std::lock_guard<std::mutex> lk(mu_);
  ApplyLocked();
  orphaned_ = true;
}

void Timeline::Close() {
  std::lock_guard<std::mutex> lk(mu_);
  End();
  orphaned_ = true;
}

}  // namespace hvdz
