"""The fused CPU kernels for residual add + RMSNorm and SiLU * up at each ISA level, against the
PyTorch ops they replace (the reference implementations' rounding, step by step)."""

import pytest
import torch
import torch.nn.functional as F

from tutorserve.kernels import norm_act
from tutorserve.layers.activation import silu_and_mul
from tutorserve.layers.norm import RMSNorm


def reference_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def assert_within_two_ulps(got, want):
    """Mostly equal; for bf16 otherwise within two rounding steps (the row's sum of squares is
    added up in another order, and a one-step change of the rounded normalized value carries
    through the weight's product); float32 to 1e-6."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs().clamp_min(1e-30) * 2.0**-6
    assert bool((diff <= ulp).all()), f"max diff {diff.max()}"
    assert (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_add_rms_norm_matches_the_pytorch_ops(cpu_isa, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(576, generator=g))
    assert norm_act.supports(x, 576)
    want_sum = x + residual
    want = reference_norm(want_sum, norm.weight, 1e-5)
    kept = residual.clone()
    with torch.inference_mode():
        out, new_residual = norm(x, kept)
        alone = norm(x)
    assert new_residual.data_ptr() == kept.data_ptr()  # the sum went into the residual
    torch.testing.assert_close(new_residual, want_sum, atol=0, rtol=0)
    assert_within_two_ulps(out, want)
    assert_within_two_ulps(alone, reference_norm(x, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_pytorch_ops(cpu_isa, dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (4 * torch.randn(300, 2 * 1536, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_two_ulps(silu_and_mul(gate_up), F.silu(gate) * up)


def test_what_the_kernels_do_not_take_goes_through_pytorch():
    x = torch.randn(4, 24)  # rows of 24: not a multiple of 16
    assert not norm_act.supports(x, 24)
    assert not norm_act.supports(torch.randn(4, 32, dtype=torch.float16), 32)
    assert not norm_act.supports(torch.randn(32, 4).t(), 32)  # not contiguous
    norm = RMSNorm(24, 1e-6)
    torch.testing.assert_close(norm(x), reference_norm(x, norm.weight, 1e-6))
    gate_up = torch.randn(4, 48)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate_up[:, :24]) * gate_up[:, 24:])
    x, residual = torch.randn(4, 32), torch.randn(32, 4).t()  # a residual the kernel cannot take
    out, summed = RMSNorm(32, 1e-6)(x, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(out, reference_norm(x + residual, torch.ones(32), 1e-6))
