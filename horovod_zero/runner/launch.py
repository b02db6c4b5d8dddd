"""``python -m horovod_zero.runner``: horovodrun's command line and launcher for
horovod_zero jobs.

Horovod's launcher (host assignment, the HTTP rendezvous server, local and ssh
start of every rank, output forwarding) installs and runs without Horovod's C++
extensions, but ``horovodrun`` refuses to start unless those extensions were
built, and they no longer build against current torch. The ranks of a
horovod_zero job do not use them: they bring their own runtime and reach Gloo
through torch. So this entry point runs Horovod's own launcher in gloo mode and
answers its "is Gloo built?" question for the ranks it is about to start.
"""

import os
import sys

_INSTALL_HINT = (
    "Horovod's launcher is not installed. Install it without its C++ extensions:\n"
    "  HOROVOD_SKIP_COMPILE=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 "
    "HOROVOD_WITHOUT_MXNET=1 pip install horovod==0.28.1"
)


def main(argv=None):
    try:
        from horovod.runner import launch as horovod_launch
    except ImportError:
        sys.stderr.write(_INSTALL_HINT + "\n")
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--mpi" in argv or "--jsrun" in argv:
        sys.stderr.write(
            "horovodrun launches horovod_zero jobs in Gloo mode only: drop --mpi/--jsrun, "
            "or start the ranks with mpirun itself (mpirun -np N python train.py).\n"
        )
        return 2
    if "--gloo" not in argv:
        argv.insert(0, "--gloo")
    # The elastic driver waits for --min-np slots for HOROVOD_ELASTIC_TIMEOUT (--elastic-timeout);
    # HOROVOD_ELASTIC_START_TIMEOUT means the same where that one is unset. The workers inherit it.
    if os.environ.get("HOROVOD_ELASTIC_START_TIMEOUT") and not os.environ.get("HOROVOD_ELASTIC_TIMEOUT"):
        os.environ["HOROVOD_ELASTIC_TIMEOUT"] = os.environ["HOROVOD_ELASTIC_START_TIMEOUT"]
    horovod_launch.gloo_built = lambda verbose=False: True
    horovod_launch.mpi_built = lambda verbose=False: False
    saved = sys.argv
    sys.argv = ["horovodrun"] + argv
    try:
        horovod_launch.run_commandline()
    finally:
        sys.argv = saved
    return 0
