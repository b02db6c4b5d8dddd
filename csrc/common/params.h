// Every HOROVOD_* setting the core uses, with its default. horovod_zero/settings.py
// reads and validates the environment (one table for the whole package) and fills
// this at init(); the core reads no environment, and C++ tests set fields directly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/logging.h"

namespace hvdz {

struct Params {
  int64_t fusion_threshold_bytes = 128ll * 1024 * 1024;  // HOROVOD_FUSION_THRESHOLD; 0: no fusion
  double cycle_time_ms = 1.0;                            // HOROVOD_CYCLE_TIME
  int cache_capacity = 1024;                             // HOROVOD_CACHE_CAPACITY; 0: no cache
  std::string timeline_path;                             // HOROVOD_TIMELINE; empty: none yet
  bool timeline_mark_cycles = false;                     // HOROVOD_TIMELINE_MARK_CYCLES
  LogLevel log_level = LogLevel::kWarning;               // HOROVOD_LOG_LEVEL
  double stall_check_seconds = 60.0;                     // HOROVOD_STALL_CHECK_TIME_SECONDS
  double stall_shutdown_seconds = 0.0;                   // HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
  double transport_timeout_seconds = 30.0;               // HOROVOD_GLOO_TIMEOUT_SECONDS
  int direct_max_tensors = -1;  // HOROVOD_ZERO_DIRECT_MAX_TENSORS; 0: never; -1: by world size (ops/plan_direct.cc)
  int64_t copy_stream_bytes = 8ll * 1024 * 1024;         // HOROVOD_ZERO_COPY_STREAM_BYTES; 0: never
  // HOROVOD_ZERO_CE_ALLGATHER_BYTES: each NCCL communicator's symmetric window for
  // copy-engine allgathers, see [Note: copy-engine allgather]; 0: none.
  int64_t ce_allgather_bytes = 0;
  // HOROVOD_ZERO_GATHER_STREAM: CUDA allgathers on a communicator and stream of their
  // own, beside the other collectives; see [Note: the gather lane] in ops/cuda_context.h.
  bool gather_stream = false;
  // HOROVOD_THREAD_AFFINITY: this local rank's CPUs for the runtime's own threads;
  // empty: where the scheduler puts them. See [Note: the runtime's threads off the
  // training threads' CPUs] in common/thread_affinity.h.
  std::vector<int> thread_cpus;

  // Autotuning (autotune/autotuner.h), Horovod's variables and one of ours.
  bool autotune = false;               // HOROVOD_AUTOTUNE
  std::string autotune_log;            // HOROVOD_AUTOTUNE_LOG: rank 0 writes its samples there
  int autotune_warmup_samples = 3;     // HOROVOD_AUTOTUNE_WARMUP_SAMPLES
  int autotune_steps_per_sample = 10;  // HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE
  int autotune_max_samples = 20;       // HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES
  double autotune_noise = 0.8;         // HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE
  int autotune_confirm_rounds = 3;     // HOROVOD_AUTOTUNE_CONFIRM_ROUNDS (ours): the best against the start
  // The ZeRO optimizer's settings at init() (HOROVOD_ZERO_BUCKET_BYTES, HOROVOD_ZERO_PREFETCH):
  // the tuner starts from them; Python reads them itself.
  int64_t zero_bucket_bytes = 32ll * 1024 * 1024;
  int zero_prefetch = 1;
  // Settings the user set explicitly, which the tuner leaves alone, as Horovod does.
  bool fixed_fusion_threshold = false;
  bool fixed_cycle_time = false;
  bool fixed_zero_bucket = false;
  bool fixed_zero_prefetch = false;
};

}  // namespace hvdz
