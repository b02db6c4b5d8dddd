// The runtime's side of HOROVOD_AUTOTUNE: see [Note: autotuning] in autotune/autotuner.h.
#include "runtime/runtime.h"

namespace hvdz {

void Runtime::UseZeroKnobs(bool bucket, bool prefetch) {
  if (tuner_) tuner_->UseZero(bucket, prefetch);
}

// Every rank runs this in the same global cycle, before that cycle's responses are
// fused: the fusion groups stay identical on every rank.
void Runtime::ApplyAnnouncement(const CycleResult& g) {
  TunedValues v;
  if (!tuned_ || !DecodeTuned(g.announcement, &v)) {
    HVDZ_LOG(logger_, kError) << "Ignoring a malformed autotuning announcement of " << g.announcement.size()
                              << " bytes (is HOROVOD_AUTOTUNE set alike on every rank?)";
    return;
  }
  fusion_threshold_bytes_ = v.fusion_threshold_bytes;
  cycle_time_ms_ = v.cycle_time_ms;
  tuned_->Append(v);
  if (tuner_) tuner_->InForce(v, Clock::now());
  HVDZ_LOG(logger_, kDebug) << "Autotuner: now HOROVOD_FUSION_THRESHOLD=" << v.fusion_threshold_bytes
                            << " HOROVOD_CYCLE_TIME=" << v.cycle_time_ms
                            << " HOROVOD_ZERO_BUCKET_BYTES=" << v.zero_bucket_bytes
                            << " HOROVOD_ZERO_PREFETCH=" << v.zero_prefetch << (v.tuning ? "" : " (final)");
}

void Runtime::ObserveWork(const ProcessSet& ps, const CycleResult& result) {
  if (tuner_ && tuner_->observing() && !result.responses.empty()) tuner_->Observe(ps.id(), result.responses);
}

void Runtime::TuneAfterCycle(Clock::time_point start) {
  TunedValues next;
  if (tuner_->EndCycle(start, &next)) global().controller().Announce(EncodeTuned(next));
}

}  // namespace hvdz
