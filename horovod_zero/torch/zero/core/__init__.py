"""The parts every configuration uses: the shard plan and storage, gradient reduction,
parameter gathering, the norms, the device step, stages 1-2's parameters, and the
Protocols the parts are wired by (protocols.py)."""
