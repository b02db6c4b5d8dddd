"""Gradient compression, as Horovod's: a compressor turns a tensor into what crosses
the wire plus a context, and turns the reduced result back with that context.

    hvd.allreduce(t, compression=hvd.Compression.fp16)
    hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)

Any object with the two static methods below works as a compressor.
"""

import torch


class Compressor:
    """The interface: compress(tensor) -> (wire tensor, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor as it is (the default)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 and casts the result back to the
    tensor's own dtype; other dtypes go as they are."""

    @staticmethod
    def compress(tensor):
        wire = tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor
        return wire, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class Compression:
    """The built-in compressors: Compression.none (default) and Compression.fp16."""

    none = NoneCompressor
    fp16 = FP16Compressor
