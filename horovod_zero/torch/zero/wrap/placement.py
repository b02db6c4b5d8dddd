"""Where the parameters train. By default, on the device they are on when wrapped.
device= names another: a model too large for the GPU in fp32 is built on the host
and wrapped with device=hvd.device(). Each parameter then crosses on its own, straight
into its sharded storage (storage.py), so the whole model is never on the device
at once: at stage 3 with offload_params only one parameter is there at a time. This
module moves the rest of the model, which the optimizer does not hold: buffers and
frozen parameters."""

import torch

from horovod_zero.torch.basics import device as local_device


def one_device(params, default):
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"Parameters are on several devices {sorted(map(str, devices))}; "
                         "move the model to one device (hvd.device()) before wrapping, or build it on the "
                         "host and pass device=hvd.device().")
    return devices.pop() if devices else default


def resolve(device, params, model, names):
    """The device the parameters train on: `device`, or where they are when it is None.
    `names`: parameter -> name, for messages."""
    if device is None:
        return one_device(params, torch.device("cpu"))
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device: pass hvd.device(), 'cuda' or 'cpu'.") from e
    if target.type == "cuda":
        local_gpu = local_device()  # hvd.device(): the CPU without a usable CUDA path
        if local_gpu.type != "cuda":
            raise ValueError(f"device={device!r}: this process has no usable CUDA GPU (or horovod_zero was built "
                             "without CUDA); pass device=hvd.device(), which is the CPU then.")
        if target.index is None:
            target = local_gpu  # this rank's GPU: the current device is cuda:0 on every rank unless set
    elif target.type != "cpu":
        raise ValueError(f"device={device!r}: horovod_zero trains on CUDA GPUs or the CPU.")
    check_crossing(params, target, model, names)
    return target


def check_crossing(params, target, model, names):
    """Refuses what would break once `params` cross to `target`, before anything moves.
    Each crosses on its own, so they need not start on one device."""
    away = [p for p in params if p.device != target]
    if away and model is None:
        raise ValueError(f"device={target} while parameters are on {away[0].device}: pass model= (instead of "
                         "named_parameters=), so that the model's buffers move with them.")
    for p in away:
        if p.grad is not None:
            raise ValueError(f"Parameter {names.get(p, '')!r} has a gradient from before wrapping, on "
                             f"{p.grad.device}; call model.zero_grad(set_to_none=True) before wrapping with "
                             f"device={target}.")


def move_rest(model, device):
    """Moves the model's buffers and parameters that are not on `device` yet to it. Called
    once the optimizer's parameters are sharded there: what is left is what it does not hold."""
    with torch.no_grad():
        for m in model.modules():
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)
            for p in m._parameters.values():
                if p is not None and p.device != device:
                    p.data = p.data.to(device)  # the same Parameter: references to it stay valid
                    if p.grad is not None:
                        p.grad = p.grad.to(device)
