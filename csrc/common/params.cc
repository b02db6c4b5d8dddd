#include "common/params.h"

#include <cstdlib>
#include <functional>
#include <stdexcept>

namespace hvdz {
namespace {

// Applies `parse` to the variable's value when it is set and non-empty.
void Read(const char* name, std::string* warnings, const std::function<void(const std::string&)>& parse) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return;
  try {
    parse(v);
  } catch (const std::exception&) {
    *warnings += std::string(name) + "='" + v + "' does not parse; using the default. ";
  }
}

}  // namespace

Params Params::FromEnvironment(std::string* warnings) {
  Params p;
  Read("HOROVOD_FUSION_THRESHOLD", warnings, [&](const std::string& s) { p.fusion_threshold_bytes = std::stoll(s); });
  Read("HOROVOD_CYCLE_TIME", warnings, [&](const std::string& s) { p.cycle_time_ms = std::stod(s); });
  Read("HOROVOD_CACHE_CAPACITY", warnings, [&](const std::string& s) { p.cache_capacity = std::stoi(s); });
  Read("HOROVOD_TIMELINE", warnings, [&](const std::string& s) { p.timeline_path = s; });
  Read("HOROVOD_LOG_LEVEL", warnings, [&](const std::string& s) { p.log_level = ParseLogLevel(s); });
  Read("HOROVOD_STALL_CHECK_TIME_SECONDS", warnings,
       [&](const std::string& s) { p.stall_check_seconds = std::stod(s); });
  Read("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", warnings,
       [&](const std::string& s) { p.stall_shutdown_seconds = std::stod(s); });
  Read("HOROVOD_GLOO_TIMEOUT_SECONDS", warnings,
       [&](const std::string& s) { p.transport_timeout_seconds = std::stod(s); });
  Read("HOROVOD_ZERO_DIRECT_MAX_TENSORS", warnings,
       [&](const std::string& s) { p.direct_max_tensors = std::stoi(s); });
  Read("HOROVOD_ZERO_COPY_STREAM_BYTES", warnings,
       [&](const std::string& s) { p.copy_stream_bytes = std::stoll(s); });
  if (p.fusion_threshold_bytes < 0) p.fusion_threshold_bytes = 0;
  if (p.cache_capacity < 0) p.cache_capacity = 0;
  if (p.cycle_time_ms < 0) p.cycle_time_ms = 0;
  return p;
}

}  // namespace hvdz
