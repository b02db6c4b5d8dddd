#include "common/logging.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace hvdz {

LogLevel ParseLogLevel(const std::string& s) {
  std::string l = s;
  std::transform(l.begin(), l.end(), l.begin(), ::tolower);
  if (l == "trace") return LogLevel::kTrace;
  if (l == "debug") return LogLevel::kDebug;
  if (l == "info") return LogLevel::kInfo;
  if (l == "error") return LogLevel::kError;
  if (l == "fatal") return LogLevel::kFatal;
  return LogLevel::kWarning;
}

void Logger::Write(LogLevel l, const char* file, int line, const std::string& msg) const {
  static const char* kNames[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"};
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "[horovod_zero %s rank %d %s:%d] %s\n", kNames[static_cast<int>(l)], rank_,
               base, line, msg.c_str());
}

}  // namespace hvdz
