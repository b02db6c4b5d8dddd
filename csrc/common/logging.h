// Logger owned by the Runtime (no process-wide logger): each line carries the
// rank, the level and the file:line where it was written.
#pragma once

#include <sstream>
#include <string>

namespace hvdz {

enum class LogLevel { kTrace = 0, kDebug, kInfo, kWarning, kError, kFatal };

// HOROVOD_LOG_LEVEL's words (trace, debug, info, warning, error, fatal), any case;
// false for any other word.
bool ParseLogLevel(const std::string& s, LogLevel* out);
const char* LogLevelName(LogLevel l);  // lower case, as ParseLogLevel takes it

class Logger {
 public:
  explicit Logger(LogLevel level = LogLevel::kWarning, int rank = -1) : level_(level), rank_(rank) {}
  bool Enabled(LogLevel l) const { return l >= level_; }
  void Write(LogLevel l, const char* file, int line, const std::string& msg) const;
  void set_rank(int r) { rank_ = r; }

 private:
  LogLevel level_;
  int rank_;
};

// Collects one line and writes it when the statement ends.
class LogLine {
 public:
  LogLine(const Logger& lg, LogLevel l, const char* file, int line)
      : lg_(lg), level_(l), file_(file), line_(line) {}
  ~LogLine() { lg_.Write(level_, file_, line_, os_.str()); }
  std::ostringstream& stream() { return os_; }

 private:
  const Logger& lg_;
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream os_;
};

// "'a', 'b', 'c' and 5 more": the names of `items` (name(item) for each) for a log
// line, at most `max` of them, so one line stays short however big the batch.
template <typename Items, typename Name>
std::string NameList(const Items& items, Name name, size_t max = 8) {
  std::ostringstream os;
  size_t n = 0;
  for (const auto& it : items) {
    if (n == max) break;
    os << (n++ ? ", '" : "'") << name(it) << "'";
  }
  if (items.size() > max) os << " and " << items.size() - max << " more";
  return os.str();
}

#define HVDZ_LOG(logger, LEVEL)                                  \
  if (!(logger).Enabled(::hvdz::LogLevel::LEVEL)) {              \
  } else                                                         \
    ::hvdz::LogLine((logger), ::hvdz::LogLevel::LEVEL, __FILE__, __LINE__).stream()

}  // namespace hvdz
