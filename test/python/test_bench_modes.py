"""examples/bench_zero.py --modes: split at commas, where a setting's value may hold commas
of its own (HOROVOD_THREAD_AFFINITY's entries)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import bench_zero  # noqa: E402


def test_modes_split_at_commas_and_a_value_keeps_its_own():
    assert bench_zero.split_modes("zero2,fsdp2+reshard,zero3@HOROVOD_ZERO_PREFETCH=2") == [
        "zero2", "fsdp2+reshard", "zero3@HOROVOD_ZERO_PREFETCH=2"]
    assert bench_zero.split_modes("zero2,zero2@HOROVOD_THREAD_AFFINITY=8-11,24-27,zero3") == [
        "zero2", "zero2@HOROVOD_THREAD_AFFINITY=8-11,24-27", "zero3"]
    assert bench_zero.split_modes("zero2@HOROVOD_THREAD_AFFINITY=7,15@HOROVOD_ZERO_BUCKET_BYTES=0") == [
        "zero2@HOROVOD_THREAD_AFFINITY=7,15@HOROVOD_ZERO_BUCKET_BYTES=0"]
