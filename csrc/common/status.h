// Status: the one way failures travel through the core. Nothing is thrown across
// the background thread; the binding edge turns a Status into a Python exception.
#pragma once

#include <string>
#include <utility>

namespace hvdz {

enum class StatusType {
  kOk,
  kUnknownError,
  kInvalidArgument,    // the caller passed something wrong; fixable at the call
  kPreconditionError,  // ranks disagree, or the runtime is not in a usable state
  kAborted,            // shut down, stalled past the deadline, or a peer died
};

class Status {
 public:
  Status() = default;
  static Status OK() { return Status(); }
  static Status Error(std::string r) { return Status(StatusType::kUnknownError, std::move(r)); }
  static Status InvalidArgument(std::string r) {
    return Status(StatusType::kInvalidArgument, std::move(r));
  }
  static Status PreconditionError(std::string r) {
    return Status(StatusType::kPreconditionError, std::move(r));
  }
  static Status Aborted(std::string r) { return Status(StatusType::kAborted, std::move(r)); }

  bool ok() const { return type_ == StatusType::kOk; }
  StatusType type() const { return type_; }
  const std::string& reason() const { return reason_; }

 private:
  Status(StatusType t, std::string r) : type_(t), reason_(std::move(r)) {}
  StatusType type_ = StatusType::kOk;
  std::string reason_;
};

#define HVDZ_RETURN_IF_ERROR(expr)       \
  do {                                   \
    ::hvdz::Status _hvdz_s = (expr);     \
    if (!_hvdz_s.ok()) return _hvdz_s;   \
  } while (0)

}  // namespace hvdz
