"""Offload of ZeRO's optimizer state (and, at stage 3, of the parameters at rest): the
host StepStrategy (host_step.py) over host memory (host.py; overlap.py steps during
backward; stepper.py chooses who steps), the C++ CPU Adam/AdamW (cpu_adam.py) and NVMe
files (nvme.py, nvme_state.py)."""
