"""ZeRO CPU offload: master params and optimizer state in host memory, the
optimizer step on the CPU (cpu_adam: the C++ Adam/AdamW step)."""

from horovod_zero.torch.zero.offload.cpu_adam import CpuAdam, adam_step_flat, chosen_isa, not_covered_reason

__all__ = ["CpuAdam", "adam_step_flat", "chosen_isa", "not_covered_reason"]
