#include "common/logging.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace hvdz {

namespace {
const char* const kWords[] = {"trace", "debug", "info", "warning", "error", "fatal"};
}  // namespace

bool ParseLogLevel(const std::string& s, LogLevel* out) {
  std::string l = s;
  std::transform(l.begin(), l.end(), l.begin(), ::tolower);
  for (int i = 0; i < 6; ++i) {
    if (l == kWords[i]) {
      *out = static_cast<LogLevel>(i);
      return true;
    }
  }
  return false;
}

const char* LogLevelName(LogLevel l) { return kWords[static_cast<int>(l)]; }

void Logger::Write(LogLevel l, const char* file, int line, const std::string& msg) const {
  static const char* kNames[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"};
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "[horovod_zero %s rank %d %s:%d] %s\n", kNames[static_cast<int>(l)], rank_,
               base, line, msg.c_str());
}

}  // namespace hvdz
