#include "common/timeline.h"

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

bool Timeline::Open(const std::string& path, int rank) {
  if (path.empty()) return true;
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) return false;
  rank_ = rank;
  origin_ = Clock::now();
  std::fputs("[\n", file_);
  return true;
}

int Timeline::TrackOf(const std::string& tensor) {
  auto it = tracks_.find(tensor);
  if (it != tracks_.end()) return it->second;
  int tid = static_cast<int>(tracks_.size()) + 1;
  tracks_.emplace(tensor, tid);
  std::fprintf(file_,
               "%s{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}}",
               first_ ? "" : ",\n", rank_, tid, Escape(tensor).c_str());
  first_ = false;
  return tid;
}

void Timeline::Span(const std::string& tensor, const char* phase, Clock::time_point start,
                    Clock::time_point end, const std::string& args) {
  if (!file_) return;
  int tid = TrackOf(tensor);
  auto us = [&](Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - origin_).count();
  };
  std::fprintf(file_, ",\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f%s%s%s}",
               phase, rank_, tid, us(start), us(end) - us(start), args.empty() ? "" : ",\"args\":{",
               args.c_str(), args.empty() ? "" : "}");
}

void Timeline::Close() {
  if (!file_) return;
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

}  // namespace hvdz
