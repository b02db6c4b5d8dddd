// The settings the autotuner changes while the job runs, as rank 0 announces them
// to every rank, and the record of every announcement by generation.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "common/params.h"

namespace hvdz {

struct TunedValues {
  int64_t fusion_threshold_bytes = 0;  // HOROVOD_FUSION_THRESHOLD
  double cycle_time_ms = 0;            // HOROVOD_CYCLE_TIME
  int64_t zero_bucket_bytes = 0;       // HOROVOD_ZERO_BUCKET_BYTES
  int32_t zero_prefetch = 0;           // HOROVOD_ZERO_PREFETCH
  // True while samples are being taken; false once the tuning has ended: these are
  // then the values kept for the rest of the job.
  bool tuning = true;
};

// Whether a and b are the same four settings (the tuning flag aside).
bool SameSettings(const TunedValues& a, const TunedValues& b);

// The values the job starts with: the settings of init().
TunedValues StartingValues(const Params& p);

std::vector<uint8_t> EncodeTuned(const TunedValues& v);
bool DecodeTuned(const std::vector<uint8_t>& bytes, TunedValues* v);

// Generation 0 is the starting values, generation g the g-th announcement. Every
// rank applies an announcement in the same negotiation cycle, but its framework
// threads read the history whenever they like: the ZeRO optimizer agrees with the
// other ranks on a generation every rank has reached, then looks its values up
// here ([Note: tuned ZeRO settings] in horovod_zero/torch/zero/core/tuning.py).
// Appended by the background thread, read from any thread.
class TunedHistory {
 public:
  explicit TunedHistory(const TunedValues& start) : values_{start} {}
  void Append(const TunedValues& v);
  // The newest values; *generation gets theirs.
  TunedValues Latest(int64_t* generation) const;
  // False when `generation` has not been reached on this rank.
  bool At(int64_t generation, TunedValues* out) const;

 private:
  mutable std::mutex mu_;
  std::vector<TunedValues> values_;
};

}  // namespace hvdz
