"""Who failed first: when rank 1 exits with code 3 and rank 0 fails because of it, the
launcher's summary names rank 1 and code 3, as it does for a job whose other ranks were
unaffected, and as torchrun does ("Root Cause (first observed failure): rank 1, exitcode 3").
The summaries are the launchers' own: Horovod's launcher and Open MPI's mpirun name "the first
process to do so" (to exit with a non-zero status)."""

import os
import re

import pytest

from horovod_zero.torch import HorovodInternalError
from horovod_zero.torch.peer_failure import GRACE_SECONDS, exit_grace_seconds
from launchers import HOROVODRUN, MPI_ENV, SCRIPTS, run

SCRIPT = os.path.join(SCRIPTS, "fail_first.py")

# launcher -> (command, the summary's words for "rank 1 failed first, with code 3")
LAUNCHERS = {
    "horovodrun": ([HOROVODRUN, "-np", "2", "python", SCRIPT], r"first process to do so was:\s+Process name: 1\s+Exit code: 3"),
    "mpirun": (["mpirun", "-np", "2", "--oversubscribe", "python", SCRIPT],
               r"first process to do so was:\s+Process name: \[\[\d+,\d+\],1\]\s+Exit code:\s+3"),
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_the_launcher_names_the_rank_that_failed_first(launcher):
    cmd, summary = LAUNCHERS[launcher]
    code, out, err = run(cmd, timeout=120, **MPI_ENV)
    text = out + err
    assert code != 0
    assert "horovod_zero stopped: rank 1 shut down" in text, text[-3000:]  # rank 0 failed because of rank 1
    assert re.search(summary, text), text[-3000:]


def test_only_a_failure_caused_by_a_peer_waits_and_never_in_elastic_jobs():
    peer = HorovodInternalError("horovod_zero stopped: rank 1 shut down (called hvd.shutdown() or exited) ...")
    assert exit_grace_seconds(peer, elastic=False) == GRACE_SECONDS
    assert exit_grace_seconds(peer, elastic=True) == 0  # hvd.elastic recovers at once instead
    try:
        try:
            raise peer
        except HorovodInternalError as e:
            raise RuntimeError("training failed") from e
    except RuntimeError as wrapped:
        assert exit_grace_seconds(wrapped, elastic=False) == GRACE_SECONDS
    # A collective submitted after the peer's shutdown reached this rank is refused for the same reason.
    refused = HorovodInternalError("Cannot submit 'never': horovod_zero stopped: rank 1 shut down ...")
    assert exit_grace_seconds(refused, elastic=False) == GRACE_SECONDS
    assert exit_grace_seconds(HorovodInternalError("Mismatched shapes for tensor 'x'"), elastic=False) == 0
    assert exit_grace_seconds(ValueError("bad input"), elastic=False) == 0
    assert exit_grace_seconds(None, elastic=False) == 0
