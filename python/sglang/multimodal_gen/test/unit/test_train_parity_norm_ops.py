# SPDX-License-Identifier: Apache-2.0
"""train_parity forwards of the norm, modulation and gated-residual ops round where the
training forward (diffusers under CUDA bf16 autocast) rounds.

Under CUDA autocast ``nn.LayerNorm`` returns ``F.layer_norm(x.float())`` (fp32); the
modulation ``x * (1 + scale) + shift`` then mixes that fp32 value with bf16 ``scale`` /
``shift`` and stays fp32 until the next Linear casts it to bf16. The references below
write those dtypes out; each test has a control showing the comparison catches a rounding
in another place.
"""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

from sglang.multimodal_gen.runtime.layers.elementwise import MulAdd
from sglang.multimodal_gen.runtime.layers.fused_scale_shift_gate import (
    FusedLayerNormScaleShiftGateSelect01,
    FusedResidualLayerNormScaleShiftGateSelect01,
)
from sglang.multimodal_gen.runtime.layers.layernorm import (
    LayerNormScaleShift,
    RMSNorm,
    RMSNormScaleShift,
    ScaleResidualLayerNormScaleShift,
)
from sglang.multimodal_gen.runtime.utils.train_parity import (
    TrainParityError,
    numerics_mode_context,
)

BF16 = torch.bfloat16
EPS = 1e-6
HIDDEN = 256


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(BF16)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns: unlike torch.equal, tells -0.0 from +0.0."""
    return t.contiguous().view({BF16: torch.int16, torch.float32: torch.int32}[t.dtype])


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(bits(actual), bits(expected))


def train_parity_op(cls: type, *args, **kwargs):
    with numerics_mode_context("train_parity"):
        op = cls(*args, **kwargs)
    assert op._forward_method.__name__ == "forward_train_parity"
    return op


def layer_norm_fp32(x: torch.Tensor) -> torch.Tensor:
    """nn.LayerNorm(elementwise_affine=False) under CUDA bf16 autocast."""
    return F.layer_norm(x.float(), x.shape[-1:], eps=EPS)


def modulate(normed: torch.Tensor, shift, scale) -> torch.Tensor:
    """diffusers' adaLN modulation with [B, 1, D] chunks, as the next Linear reads it."""
    return (normed * (1 + scale) + shift).to(BF16)


@pytest.mark.parametrize("shape", [(2, 13, 2, 128), (1, 7, HIDDEN)])
def test_rms_norm_matches_diffusers(shape):
    x, weight = rand(*shape), 1 + rand(shape[-1], scale=0.1)
    op = train_parity_op(RMSNorm, shape[-1], eps=EPS).to(BF16)
    reference = DiffusersRMSNorm(shape[-1], eps=EPS).to(BF16)
    op.weight.data.copy_(weight)
    reference.weight.data.copy_(weight)
    with torch.no_grad():
        expected = reference(x)
        assert_bitwise(op(x), expected)
    # control: the weight multiplied in fp32 before the one rounding
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    assert not torch.equal((normed * weight).to(BF16), expected)


@pytest.mark.parametrize("mod_dims", [2, 3])
def test_layer_norm_scale_shift(mod_dims):
    x = rand(2, 13, HIDDEN)
    shift, scale = rand(2, HIDDEN, scale=0.5), rand(2, HIDDEN, scale=0.5)
    op = train_parity_op(LayerNormScaleShift, HIDDEN, eps=EPS)
    args = (shift, scale) if mod_dims == 2 else (shift[:, None], scale[:, None])
    expected = modulate(layer_norm_fp32(x), shift[:, None], scale[:, None])
    assert_bitwise(op(x, *args), expected)
    # control: the norm rounded to bf16 before the modulation
    rounded = layer_norm_fp32(x).to(BF16)
    assert not torch.equal(modulate(rounded, shift[:, None], scale[:, None]), expected)


@pytest.mark.parametrize("unit_gate", [False, True])
def test_scale_residual_layer_norm_scale_shift(unit_gate):
    residual, x = rand(2, 13, HIDDEN), rand(2, 13, HIDDEN)
    shift, scale, gate = (rand(2, 1, HIDDEN, scale=0.5) for _ in range(3))
    op = train_parity_op(ScaleResidualLayerNormScaleShift, HIDDEN, eps=EPS)
    modulated, residual_out = op(residual, x, 1 if unit_gate else gate, shift, scale)
    expected_residual = residual + x if unit_gate else residual + gate * x
    assert_bitwise(residual_out, expected_residual)
    assert_bitwise(
        modulated, modulate(layer_norm_fp32(expected_residual), shift, scale)
    )
    # control: the gated residual kept in fp32 until the norm
    fused = residual.float() + gate.float() * x.float()
    assert unit_gate or not torch.equal(fused.to(BF16), expected_residual)


def test_mul_add_keeps_the_sign_of_zero():
    x, residual, gate = rand(2, 13, HIDDEN), rand(2, 13, HIDDEN), rand(2, 1, HIDDEN)
    gate[..., :8], residual[..., :8] = -0.0, -0.0
    expected = residual + gate * x
    assert_bitwise(train_parity_op(MulAdd)(x, gate, residual, 0), expected)
    # control: `c + a * (0 + b)` turns a -0.0 gate into +0.0
    assert not torch.equal(bits(residual + x * (0 + gate)), bits(expected))


@pytest.mark.parametrize("with_residual", [False, True])
def test_select01_modulation(with_residual):
    """zero_cond_t: per sample, tokens before a boundary take modulation 0, the rest 1."""
    batch, seq = 2, 13
    x = rand(batch, seq, HIDDEN)
    index = torch.stack([(torch.arange(seq) >= 6 + b).int() for b in range(batch)])
    scale0, shift0, gate0, scale1, shift1, gate1 = (
        rand(batch, HIDDEN, scale=0.5) for _ in range(6)
    )
    per_token = index.bool()[..., None]
    shift = torch.where(per_token, shift1[:, None], shift0[:, None])
    scale = torch.where(per_token, scale1[:, None], scale0[:, None])
    gate = torch.where(per_token, gate1[:, None], gate0[:, None])
    selectable = (scale0, shift0, gate0, scale1, shift1, gate1, index, EPS)
    if with_residual:
        residual, residual_gate = rand(batch, seq, HIDDEN), rand(batch, seq, HIDDEN)
        op = train_parity_op(FusedResidualLayerNormScaleShiftGateSelect01)
        modulated, residual_out, gate_out = op(
            x, residual, residual_gate, None, None, *selectable
        )
        normed_input = residual + residual_gate * x
        assert_bitwise(residual_out, normed_input)
    else:
        op = train_parity_op(FusedLayerNormScaleShiftGateSelect01)
        modulated, gate_out = op(x, None, None, *selectable)
        normed_input = x
    assert_bitwise(modulated, modulate(layer_norm_fp32(normed_input), shift, scale))
    assert_bitwise(gate_out, gate)


def test_default_mode_keeps_its_forward():
    with numerics_mode_context("default"):
        ops = [RMSNorm(HIDDEN), LayerNormScaleShift(HIDDEN), MulAdd()]
    assert all(op._forward_method.__name__ != "forward_train_parity" for op in ops)


def test_variants_without_a_training_forward_are_refused():
    x = rand(1, 7, HIDDEN)
    with pytest.raises(TrainParityError, match="fused residual"):
        train_parity_op(RMSNorm, HIDDEN)(x, x)
    rms = train_parity_op(RMSNormScaleShift, HIDDEN, eps=EPS)
    with pytest.raises(TrainParityError, match="a rms norm"):
        rms(x, rand(1, HIDDEN), rand(1, HIDDEN))
    op = train_parity_op(ScaleResidualLayerNormScaleShift, HIDDEN, eps=EPS)
    per_frame_gate = rand(1, 7, 1, HIDDEN)
    with pytest.raises(TrainParityError, match="per-frame"):
        op(x, x, per_frame_gate, rand(1, HIDDEN), rand(1, HIDDEN))
