"""Tensor sizes of a Llama-3.2-1B decoder layer (d=2048, 8 KV heads of 64, FFN 8192),
shared by the collective benchmarks."""

LAYER = [2048 * 2048, 2048 * 512, 2048 * 512, 2048 * 2048, 2048 * 8192, 2048 * 8192, 8192 * 2048, 2048, 2048]


def tensor_sizes(total_bytes, elem_bytes, size):
    """Full-tensor numels in layer order until `total_bytes`, each divisible by size."""
    out, acc, i = [], 0, 0
    while acc < total_bytes:
        n = LAYER[i % len(LAYER)]
        n = min(n, (total_bytes - acc) // elem_bytes)
        n -= n % size
        if n <= 0:
            break
        out.append(n)
        acc += n * elem_bytes
        i += 1
    return out
