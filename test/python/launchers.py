"""Starting real launchers from tests (horovodrun, torchrun, mpirun) with a clean environment:
shared by the tests that launch scripts the way users do."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "test", "python")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# Open MPI refuses to run as root unless told twice.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
LAUNCHER_VARS = ("HOROVOD_", "OMPI_", "PMIX_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_RANK", "MASTER_")


def clean_env(**extra):
    """This process's environment without any launcher's variables, plus `extra` (a value of
    None removes that variable: OMP_NUM_THREADS=None leaves the threads to the launcher)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"])
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def start(cmd, env):
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(cmd, timeout=180, **env):
    """Runs cmd to its end: (returncode, stdout, stderr)."""
    p = subprocess.run(cmd, cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr
