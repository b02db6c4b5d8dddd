#include "autotune/tuned_values.h"

#include <cstring>

namespace hvdz {
namespace {

// Fixed layout, native byte order: every rank of a job runs the same build.
struct Wire {
  int64_t fusion_threshold_bytes;
  double cycle_time_ms;
  int64_t zero_bucket_bytes;
  int32_t zero_prefetch;
  int32_t tuning;
};

}  // namespace

TunedValues StartingValues(const Params& p) {
  TunedValues v;
  v.fusion_threshold_bytes = p.fusion_threshold_bytes;
  v.cycle_time_ms = p.cycle_time_ms;
  v.zero_bucket_bytes = p.zero_bucket_bytes;
  v.zero_prefetch = p.zero_prefetch;
  v.tuning = p.autotune;
  return v;
}

bool SameSettings(const TunedValues& a, const TunedValues& b) {
  return a.fusion_threshold_bytes == b.fusion_threshold_bytes && a.cycle_time_ms == b.cycle_time_ms &&
         a.zero_bucket_bytes == b.zero_bucket_bytes && a.zero_prefetch == b.zero_prefetch;
}

std::vector<uint8_t> EncodeTuned(const TunedValues& v) {
  const Wire w{v.fusion_threshold_bytes, v.cycle_time_ms, v.zero_bucket_bytes, v.zero_prefetch, v.tuning ? 1 : 0};
  std::vector<uint8_t> out(sizeof(w));
  std::memcpy(out.data(), &w, sizeof(w));
  return out;
}

bool DecodeTuned(const std::vector<uint8_t>& bytes, TunedValues* v) {
  Wire w;
  if (bytes.size() != sizeof(w)) return false;
  std::memcpy(&w, bytes.data(), sizeof(w));
  *v = TunedValues{w.fusion_threshold_bytes, w.cycle_time_ms, w.zero_bucket_bytes, w.zero_prefetch, w.tuning != 0};
  return true;
}

void TunedHistory::Append(const TunedValues& v) {
  std::lock_guard<std::mutex> lk(mu_);
  values_.push_back(v);
}

TunedValues TunedHistory::Latest(int64_t* generation) const {
  std::lock_guard<std::mutex> lk(mu_);
  *generation = static_cast<int64_t>(values_.size()) - 1;
  return values_.back();
}

bool TunedHistory::At(int64_t generation, TunedValues* out) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (generation < 0 || generation >= static_cast<int64_t>(values_.size())) return false;
  *out = values_[generation];
  return true;
}

}  // namespace hvdz
