"""Offload of the optimizer's master shards and state to host memory or NVMe."""
