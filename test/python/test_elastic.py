"""hvd.elastic: the state's commit, restore and sync, the run loop's resets, the
ElasticSampler's partition, and whole jobs under horovodrun's elastic driver (a worker
SIGKILLed mid-step, a host added through the discovery script, too few hosts left),
each compared with plain torch training on the same batches."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import elastic_train
from harness import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "test", "python", "elastic_train.py")
LAUNCHER_VARS = ("HOROVOD_", "OMPI_", "PMIX_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_RANK", "MASTER_")


# --- the state and the run loop, in one process and across ranks ---------------

def _object_state_commit_restore_sync():
    import horovod_zero.torch as hvd
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=hvd.rank(), batch=0)
    state.batch = 5
    state.commit()
    state.batch = 9
    state.restore()
    restored = state.batch
    state.sync()  # rank 0's values everywhere
    return restored, state.epoch


def test_object_state_restores_the_commit_and_syncs_rank_0s_values():
    res = launch(_object_state_commit_restore_sync, 2)
    assert res == {0: ("ok", (5, 0)), 1: ("ok", (5, 0))}


def _torch_state_round_trip():
    import horovod_zero.torch as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())  # different on each rank until sync()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    state.sync()
    synced = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    opt.step()  # an uncommitted change...
    state.epoch = 3
    state.restore()  # ...undone
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), committed))
    return ([t.tolist() for t in synced], same, torch.equal(opt.state[model.weight]["momentum_buffer"], momentum),
            state.epoch)


def test_torch_state_syncs_restores_model_and_optimizer():
    res = launch(_torch_state_round_trip, 2)
    (s0, same0, mom0, epoch0), (s1, same1, mom1, epoch1) = res[0][1], res[1][1]
    assert s0 == s1  # sync() gave rank 1 rank 0's parameters
    assert same0 and same1 and mom0 and mom1
    assert epoch0 == epoch1 == 0


def _run_loop_resets_after_failures():
    import horovod_zero.torch as hvd
    hvd.init()
    calls, resets, synced = [], [], []

    class Counting(hvd.elastic.ObjectState):
        def sync(self):
            synced.append(self.step)
            super().sync()

    state = Counting(step=0)
    state.register_reset_callbacks([lambda: resets.append(hvd.is_initialized())])

    @hvd.elastic.run
    def train(state, limit):
        calls.append(state.step)
        while state.step < limit:
            state.step += 1
            if state.step == 3 and len(calls) == 1:
                state.commit()  # committed at 3, then 4 is lost to the failure
                state.step += 1
                raise hvd.HorovodInternalError("a peer died")
            if state.step == 6 and len(calls) == 2:
                raise hvd.elastic.HostsUpdatedInterrupt(skip_sync=True)
        return state.step

    return train(state, 8), calls, resets, synced


def test_run_restores_resets_and_calls_again():
    (status, (result, calls, resets, synced)), = launch(_run_loop_resets_after_failures, 1).values()
    assert status == "ok"
    assert result == 8
    assert calls == [0, 3, 6]  # restored to the commit after the failure; kept as is after the interrupt
    assert resets == [True, True]  # callbacks run after each reset, with the job formed again
    assert synced == [0, 3]  # no sync after an interrupt for removed hosts only


def _host_updates_raise_on_every_rank():
    import horovod_zero.torch as hvd
    hvd.init()
    state = hvd.elastic.ObjectState(step=0)
    state.commit()  # nothing reported: no interrupt
    if hvd.rank() == 0:  # only rank 0 hears from the driver
        state.on_hosts_updated(100, 2)  # added
    try:
        state.commit()
        return "no interrupt"
    except hvd.elastic.HostsUpdatedInterrupt as e:
        return f"interrupt skip_sync={e.skip_sync}"


def test_a_host_update_interrupts_every_rank_at_the_same_commit():
    res = launch(_host_updates_raise_on_every_rank, 2)
    assert res == {0: ("ok", "interrupt skip_sync=False"), 1: ("ok", "interrupt skip_sync=False")}


def _zero_over_a_process_set_refused():
    import horovod_zero.torch as hvd
    pair = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[pair])
    msg = None
    if pair.included():
        model = torch.nn.Linear(3, 2)
        opt = hvd.DistributedZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, stage=1,
                                           process_set=pair)
        try:
            hvd.elastic.TorchState(model, opt)
        except ValueError as e:
            msg = str(e)
    hvd.barrier()
    return msg


def test_torch_state_refuses_a_zero_optimizer_over_a_process_set():
    res = launch(_zero_over_a_process_set_refused, 3)
    for r in (0, 1):
        status, msg = res[r]
        assert status == "ok" and "process_set=" in msg, msg


def _lost_shards(gone, numbers):
    """4 ranks commit a ZeRO-2 state; then the ranks in `gone` restore as if they had none
    (as new workers), and each rank claims commit numbers[rank]."""
    import horovod_zero.torch as hvd
    from horovod_zero.torch.zero.state import replicas
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = hvd.DistributedZeroOptimizer(torch.optim.AdamW(model.parameters()), model=model, stage=2)
    model(torch.ones(2, 5)).sum().backward()
    opt.step()
    commit = replicas.take(opt.sharded_state, model, 1)
    commit.number = numbers[hvd.rank()]
    try:
        replicas.restore(None if hvd.rank() in gone else commit, opt.sharded_state, model)
        return "restored"
    except RuntimeError as e:
        return str(e)


def test_losing_both_copies_of_a_shard_fails_on_every_rank_naming_it():
    # One node: rank r's copy is on rank r + 1, so losing ranks 0 and 1 loses rank 0's shards
    # (rank 1's copy lives on rank 2).
    res = launch(_lost_shards, 4, (0, 1), [1] * 4)
    assert {r: s for r, (s, _) in res.items()} == {r: "ok" for r in range(4)}
    msgs = {m for _, m in res.values()}
    assert len(msgs) == 1 and "ranks [0] of the previous job's 4 are lost" in msgs.pop()
    res = launch(_lost_shards, 4, (1,), [1] * 4)  # one loss: its copy is on rank 2
    assert {m for _, m in res.values()} == {"restored"}


def test_ranks_holding_different_commits_refuse_to_restore():
    res = launch(_lost_shards, 4, (), [1, 1, 2, 1])
    msgs = {m for _, m in res.values()}
    assert len(msgs) == 1 and "different commits ([1, 2])" in msgs.pop()


# --- ElasticSampler --------------------------------------------------------------

def _sampler_partitions(dataset_len, processed_batches, batch):
    import horovod_zero.torch as hvd
    hvd.init()
    sampler = hvd.elastic.ElasticSampler(list(range(dataset_len)), shuffle=True, seed=7)
    for b in range(processed_batches):
        sampler.record_batch(b, batch)
    sampler.reset()
    return list(sampler), sampler.state_dict()


@pytest.mark.parametrize("size", [2, 3])
def test_elastic_sampler_splits_what_is_left_of_the_epoch(size):
    import random
    res = launch(_sampler_partitions, size, 11, 1, 2)
    order = list(range(11))
    random.Random(7).shuffle(order)
    left = order[2 * size:]  # one batch of 2 per rank was processed
    per_rank = -(-len(left) // size)
    padded = (left * 2)[:per_rank * size]
    for r in range(size):
        status, (indices, sd) = res[r]
        assert status == "ok"
        assert indices == padded[r::size]
        assert sd == {"epoch": 0, "processed_num": 2 * size}


# --- whole jobs under horovodrun's elastic driver ----------------------------------

def _elastic_job(tmp_path, hosts, np_, min_np, max_np, timeout=150, **env):
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("".join(h + "\n" for h in hosts))
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    run_env.update(PYTHONPATH=ROOT + os.pathsep + os.path.join(ROOT, "test", "python"), OMP_NUM_THREADS="1",
                   ELASTIC_OUT=str(out), ELASTIC_HOSTS_FILE=str(hosts_file), **env)
    cmd = [sys.executable, "-m", "horovod_zero.runner", "-np", str(np_), "--min-np", str(min_np), "--max-np",
           str(max_np), "--host-discovery-script", str(discover), "--network-interface", "lo", sys.executable, TRAIN]
    p = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)
    sizes = {}
    for f in out.glob("sizes.*"):
        for line in f.read_text().split("\n"):
            if line:
                t, n = map(int, line.split())
                sizes.setdefault(t, set()).add(n)
    return p, out, sizes


def _reference(steps, zero=""):
    """The same training in one process, on each step's whole batch."""
    model = elastic_train.make_model()
    opt = elastic_train.make_optimizer(model, zero)
    for t in range(steps):
        x, y = elastic_train.global_batch(t)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _assert_trained_like_reference(out, steps, zero=""):
    got = torch.load(out / "final.pt")
    for k, v in _reference(steps, zero).items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def test_a_worker_killed_mid_step_the_others_go_on_from_the_last_commit(tmp_path):
    # 3 workers on two hosts (both this machine); the one on 127.0.0.1 kills itself with
    # SIGKILL after backward of step 5, and its host is blacklisted.
    p, out, sizes = _elastic_job(tmp_path, ["localhost:2", "127.0.0.1:1"], 3, 2, 3, ELASTIC_STEPS="16",
                                 ELASTIC_KILL_HOST="127.0.0.1", ELASTIC_KILL_AT="5")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sizes == {t: {3} if t < 5 else {2} for t in range(16)}  # step 5 was taken again, by 2 ranks
    _assert_trained_like_reference(out, 16)


def test_a_host_added_joins_at_the_next_commit_with_rank_0s_state(tmp_path):
    # Rank 0 adds 127.0.0.1 to the discovery script's output after step 2; the driver
    # notices within a second, and the job grows at the commit after that.
    p, out, sizes = _elastic_job(tmp_path, ["localhost:2"], 2, 2, 3, ELASTIC_STEPS="30", ELASTIC_ADD_AT="2",
                                 ELASTIC_ADD_HOST="127.0.0.1:1", ELASTIC_STEP_SLEEP="0.2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert all(len(n) == 1 for n in sizes.values()), sizes  # every step taken once, by one job
    grown = min(t for t, n in sizes.items() if n == {3})
    assert 2 < grown < 29 and all(sizes[t] == {2} for t in range(grown)), sizes
    assert all(sizes[t] == {3} for t in range(grown, 30)), sizes
    _assert_trained_like_reference(out, 30)


def test_below_min_np_the_job_ends_with_the_drivers_message(tmp_path):
    p, _, _ = _elastic_job(tmp_path, ["localhost:1", "127.0.0.1:1"], 2, 2, 2, timeout=90, ELASTIC_STEPS="30",
                           ELASTIC_KILL_HOST="127.0.0.1", ELASTIC_KILL_AT="3", HOROVOD_ELASTIC_START_TIMEOUT="3",
                           HOROVOD_GLOO_TIMEOUT_SECONDS="10")
    assert p.returncode != 0
    assert "enough resources to run at least 2 Horovod processes" in p.stdout + p.stderr, p.stderr[-3000:]


TWO_HOSTS = ["localhost:2", "127.0.0.1:1"]  # SIGKILL on 127.0.0.1: 3 ranks -> 2
HOST_PAIRS = ["localhost:2", "127.0.0.1:2"]  # the kill blacklists 127.0.0.1, so both its ranks leave: 4 -> 2


@pytest.mark.parametrize("hosts,zero", [(TWO_HOSTS, "1"), (TWO_HOSTS, "2"), (TWO_HOSTS, "3"),
                                        (TWO_HOSTS, "2-offload"), (TWO_HOSTS, "3-offload"), (TWO_HOSTS, "3-nvme"),
                                        (HOST_PAIRS, "3"), (HOST_PAIRS, "2-hybrid")])
def test_zero_lost_ranks_the_others_reshard_from_their_shards_and_copies(tmp_path, hosts, zero):
    # The dead ranks' shards come from their copies on the other host (with hybrid sharding,
    # from the other node's replicas), and every parameter is split anew over 2 ranks.
    n = sum(int(h.split(":")[1]) for h in hosts)
    p, out, sizes = _elastic_job(tmp_path, hosts, n, 2, n, ELASTIC_STEPS="10", ELASTIC_KILL_HOST="127.0.0.1",
                                 ELASTIC_KILL_AT="4", ELASTIC_ZERO=zero)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sizes == {t: {n} if t < 4 else {2} for t in range(10)}
    _assert_trained_like_reference(out, 10, zero)


def test_zero_a_host_added_receives_its_shards(tmp_path):
    p, out, sizes = _elastic_job(tmp_path, ["localhost:2"], 2, 2, 3, ELASTIC_STEPS="24", ELASTIC_ADD_AT="2",
                                 ELASTIC_ADD_HOST="127.0.0.1:1", ELASTIC_STEP_SLEEP="0.2", ELASTIC_ZERO="3")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    grown = min(t for t, n in sizes.items() if n == {3})
    assert all(sizes[t] == ({2} if t < grown else {3}) for t in range(24)), sizes
    _assert_trained_like_reference(out, 24, "3")


def test_zero_a_host_removed_by_discovery_resyncs_the_state(tmp_path):
    # Only a removal: Horovod skips sync() then, but a ZeRO optimizer is sharded anew at the
    # reset and needs its commit loaded (else it would train on zeros).
    p, out, sizes = _elastic_job(tmp_path, ["localhost:2", "127.0.0.1:1"], 3, 2, 3, ELASTIC_STEPS="24",
                                 ELASTIC_ADD_AT="2", ELASTIC_DROP_HOST="127.0.0.1:1", ELASTIC_STEP_SLEEP="0.2",
                                 ELASTIC_ZERO="2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    shrunk = min(t for t, n in sizes.items() if n == {2})
    assert all(sizes[t] == ({3} if t < shrunk else {2}) for t in range(24)), sizes
    _assert_trained_like_reference(out, 24, "2")


def test_zero_commits_to_disk_a_killed_worker_the_others_go_on_from_the_files(tmp_path):
    # horovodrun, 3 ranks -> 2, with TorchState(commit_dir=): the state comes from the last
    # commit's files (a sharded checkpoint), resharded for 2 ranks.
    p, out, sizes = _elastic_job(tmp_path, TWO_HOSTS, 3, 2, 3, ELASTIC_STEPS="10", ELASTIC_KILL_HOST="127.0.0.1",
                                 ELASTIC_KILL_AT="4", ELASTIC_ZERO="2", ELASTIC_COMMIT_DIR=str(tmp_path / "commits"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sizes == {t: {3} if t < 4 else {2} for t in range(10)}
    _assert_trained_like_reference(out, 10, "2")
    assert sorted(os.listdir(tmp_path / "commits")) == ["state.pt", "zero.optimizer.11"]  # 1 at the start, 10 steps


@pytest.mark.parametrize("zero", ["", "3"])
def test_torchrun_restarts_every_worker_and_they_go_on_from_the_last_commit_on_disk(tmp_path, zero):
    out = tmp_path / "out"
    out.mkdir()
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    run_env.update(PYTHONPATH=ROOT + os.pathsep + os.path.join(ROOT, "test", "python"), OMP_NUM_THREADS="1",
                   ELASTIC_OUT=str(out), ELASTIC_STEPS="8", ELASTIC_KILL_RANK="1", ELASTIC_KILL_AT="4",
                   ELASTIC_KILL_MARK=str(tmp_path / "killed"), ELASTIC_COMMIT_DIR=str(tmp_path / "commits"),
                   ELASTIC_ZERO=zero)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           TRAIN]
    p = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "killed").exists() and len(list(out.glob("sizes.*"))) == 4  # 2 workers, twice
    _assert_trained_like_reference(out, 8, zero)
