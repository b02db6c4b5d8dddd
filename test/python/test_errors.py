"""Bad input is refused at the call; disagreeing, stalled and dead ranks turn into
errors on every rank within their time limits; nothing hangs."""

import os
import re
import time

import pytest
import torch

import horovod_zero.torch as hvd
from harness import launch, shared_pool as pool


def _before_init():
    initialized = hvd.is_initialized()
    msgs = []
    for call in (lambda: hvd.allreduce(torch.ones(2)), hvd.rank):
        try:
            call()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return initialized, msgs


def test_ops_before_init_are_refused():
    # In a fresh process: whether this one was ever initialized depends on what ran before.
    status, (initialized, msgs) = launch(_before_init, 1, timeout=60)[0]
    assert status == "ok"
    assert not initialized
    for msg in msgs:
        assert msg is not None, "accepted before init()"
        assert re.search(r"hvd.init\(\)", msg), msg


def _bad_input():
    msgs = {}
    cases = {
        "dtype": lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64), name="c"),
        "bool": lambda: hvd.allgather(torch.ones(2, dtype=torch.bool), name="b"),
        "noncontiguous": lambda: hvd.allreduce(torch.ones(4, 4).t(), name="nc"),
        "int16_reduce": lambda: hvd.allreduce(torch.ones(2, dtype=torch.int16), name="i16"),
        "scalar_gather": lambda: hvd.allgather(torch.tensor(1.0), name="sg"),
        "bad_root": lambda: hvd.broadcast(torch.ones(2), root_rank=hvd.size(), name="br"),
        "bad_op": lambda: hvd.allreduce(torch.ones(2), op=17, name="bo"),
        "names_length": lambda: hvd.grouped_allreduce([torch.ones(1), torch.ones(1)], name=["only_one"]),
        "not_a_list": lambda: hvd.grouped_allgather(torch.ones(2)),
        # The host and a GPU in one group: the core's refusal, in test/cpp/runtime_test.cc
        # and test/gpu/test_gpu_horovod_api.py; here, a device the core takes no tensors of.
        "meta": lambda: hvd.grouped_allreduce([torch.ones(1), torch.ones(1, device="meta")], name="td"),
        "int_cast": lambda: hvd.allgather(torch.ones(2, dtype=torch.int32), output_dtype=torch.float16, name="ic"),
    }
    for key, call in cases.items():
        try:
            call()
            msgs[key] = None
        except (ValueError, TypeError) as e:
            msgs[key] = str(e)
    # The same name twice in flight: the second submission is refused, the first
    # completes. Rank 1 submits late, so rank 0's first one is surely still in flight.
    if hvd.rank() == 1:
        time.sleep(0.3)
    h = hvd.allreduce_async(torch.ones(2), name="twice")
    try:
        hvd.allreduce_async(torch.ones(2), name="twice")
        msgs["twice"] = None
    except ValueError as e:
        msgs["twice"] = str(e)
    hvd.synchronize(h)
    # Refusals leave nothing behind: the runtime still works for everyone.
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after_bad"), torch.full((2,), float(hvd.size())))
    return msgs


def test_bad_input_is_refused_at_the_call_with_what_to_do():
    per_rank = pool(2).run(_bad_input)
    expect = {
        "dtype": "supported: float32", "bool": "supported: float32", "noncontiguous": "contiguous()",
        "int16_reduce": "tensor.int()", "scalar_gather": "at least one dimension",
        "bad_root": "not a rank", "bad_op": "hvd.Sum", "names_length": "one name per tensor",
        "not_a_list": "list of tensors", "int_cast": "floating-point", "twice": "already in flight",
        "meta": "only CPU and CUDA tensors are supported",
    }
    for rank, msgs in enumerate(per_rank):
        for key, fragment in expect.items():
            if key == "twice" and rank != 0:
                continue  # only rank 0's first submission is surely still in flight (rank 1 is late)
            assert msgs[key] is not None, f"{key} was accepted on rank {rank}"
            assert fragment in msgs[key], (rank, key, msgs[key])


def _mismatch():
    r = hvd.rank()
    results = {}
    cases = {
        "shape": lambda: hvd.allreduce(torch.ones(3 + r), name="m.shape"),
        "dtype": lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64), name="m.dtype"),
        "op": lambda: (hvd.allreduce(torch.ones(3), name="m.op") if r == 0 else hvd.allgather(torch.ones(3), name="m.op")),
        "root": lambda: hvd.broadcast(torch.ones(3), root_rank=r, name="m.root"),
        "gather_dims": lambda: hvd.allgather(torch.ones(2, 2 + r), name="m.gather"),
        "reduce_op": lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if r == 0 else hvd.Max, name="m.reduce_op"),
    }
    for key, call in cases.items():
        t0 = time.monotonic()
        try:
            call()
            results[key] = None
        except hvd.HorovodInternalError as e:
            results[key] = (str(e), time.monotonic() - t0)
    ok = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="m.after")
    return results, ok.tolist()


def test_ranks_that_disagree_all_get_an_error_naming_tensor_and_values():
    out = pool(2).run(_mismatch)
    fragments = {"shape": ("[3]", "[4]"), "dtype": ("float32", "float64"), "op": ("allreduce", "allgather"),
                 "root": ("root rank", "0"), "gather_dims": ("[2]", "[3]"), "reduce_op": ("Sum", "Max")}
    # The tensor's full name, and each rank's value (the roots are the ranks themselves).
    names = {"shape": "m.shape", "dtype": "m.dtype", "op": "m.op", "root": "m.root", "gather_dims": "m.gather",
             "reduce_op": "m.reduce_op"}
    values = {"root": ("has 0", "has 1")}
    assert len(out) == 2
    for results, after in out:
        assert after == [2.0, 2.0], "the runtime must keep working after a mismatch"
        for key, (a, b) in fragments.items():
            assert results[key] is not None, f"{key} mismatch was not detected"
            msg, seconds = results[key]
            assert f"'m." in msg and a in msg and b in msg, (key, msg)
            assert f"'{names[key]}'" in msg, (key, msg)
            assert all(v in msg for v in values.get(key, ())), (key, msg)
            assert seconds < 5


def _list_with_a_failure():
    r = hvd.rank()
    good = [hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name=f"l.good.{i}") for i in range(3)]
    bad = hvd.allreduce_async(torch.ones(3 + r), name="l.bad")
    handles = good[:1] + [bad] + good[1:]
    try:
        hvd.synchronize(handles)
        raised = None
    except hvd.HorovodInternalError as e:
        raised = str(e)
    # Every handle of the list was waited for and released, the good ones too.
    released = []
    for h in good:
        try:
            hvd.synchronize(h)
            released.append(False)
        except ValueError:
            released.append(True)
    return raised, released


def test_a_failed_op_in_a_list_raises_after_every_handle_is_released():
    for raised, released in pool(2).run(_list_with_a_failure):
        assert raised is not None and "'l.bad'" in raised, raised
        assert released == [True, True, True]


def _stalled():
    hvd.init()
    r = hvd.rank()
    out = None
    if r == 0:
        t0 = time.monotonic()
        try:
            hvd.allreduce(torch.ones(2), name="only_rank0")
            out = ("completed", 0)
        except hvd.HorovodInternalError as e:
            out = (str(e), time.monotonic() - t0)
    else:
        time.sleep(3)  # past rank 0's failure at 2 s, so the barrier itself does not stall
    hvd.barrier()
    hvd.shutdown()
    return out


def test_stalled_tensor_fails_after_the_shutdown_time_naming_missing_ranks():
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    res = launch(_stalled, 3, env=env, timeout=60)
    status, value = res[0]
    assert status == "ok", value
    msg, seconds = value
    assert "only_rank0" in msg and "not by ranks [1, 2]" in msg, msg
    assert 1.5 < seconds < 10


def _stall_warning_then_complete():
    hvd.init()
    if hvd.rank() == 1:
        time.sleep(2.5)
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="late").tolist()
    hvd.shutdown()
    return out


def test_stall_warning_names_the_tensor_and_missing_ranks(capfd):
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"}
    res = launch(_stall_warning_then_complete, 2, env=env, timeout=60)
    assert res[0] == ("ok", [2.0, 2.0]) and res[1] == ("ok", [2.0, 2.0]), res
    err = capfd.readouterr().err
    assert "Stalled tensor 'late'" in err and "not by ranks [1]" in err, err


def _dead_peer():
    hvd.init()
    hvd.barrier()
    if hvd.rank() == 1:
        os._exit(3)  # dies without a word
    t0 = time.monotonic()
    try:
        time.sleep(0.5)
        hvd.allreduce(torch.ones(2), name="after_death")
        return ("completed", 0)
    except hvd.HorovodInternalError as e:
        return (str(e), time.monotonic() - t0)


@pytest.mark.parametrize("control", ["shm", "gloo"])
def test_a_dead_peer_fails_pending_ops_long_before_the_timeout(control):
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "30", "HOROVOD_ZERO_SHM_CONTROL": "1" if control == "shm" else "0"}
    res = launch(_dead_peer, 2, env=env, timeout=60)
    assert 1 not in res  # it died
    status, (msg, seconds) = res[0]
    assert status == "ok"
    # Shared memory sees the process gone; Gloo sees its connections close.
    assert ("ranks [1] exited" in msg) if control == "shm" else ("closed" in msg or "reset" in msg), msg
    assert seconds < 10, seconds


def _shutdown_and_reinit():
    hvd.init()
    a = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="gen1").item()
    hvd.shutdown()
    try:
        hvd.allreduce(torch.ones(1))
        refused = False
    except ValueError:
        refused = True
    hvd.init()
    b = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="gen2").item()
    hvd.shutdown()
    return a, refused, b


def test_shutdown_then_init_again():
    res = launch(_shutdown_and_reinit, 2, timeout=60)
    assert res[0] == ("ok", (2.0, True, 2.0)) and res[1] == res[0], res
