"""The CPU cast kernel used by the fused copy-in agrees with torch's .to()."""

import pytest
import torch

from horovod_zero import _core

SPECIALS = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 1e-8, 6e-8, 3e-38, 1e-45,
                         float("inf"), float("-inf"), 3.4028235e38, 1.00390625, 1.01171875], dtype=torch.float32)


@pytest.mark.parametrize("to", [torch.bfloat16, torch.float16])
def test_downcast_matches_torch_bit_for_bit(to):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([SPECIALS, torch.randn(100_000, generator=g) * torch.logspace(-10, 10, 100_000).float()])
    ours = _core.cpu_cast(x, to)
    assert torch.equal(ours.view(torch.int16), x.to(to).view(torch.int16))
    nan = _core.cpu_cast(torch.tensor([float("nan")]), to)
    assert torch.isnan(nan).all()


@pytest.mark.parametrize("frm", [torch.bfloat16, torch.float16])
def test_upcast_is_exact(frm):
    x = torch.randn(10_000).to(frm)
    assert torch.equal(_core.cpu_cast(x, torch.float32), x.float())


def test_scaled_cast_equals_torch_scaling_then_casting():
    # Whether the kernel fuses the multiply into the cast is not visible in its output;
    # what is: it scales in fp32 and rounds once, as x * scale then .to() does.
    x = torch.randn(1000)
    torch.testing.assert_close(_core.cpu_cast(x, torch.bfloat16, 0.25), (x * 0.25).to(torch.bfloat16), rtol=0, atol=0)
    y = torch.randn(100_000, generator=torch.Generator().manual_seed(1)) * 100
    for to in (torch.bfloat16, torch.float16):
        for scale in (0.1, 1 / 3, 7.7):  # not powers of two: the product itself rounds
            assert torch.equal(_core.cpu_cast(y, to, scale).view(torch.int16), (y * scale).to(to).view(torch.int16))
