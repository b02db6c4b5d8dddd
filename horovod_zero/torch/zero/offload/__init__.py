"""Offload of ZeRO's optimizer state (and, at stage 3, of the parameters at rest):
host memory (host.py, overlap.py, stepper.py, engine.py; options.py checks the
arguments), the C++ CPU Adam/AdamW (cpu_adam.py) and NVMe files (nvme.py)."""
