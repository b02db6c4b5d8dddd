"""Launch-environment detection and rendezvous (torchrun, horovodrun, single process),
and ``python -m horovod_zero.runner``, which drives Horovod's own launcher."""

from horovod_zero.runner.world import World, detect_world

__all__ = ["World", "detect_world"]
