"""Launching for real: a plain python process (size 1), torchrun, and horovodrun's
launcher through python -m horovod_zero.runner."""

import os
import subprocess
import sys

import pytest

from harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "test", "python", "launch_check.py")


def _run(cmd, timeout=180):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _lines(out):
    return sorted(l.split("LAUNCH_OK ", 1)[1] for l in out.splitlines() if "LAUNCH_OK " in l)


def test_single_process_is_a_job_of_size_one():
    assert _lines(_run([sys.executable, SCRIPT])) == ["rank=0 size=1 launcher=single sum=1.0"]


def test_torchrun_two_ranks():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", SCRIPT])
    assert _lines(out) == [f"rank={r} size=2 launcher=torchrun sum=3.0" for r in range(2)]


def test_horovodrun_launcher_two_ranks():
    pytest.importorskip("horovod.runner")
    out = _run([sys.executable, "-m", "horovod_zero.runner", "-np", "2", "-H", "localhost:2", sys.executable, SCRIPT])
    assert _lines(out) == [f"rank={r} size=2 launcher=horovodrun sum=3.0" for r in range(2)]
