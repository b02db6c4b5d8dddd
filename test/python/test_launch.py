"""Launching for real: a plain python process (size 1), torchrun (one node and two
simulated nodes), the environment's `horovodrun` with Horovod's flags (one host and
two simulated hosts), Open MPI's mpirun, and srun's environment."""

import os
import subprocess
import sys

import pytest

from harness import free_port
from launchers import HOROVODRUN, MPI_ENV, SCRIPTS, clean_env, start

SCRIPT = os.path.join(SCRIPTS, "launch_check.py")


def _finish(procs, timeout=180):
    out = ""
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"{p.args} exited {p.returncode}\n{stdout}\n{stderr}"
        out += stdout
    return out


def _run(cmd, timeout=180, **env):
    return _finish([start(cmd, clean_env(**env))], timeout)


def _ranks(out):
    """The LAUNCH_OK lines as dicts of strings, sorted by rank."""
    rows = []
    for line in out.splitlines():
        if "LAUNCH_OK " in line:
            rows.append(dict(kv.split("=", 1) for kv in line.split("LAUNCH_OK ", 1)[1].split()))
    return sorted(rows, key=lambda r: int(r["rank"]))


def _check_layout(rows, launcher, nodes, per_node):
    size = nodes * per_node
    assert [int(r["rank"]) for r in rows] == list(range(size))
    for r in rows:
        rank = int(r["rank"])
        assert r["launcher"] == launcher
        assert (int(r["size"]), int(r["local_size"]), int(r["cross_size"])) == (size, per_node, nodes)
        assert (int(r["local_rank"]), int(r["cross_rank"])) == (rank % per_node, rank // per_node)
        assert float(r["sum"]) == size * (size + 1) / 2  # the allreduce crossed every rank
        # Ranks on several hosts negotiate over Gloo; on one host through shared memory.
        if size > 1:
            assert r["control_plane"] == ("shm" if nodes == 1 else "gloo")


def _check_threads(rows, expected):
    """Each rank's intra-op threads: `expected(usable cores of that rank)`."""
    for r in rows:
        assert int(r["threads"]) == expected(int(r["usable_cores"])), r


def _share(usable):
    """Ours where OMP_NUM_THREADS is unset: the usable cores over the 2 local ranks."""
    return max(1, usable // 2)


def test_single_process_is_a_job_of_size_one():
    _check_layout(_ranks(_run([sys.executable, SCRIPT])), "single", 1, 1)


def test_torchrun_two_ranks():
    """OMP_NUM_THREADS unset: torchrun's own default for several local workers, one thread each."""
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                SCRIPT], OMP_NUM_THREADS=None)
    rows = _ranks(out)
    _check_layout(rows, "torchrun", 1, 2)
    _check_threads(rows, lambda usable: 1)


def test_torchrun_two_simulated_nodes():
    port = free_port()
    env = clean_env()
    procs = [
        start([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={n}", "--nproc_per_node=2",
                "--master_addr=127.0.0.1", f"--master_port={port}", SCRIPT], env)
        for n in range(2)
    ]
    _check_layout(_ranks(_finish(procs)), "torchrun", 2, 2)


def test_plain_horovodrun_two_ranks():
    """`horovodrun -np 2 python script.py`, as Horovod users type it. horovodrun leaves
    OMP_NUM_THREADS unset: each rank takes its share of the cores, not all of them."""
    rows = _ranks(_run([HOROVODRUN, "-np", "2", "python", SCRIPT], OMP_NUM_THREADS=None))
    _check_layout(rows, "horovodrun", 1, 2)
    _check_threads(rows, _share)


def test_horovodrun_flags_reach_every_rank(tmp_path):
    timeline = tmp_path / "timeline.json"
    out = _run([
        HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "60", "--verbose",
        "--timeline-filename", str(timeline), "--fusion-threshold-mb", "8", "--cycle-time-ms", "2.5",
        "--cache-capacity", "7", "--log-level", "ERROR", "python", SCRIPT,
    ], OMP_NUM_THREADS="2")
    rows = _ranks(out)
    _check_layout(rows, "horovodrun", 1, 2)
    _check_threads(rows, lambda usable: 2)  # the user's OMP_NUM_THREADS, not the default
    for r in rows:
        assert int(r["fusion_threshold"]) == 8 * 1024 * 1024
        assert float(r["cycle_time_ms"]) == 2.5
        assert int(r["cache_capacity"]) == 7
        assert r["timeline"] == str(timeline)
        assert r["log_level"] == "ERROR"
    assert timeline.stat().st_size > 0  # rank 0 wrote it


def test_horovodrun_two_simulated_hosts():
    """-H a:2,b:2 with two names of this machine: Horovod assigns ranks to hosts."""
    out = _run([HOROVODRUN, "-np", "4", "-H", "localhost:2,127.0.0.1:2", "python", SCRIPT])
    _check_layout(_ranks(out), "horovodrun", 2, 2)


def test_horovodrun_refuses_mpi_mode_in_one_line():
    p = subprocess.run([HOROVODRUN, "--mpi", "-np", "2", "python", SCRIPT], env=clean_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "mpirun" in p.stderr


def test_mpirun_two_ranks():
    rows = _ranks(_run(["mpirun", "-np", "2", "--oversubscribe", "python", SCRIPT], OMP_NUM_THREADS=None, **MPI_ENV))
    _check_layout(rows, "mpirun", 1, 2)
    _check_threads(rows, _share)  # mpirun sets no OMP_NUM_THREADS either


def _simulated(nodes, per_node, env_of_rank):
    procs = [start([sys.executable, SCRIPT], clean_env(**env_of_rank(r))) for r in range(nodes * per_node)]
    return _ranks(_finish(procs))


def test_mpirun_environment_of_two_nodes_with_master_addr():
    port = str(free_port())

    def env(r):
        return dict(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK=str(r % 2),
                    OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)

    _check_layout(_simulated(2, 2, env), "mpirun", 2, 2)


def test_mpirun_across_hosts_without_master_addr_says_what_to_do():
    env = clean_env(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
                     OMPI_COMM_WORLD_LOCAL_SIZE="2")
    p = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "-x MASTER_ADDR=" in p.stderr and "-x MASTER_PORT=" in p.stderr


def _free_slurm_job_id():
    """A job id whose derived store port is free here, as Slurm's job ids are unique."""
    import socket

    from horovod_zero.runner.rendezvous import slurm_port

    for job in range(1000, 100000, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", slurm_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0"})))
                return str(job)
            except OSError:
                continue
    raise RuntimeError("no free port for a simulated Slurm job")


def test_srun_environment_of_two_nodes():
    """The variables srun sets for 4 tasks on 2 nodes; the store's host is the first
    of the node list and its port comes from the job id."""
    job = _free_slurm_job_id()

    def env(r):
        return dict(SLURM_PROCID=str(r), SLURM_NTASKS="4", SLURM_LOCALID=str(r % 2), SLURM_NODEID=str(r // 2),
                    SLURM_TASKS_PER_NODE="2(x2)", SLURM_JOB_NODELIST="localhost,127.0.0.1",
                    SLURM_JOB_ID=job, SLURM_STEP_ID="0")

    _check_layout(_simulated(2, 2, env), "srun", 2, 2)


def test_srun_without_its_peers_fails_in_seconds_with_a_hint():
    """A plain `python` inside an sbatch script sees SLURM_NTASKS of the allocation."""
    env = clean_env(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_JOB_NODELIST="localhost",
                     SLURM_JOB_ID=_free_slurm_job_id(), HOROVOD_GLOO_TIMEOUT_SECONDS="3")
    p = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "srun" in p.stderr and "could not meet the other ranks" in p.stderr


@pytest.mark.parametrize("env,expected", [
    (dict(HOROVOD_RANK="3", HOROVOD_SIZE="4", HOROVOD_LOCAL_RANK="1", HOROVOD_LOCAL_SIZE="2",
          HOROVOD_CROSS_RANK="1", HOROVOD_CROSS_SIZE="2", RANK="0", WORLD_SIZE="1"),
     (3, 4, 1, 2, 1, 2, "horovodrun")),
    (dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", GROUP_RANK="1", SLURM_PROCID="0",
          SLURM_NTASKS="2"),
     (5, 8, 1, 4, 1, 2, "torchrun")),
    (dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="6", OMPI_COMM_WORLD_LOCAL_RANK="2",
          OMPI_COMM_WORLD_LOCAL_SIZE="3"),
     (5, 6, 2, 3, 1, 2, "mpirun")),
    (dict(SLURM_PROCID="6", SLURM_NTASKS="7", SLURM_LOCALID="0", SLURM_NODEID="2", SLURM_TASKS_PER_NODE="3(x2),1"),
     (6, 7, 0, 1, 2, 3, "srun")),
    ({}, (0, 1, 0, 1, 0, 1, "single")),
])
def test_world_from_each_launchers_variables(env, expected):
    """horovodrun and torchrun take precedence over the mpirun or Slurm allocation they run in."""
    from horovod_zero.runner.world import detect_world

    w = detect_world(env)
    assert (w.rank, w.size, w.local_rank, w.local_size, w.cross_rank, w.cross_size, w.launcher) == expected


def test_inconsistent_launcher_environment_is_refused():
    from horovod_zero.runner.world import detect_world

    with pytest.raises(ValueError, match="inconsistent: rank 4 of 4"):
        detect_world(dict(OMPI_COMM_WORLD_RANK="4", OMPI_COMM_WORLD_SIZE="4"))
    with pytest.raises(ValueError, match="SLURM_NTASKS='x' is not an integer"):
        detect_world(dict(SLURM_PROCID="0", SLURM_NTASKS="x"))


@pytest.mark.parametrize("nodelist,first", [
    ("node7", "node7"), ("gpu[03-05,9],cpu1", "gpu03"), ("rack[2-3]-n[10-12]", "rack2-n10"), ("a,b[1-2]", "a"),
])
def test_slurm_first_host(nodelist, first):
    from horovod_zero.runner.rendezvous import slurm_first_host

    assert slurm_first_host(nodelist) == first


def test_slurm_tasks_per_node():
    from horovod_zero.runner.world import slurm_tasks_per_node

    assert slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm_tasks_per_node("4") == [4]
