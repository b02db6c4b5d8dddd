"""A worker's next place in an elastic job started by horovodrun (HOROVOD_ELASTIC=1).

When a worker fails or hosts come and go, the survivors call hvd.shutdown() and
hvd.init() again (hvd.elastic.run does). That second init() asks the launcher's
elastic driver where this process goes: GET rank_and_size/<host>:<local rank> on the
rendezvous server. The driver answers once every worker of the job that ended has
either asked or failed, after it has blacklisted the failed hosts and assigned the
slots anew; it answers rank -1 to a worker whose host is no longer in the job. The
first init() of a process reads its place from the environment, as without elastic.
"""

import os
import urllib.error
import urllib.request

_SCOPE = "rank_and_size"  # the driver's (horovod.runner.elastic.rendezvous)
_FIELDS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
           "HOROVOD_CROSS_SIZE")


def next_slot(env, timeout_s: float) -> dict:
    """The HOROVOD_* variables of this worker's place in the next job."""
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        raise RuntimeError("HOROVOD_ELASTIC=1 but HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT are not set: elastic jobs are "
                           "started by `python -m horovod_zero.runner --min-np ... --host-discovery-script ...`.")
    worker = f"{env.get('HOROVOD_HOSTNAME', 'localhost')}:{env.get('HOROVOD_LOCAL_RANK', '0')}"
    try:
        text = urllib.request.urlopen(f"http://{addr}:{port}/{_SCOPE}/{worker}", timeout=timeout_s).read().decode()
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(
            f"horovodrun's elastic driver at {addr}:{port} gave worker {worker} no place in the next job within "
            f"{timeout_s:.0f} s ({e}). The driver ends the job when fewer than --min-np slots are available for "
            "--elastic-timeout seconds (HOROVOD_ELASTIC_TIMEOUT); its output says why.") from None
    values = [int(v) for v in text.split(",")]
    if len(values) != len(_FIELDS):
        raise RuntimeError(f"horovodrun's elastic driver answered {text!r} for worker {worker}; expected six "
                           "integers (rank, size, local rank, local size, cross rank, cross size).")
    if values[0] < 0:
        raise RuntimeError(f"Worker {worker} is no longer part of the elastic job: the driver removed its host "
                           "(a failure there blacklists it, or the discovery script stopped listing it).")
    return {k: str(v) for k, v in zip(_FIELDS, values)}


def take_next_slot(timeout_s: float) -> None:
    """Sets this process's HOROVOD_* place variables to its place in the next job, where
    the world is read from (world.py)."""
    os.environ.update(next_slot(os.environ, timeout_s))
