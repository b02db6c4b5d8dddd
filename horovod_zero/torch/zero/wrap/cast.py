"""Forward inputs cast to param_dtype, as FSDP2's MixedPrecisionPolicy does with
cast_forward_inputs: a model whose parameters are bf16 then takes the fp32
batches it took before. Floating-point tensors are cast, anywhere in the
positional and keyword arguments (through lists, tuples, named tuples and dicts);
integer tensors (token ids, labels) and everything else pass unchanged."""

import copy

import torch


def cast_floating(x, dtype):
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, dict):
        out = copy.copy(x)  # keeps a dict subclass and its attributes
        out.update((k, cast_floating(v, dtype)) for k, v in x.items())
        return out
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(cast_floating(v, dtype) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(cast_floating(v, dtype) for v in x)
    return x

