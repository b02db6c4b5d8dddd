"""HOROVOD_* settings: read and validated in one place (horovod_zero/settings.py),
a bad value refused at hvd.init() naming the variable, the value and what it
accepts, and good values reaching the runtime and the ZeRO optimizer."""

import os
import re

import pytest
import torch

import horovod_zero.torch as hvd
from horovod_zero import settings
from horovod_zero.torch.zero.config import ZeroConfig
from harness import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (variable, bad value, a phrase of what it accepts)
BAD = [
    ("HOROVOD_CYCLE_TIME", "-1", "a number from 0.01 to 100"),
    ("HOROVOD_CYCLE_TIME", "0", "a number from 0.01 to 100"),
    ("HOROVOD_CYCLE_TIME", "nan", "a number from 0.01 to 100"),
    ("HOROVOD_FUSION_THRESHOLD", "-5", "an integer >= 0"),
    ("HOROVOD_FUSION_THRESHOLD", "64MB", "an integer >= 0"),
    ("HOROVOD_CACHE_CAPACITY", "1.5", "an integer from 0 to 1048576"),
    ("HOROVOD_LOG_LEVEL", "verbose", "one of trace, debug, info, warning, error, fatal"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "soon", "a number >= 0"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-1", "a number >= 0"),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "thirty", "a number from 1 to 86400"),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "inf", "a number from 1 to 86400"),
    ("HOROVOD_ZERO_DIRECT_MAX_TENSORS", "-2", "an integer >= -1"),
    ("HOROVOD_ZERO_COPY_STREAM_BYTES", "8M", "an integer >= 0"),
    ("HOROVOD_GLOO_IFACE", "no_such_if0", "a network interface of this host"),
    ("HOROVOD_ZERO_SHM_CONTROL", "yes", "1 or 0"),
    ("HOROVOD_ZERO_BUCKET_BYTES", "32MiB", "an integer >= 0"),
    ("HOROVOD_ZERO_DOWNCAST", "2", "1 or 0"),
    ("HOROVOD_ZERO_INIT_CHUNK_BYTES", "0", "an integer >= 1"),
    ("HOROVOD_ZERO_PREFETCH", "-1", "an integer >= 0"),
    ("HOROVOD_ZERO_FUSED_STEP", "maybe", "1 or 0"),
    ("HOROVOD_ZERO_EXACT_GRADIENTS", "2", "1 or 0"),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "yes", "1 or 0"),
    ("HOROVOD_ZERO_CE_ALLGATHER_BYTES", "-1", "an integer >= 0"),
]


def _message_names(msg, name, value, accepts):
    return f"{name}={value!r}" in msg and accepts in msg


@pytest.mark.parametrize("name,value,accepts", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_bad_value_is_refused_at_init_naming_variable_value_and_range(monkeypatch, name, value, accepts):
    for k in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        hvd.init()
    assert _message_names(str(e.value), name, value, accepts), str(e.value)
    assert not hvd.is_initialized()


def test_every_bad_variable_is_named_in_one_error():
    env = {"HOROVOD_CYCLE_TIME": "-1", "HOROVOD_LOG_LEVEL": "loud", "HOROVOD_ZERO_BUCKET_BYTES": "x"}
    with pytest.raises(ValueError) as e:
        settings.read(env)
    for name, value in env.items():
        assert f"{name}={value!r}" in str(e.value)


def test_the_copy_engine_window_is_refused_in_an_elastic_job():
    with pytest.raises(ValueError, match="HOROVOD_ZERO_CE_ALLGATHER_BYTES cannot be used in an elastic job"):
        settings.read({"HOROVOD_ELASTIC": "1", "HOROVOD_ZERO_CE_ALLGATHER_BYTES": "134217728"})
    assert settings.read({"HOROVOD_ZERO_CE_ALLGATHER_BYTES": "134217728"}).ce_allgather_bytes == 134217728
    assert settings.read({"HOROVOD_ELASTIC": "1"}).ce_allgather_bytes == 0


def test_the_gather_stream_takes_the_copy_engine_window():
    both = settings.read({"HOROVOD_ZERO_GATHER_STREAM": "1", "HOROVOD_ZERO_CE_ALLGATHER_BYTES": "134217728"})
    assert both.gather_stream is True and both.ce_allgather_bytes == 134217728
    assert settings.read({"HOROVOD_ZERO_GATHER_STREAM": "1"}).gather_stream is True
    assert settings.read({}).gather_stream is False


@pytest.mark.parametrize("nccl", ["NCCL_WIN_ENABLE=0", "NCCL_CUMEM_ENABLE=0", "NCCL_CTA_POLICY=1"])
def test_the_copy_engine_window_is_refused_where_nccl_settings_turn_it_off(nccl):
    k, v = nccl.split("=")
    with pytest.raises(ValueError, match=f"{nccl} turn off or override: unset it"):
        settings.read({"HOROVOD_ZERO_CE_ALLGATHER_BYTES": "134217728", k: v})
    assert settings.read({k: v}).ce_allgather_bytes == 0  # no window asked for: NCCL's business


def test_defaults_and_accepted_spellings():
    s = settings.read({})
    assert (s.fusion_threshold_bytes, s.cycle_time_ms, s.cache_capacity, s.log_level) == (128 << 20, 1.0, 1024, "warning")
    assert s.shm_control and not s.exact_gradients
    assert settings.read_section("zero", {}) == dict(bucket_bytes=32 << 20, downcast=True, init_chunk_bytes=None,
                                                     prefetch=1, fused_step=True, step_chunk_bytes=256 << 20,
                                                     master_adam=True)
    # horovodrun --log-level passes upper case; empty means unset, as in Horovod.
    s = settings.read({"HOROVOD_LOG_LEVEL": "DEBUG", "HOROVOD_ZERO_SHM_CONTROL": "0", "HOROVOD_CYCLE_TIME": "",
                       "HOROVOD_FUSION_THRESHOLD": " 0 "})
    assert (s.log_level, s.shm_control, s.cycle_time_ms, s.fusion_threshold_bytes) == ("debug", False, 1.0, 0)
    # Horovod's HOROVOD_TIMELINE=DYNAMIC: no file until hvd.start_timeline().
    s = settings.read({"HOROVOD_TIMELINE": "DYNAMIC", "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert (s.timeline_path, s.timeline_mark_cycles) == ("", True)


def test_the_core_params_object_refuses_an_unknown_log_level():
    p = hvd.basics._core.Params()
    p.log_level = "TRACE"
    assert p.log_level == "trace"
    with pytest.raises(ValueError, match="loud"):
        p.log_level = "loud"


GOOD = {
    "HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_CACHE_CAPACITY": "7",
    "HOROVOD_LOG_LEVEL": "ERROR", "HOROVOD_STALL_CHECK_TIME_SECONDS": "9", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "99",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "45", "HOROVOD_ZERO_DIRECT_MAX_TENSORS": "3",
    "HOROVOD_ZERO_COPY_STREAM_BYTES": "4096", "HOROVOD_ZERO_SHM_CONTROL": "0", "HOROVOD_ZERO_BUCKET_BYTES": "1000",
    "HOROVOD_ZERO_DOWNCAST": "0", "HOROVOD_ZERO_INIT_CHUNK_BYTES": "4096", "HOROVOD_ZERO_PREFETCH": "2",
    "HOROVOD_ZERO_FUSED_STEP": "0", "HOROVOD_ZERO_STEP_CHUNK_BYTES": "8192", "HOROVOD_ZERO_MASTER_ADAM": "0",
}


def _good_values():
    hvd.init()
    info = hvd.runtime_info()
    model = torch.nn.Linear(4, 4)
    opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    zero = opt.config
    hvd.shutdown()
    return info, zero


def test_good_values_reach_the_runtime_and_the_zero_optimizer():
    res = launch(_good_values, 2, env=GOOD, timeout=120)
    assert sorted(res) == [0, 1], res
    for status, value in res.values():
        assert status == "ok", value
        info, zero = value
        assert info["fusion_threshold"] == 1 << 20 and info["cycle_time_ms"] == 2.5 and info["cache_capacity"] == 7
        assert info["log_level"] == "error" and info["stall_check_seconds"] == 9
        assert info["stall_shutdown_seconds"] == 99 and info["gloo_timeout_seconds"] == 45
        assert info["direct_max_tensors"] == 3 and info["copy_stream_bytes"] == 4096
        assert info["control_plane"] == "gloo"  # HOROVOD_ZERO_SHM_CONTROL=0
        assert zero == ZeroConfig(bucket_bytes=1000, downcast=False, init_chunk_bytes=4096, prefetch=2,
                                  fused_step=False, step_chunk_bytes=8192, master_adam=False)


def _zero_bad_after_init():
    hvd.init()
    os.environ["HOROVOD_ZERO_BUCKET_BYTES"] = "lots"
    try:
        model = torch.nn.Linear(4, 4)
        hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        return None
    except ValueError as e:
        return str(e)
    finally:
        hvd.shutdown()


def test_zero_settings_are_validated_when_the_optimizer_is_built():
    res = launch(_zero_bad_after_init, 1, timeout=60)
    status, msg = res[0]
    assert status == "ok" and msg and "HOROVOD_ZERO_BUCKET_BYTES='lots'" in msg and "an integer >= 0" in msg, res


def _sources(*dirs, exts):
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith(exts):
                    path = os.path.join(base, f)
                    yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def test_the_environment_is_read_in_one_place():
    """The core reads no environment; the package reads HOROVOD_* settings only in
    settings.py (the runner reads the launcher's own variables)."""
    readers = {}
    for path, text in _sources("csrc", "python", exts=(".cc", ".h", ".cu")):
        if re.search(r"\bgetenv\s*\(", text):
            readers[path] = "getenv"
    for path, text in _sources("horovod_zero", exts=(".py",)):
        if re.search(r"os\.environ|os\.getenv", text) and not path.startswith(("horovod_zero/runner/",)) \
                and path != "horovod_zero/settings.py":
            readers[path] = "os.environ"
    assert not readers, f"move these reads into horovod_zero/settings.py: {readers}"
    for v in settings.VARIABLES:
        assert v.name.startswith("HOROVOD_") and v.meaning and v.accepts()
