# SPDX-License-Identifier: Apache-2.0
"""The train_parity fused kernels: when they run, how a kernel is checked against its
eager chain and turned off, their index math (Triton's interpreter, on the CPU), and on
CUDA each kernel bitwise against its eager chain, with controls that round elsewhere."""

import os
import re
import subprocess
import sys
import textwrap
from functools import partial
from unittest.mock import MagicMock

import pytest
import torch

from sglang.kernels.ops import diffusion as kernels
from sglang.multimodal_gen.runtime.layers import train_parity_kernels, train_parity_ops

BF16 = torch.bfloat16
CUDA = torch.cuda.is_available()
EAGER_GATED_RESIDUAL = train_parity_ops.gated_residual
GATED_RESIDUAL = "train_parity gated residual"
LINEAR_LORA_UP = "train_parity base GEMM + LoRA-B GEMM + scale-and-add"
LINEAR_LORA_UP_GELU = f"{LINEAR_LORA_UP} + tanh GELU"
LORA_UP = "train_parity LoRA-B GEMM + scale-and-add"
QK_NORM_ROPE = "train_parity Q/K RMSNorm + complex RoPE into the joint Q/K"


@pytest.fixture(autouse=True)
def fresh_gates(monkeypatch):
    for gate in train_parity_kernels.GATES:
        if isinstance(gate, train_parity_kernels.SignatureGates):
            monkeypatch.setattr(gate, "gates", {})
            continue
        monkeypatch.setattr(gate, "disabled", False)
        monkeypatch.setattr(gate, "verified", False)
        monkeypatch.setattr(gate, "verified_sigs", set())
    monkeypatch.setattr(train_parity_kernels, "FUSED_KERNELS", True)
    monkeypatch.setattr(train_parity_kernels, "logger", MagicMock())


def _residual_inputs(device="cpu", batch=2, seq=5, dim=64, gate_dtype=BF16):
    residual = torch.randn(batch, seq, dim, device=device).to(BF16)
    update = torch.randn(batch, seq, dim, device=device).to(BF16)
    # a chunk of a [B, 3 * D] modulation projection: strided rows
    gate = torch.randn(batch, 3 * dim, device=device).to(gate_dtype)[:, dim : 2 * dim]
    return residual, gate.unsqueeze(1), update


def test_bitwise_equal_tells_signed_zeros_apart():
    zero = torch.zeros(3, dtype=BF16)
    assert torch.equal(zero, -zero)
    assert not train_parity_kernels.bitwise_equal(zero, -zero)
    assert train_parity_kernels.bitwise_equal((zero, -zero), (zero.clone(), -zero))


def test_cpu_tensors_run_the_eager_chain(monkeypatch):
    monkeypatch.setattr(kernels, "residual_gate_add_bf16", _never_called)
    residual, gate, update = _residual_inputs()
    out = train_parity_kernels.gated_residual(residual, gate, update)
    assert torch.equal(out, train_parity_ops.gated_residual(residual, gate, update))


def _never_called(*args, **kwargs):
    raise AssertionError("a fused kernel ran")


class _StandIn:
    """A CPU stand-in for a fused kernel: the eager result, nudged by ``ulps`` in its
    first element, or an exception."""

    def __init__(self, ulps=0, error=None):
        self.ulps, self.error, self.calls = ulps, error, 0

    def __call__(self, residual, update, gate):
        self.calls += 1
        if self.error is not None:
            raise self.error
        out = EAGER_GATED_RESIDUAL(residual, gate, update)
        out.view(torch.int16).view(-1)[0] += self.ulps
        return out


@pytest.fixture
def on_the_kernel_path(monkeypatch):
    """CPU tensors take the fused path (unless it is switched off), with a stand-in
    kernel."""
    monkeypatch.setattr(
        train_parity_kernels, "_takes", lambda x: train_parity_kernels.FUSED_KERNELS
    )

    def install(stand_in):
        monkeypatch.setattr(kernels, "residual_gate_add_bf16", stand_in)
        return stand_in

    return install


def test_a_kernel_is_checked_once_per_signature(on_the_kernel_path, monkeypatch):
    kernel = on_the_kernel_path(_StandIn())
    reference = MagicMock(side_effect=train_parity_ops.gated_residual)
    monkeypatch.setattr(train_parity_ops, "gated_residual", reference)
    inputs = _residual_inputs()
    for _ in range(3):
        train_parity_kernels.gated_residual(*inputs)
    assert (kernel.calls, reference.call_count) == (3, 1)
    train_parity_kernels.gated_residual(*_residual_inputs(seq=7))
    assert (kernel.calls, reference.call_count) == (4, 2)
    states = train_parity_kernels.gate_states()[GATED_RESIDUAL]
    assert states == {"disabled": False, "verified_signatures": 2}


@pytest.mark.parametrize(
    "stand_in", [_StandIn(ulps=1), _StandIn(error=RuntimeError("no launch"))]
)
def test_a_kernel_that_differs_is_replaced_for_good(on_the_kernel_path, stand_in):
    kernel = on_the_kernel_path(stand_in)
    inputs = _residual_inputs()
    for _ in range(2):
        out = train_parity_kernels.gated_residual(*inputs)
        assert torch.equal(out, train_parity_ops.gated_residual(*inputs))
    assert kernel.calls == 1
    assert train_parity_kernels.gate_states()[GATED_RESIDUAL]["disabled"]
    (message,), _ = train_parity_kernels.logger.warning_once.call_args
    assert GATED_RESIDUAL in message


def test_a_kernel_writing_negative_zero_is_caught(on_the_kernel_path):
    # x + (-x) in the reference is +0.0; a kernel writing -0.0 must not pass
    residual = torch.tensor([[[1.0, -2.0, 0.5, -0.25]]], dtype=BF16)
    gate = torch.ones(1, 4, dtype=BF16)
    update = -residual

    def negative_zero(residual, update, gate):
        return -EAGER_GATED_RESIDUAL(residual, gate, update)

    on_the_kernel_path(negative_zero)
    out = train_parity_kernels.gated_residual(residual, gate, update)
    assert not out.signbit().any()
    assert train_parity_kernels.gate_states()[GATED_RESIDUAL]["disabled"]


def test_capture_runs_the_eager_chain_until_verified(on_the_kernel_path, monkeypatch):
    kernel = on_the_kernel_path(_StandIn())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    train_parity_kernels.gated_residual(*_residual_inputs())
    assert kernel.calls == 0


def test_the_switch_runs_the_eager_chains(on_the_kernel_path, monkeypatch):
    kernel = on_the_kernel_path(_StandIn(ulps=1))
    monkeypatch.setattr(train_parity_kernels, "FUSED_KERNELS", False)
    inputs = _residual_inputs()
    out = train_parity_kernels.gated_residual(*inputs)
    assert kernel.calls == 0
    assert torch.equal(out, EAGER_GATED_RESIDUAL(*inputs))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` one element past a 16-byte boundary: Triton
    compiles another kernel for it."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    copy = storage[1:].view(t.shape).copy_(t)
    assert copy.data_ptr() % 16 and copy.is_contiguous()
    return copy


def test_a_misaligned_input_is_checked_as_another_signature(
    on_the_kernel_path, monkeypatch
):
    kernel = on_the_kernel_path(_StandIn())
    reference = MagicMock(side_effect=train_parity_ops.gated_residual)
    monkeypatch.setattr(train_parity_ops, "gated_residual", reference)
    residual, gate, update = _residual_inputs()
    for _ in range(2):
        train_parity_kernels.gated_residual(residual, gate, update)
    assert (kernel.calls, reference.call_count) == (2, 1)
    # the same shapes, strides and dtypes at an address Triton specializes apart
    for _ in range(2):
        train_parity_kernels.gated_residual(_misaligned(residual), gate, update)
    assert (kernel.calls, reference.call_count) == (4, 2)
    states = train_parity_kernels.gate_states()[GATED_RESIDUAL]
    assert states == {"disabled": False, "verified_signatures": 2}


@pytest.mark.parametrize("zero_input", [0, 1, 2])
def test_an_all_zero_input_earns_no_credit(on_the_kernel_path, monkeypatch, zero_input):
    """Zeros compare equal whatever a kernel does with them (PEFT's initial
    lora_B): such a call runs the eager chain alone, and the kernel is checked on
    the first call without an all-zero input."""
    kernel = on_the_kernel_path(_StandIn(ulps=1))
    reference = MagicMock(side_effect=train_parity_ops.gated_residual)
    monkeypatch.setattr(train_parity_ops, "gated_residual", reference)
    inputs = list(_residual_inputs())
    zeros = list(inputs)
    zeros[zero_input] = torch.zeros_like(inputs[zero_input])
    for _ in range(3):
        out = train_parity_kernels.gated_residual(*zeros)
        assert torch.equal(out, EAGER_GATED_RESIDUAL(*zeros))
    assert (kernel.calls, reference.call_count) == (0, 3)
    assert train_parity_kernels.gate_states()[GATED_RESIDUAL] == {
        "disabled": False,
        "verified_signatures": 0,
    }
    # the first call with values checks the kernel, which differs here
    out = train_parity_kernels.gated_residual(*inputs)
    assert torch.equal(out, EAGER_GATED_RESIDUAL(*inputs))
    assert (kernel.calls, reference.call_count) == (1, 4)
    assert train_parity_kernels.gate_states()[GATED_RESIDUAL]["disabled"]


def test_a_verified_kernel_runs_on_zeros_without_a_check(on_the_kernel_path):
    kernel = on_the_kernel_path(_StandIn())
    residual, gate, update = _residual_inputs()
    train_parity_kernels.gated_residual(residual, gate, update)
    train_parity_kernels.gated_residual(residual, gate.zero_(), update)
    assert kernel.calls == 2
    assert train_parity_kernels.gate_states()[GATED_RESIDUAL] == {
        "disabled": False,
        "verified_signatures": 1,
    }


def test_a_zero_lora_b_leaves_the_lora_kernel_unchecked(monkeypatch):
    monkeypatch.setattr(train_parity_kernels, "_takes", lambda x: True)
    monkeypatch.setattr(kernels, "can_use_lora_b_scale_add", lambda *operands: True)
    kernel = MagicMock(side_effect=train_parity_ops.add_lora_up)
    monkeypatch.setattr(kernels, "lora_b_scale_add_bf16", kernel)
    out = torch.randn(1, 5, 48).to(BF16)
    down = torch.randn(1, 5, 16).to(BF16)
    lora_B = torch.zeros(48, 16, dtype=BF16)  # as PEFT initialises it
    for _ in range(2):
        train_parity_kernels.add_lora_up(out, down, lora_B, 0.5)
    assert kernel.call_count == 0
    lora_B.normal_()  # a trained adapter, written into the same storage
    train_parity_kernels.add_lora_up(out, down, lora_B, 0.5)
    assert kernel.call_count == 1
    assert train_parity_kernels.gate_states()[
        "train_parity LoRA-B GEMM + scale-and-add"
    ] == {"disabled": False, "verified_signatures": 1}


def _linear_inputs(rows, device="cpu", inner=64, cols=48, rank=16):
    x = torch.randn(1, rows, inner, device=device).to(BF16)
    weight = (torch.randn(cols, inner, device=device) / 8).to(BF16)
    bias = torch.randn(cols, device=device).to(BF16)
    down = (torch.randn(1, rows, rank, device=device) * 4).to(BF16)
    lora_B = (torch.randn(cols, rank, device=device) * 0.02).to(BF16)
    return x, weight, bias, down, lora_B


def _eager_linear_lora_up(x, weight, bias, down, lora_B, scaling):
    out = torch.nn.functional.linear(x, weight, bias)
    return train_parity_ops.add_lora_up(out, down, lora_B, scaling)


def test_the_base_gemm_kernel_keeps_the_eager_chain_only_where_it_differs(
    monkeypatch,
):
    """cuBLAS picks its GEMM per shape, so one shape's mismatch says nothing about
    another's: that shape runs the eager chain from then on, the others the kernel."""
    monkeypatch.setattr(train_parity_kernels, "_takes", lambda x: True)
    monkeypatch.setattr(train_parity_kernels, "_LINEAR_LORA_MIN_ROWS", 1)
    monkeypatch.setattr(kernels, "can_use_linear_lora", lambda *operands: True)

    def stand_in(x, weight, bias, down, lora_B, scaling):
        out = _eager_linear_lora_up(x, weight, bias, down, lora_B, scaling)
        if x.shape[1] == 7:
            out.view(torch.int16).view(-1)[0] += 1
        return out

    kernel = MagicMock(side_effect=stand_in)
    monkeypatch.setattr(kernels, "linear_lora_bf16", kernel)
    for rows in (5, 7, 5, 7):
        inputs = _linear_inputs(rows)
        out = train_parity_kernels.linear_add_lora_up(*inputs, 0.75)
        assert torch.equal(out, _eager_linear_lora_up(*inputs, 0.75))
    assert kernel.call_count == 3  # 5 rows: checked, then run; 7 rows: checked once
    assert train_parity_kernels.gate_states()[LINEAR_LORA_UP] == {
        "disabled": False,
        "verified_signatures": 1,
        "differing_signatures": 1,
    }
    (message,), _ = train_parity_kernels.logger.warning_once.call_args
    assert f"{LINEAR_LORA_UP} at (1, 7, 64)" in message


def test_the_base_gemm_kernel_is_checked_per_bias_alignment(monkeypatch):
    monkeypatch.setattr(train_parity_kernels, "_takes", lambda x: True)
    monkeypatch.setattr(train_parity_kernels, "_LINEAR_LORA_MIN_ROWS", 1)
    monkeypatch.setattr(kernels, "can_use_linear_lora", lambda *operands: True)
    kernel = MagicMock(side_effect=_eager_linear_lora_up)
    monkeypatch.setattr(kernels, "linear_lora_bf16", kernel)
    x, weight, bias, down, lora_B = _linear_inputs(5)
    for bias_ in (bias, bias, _misaligned(bias)):
        train_parity_kernels.linear_add_lora_up(x, weight, bias_, down, lora_B, 0.75)
    assert train_parity_kernels.gate_states()[LINEAR_LORA_UP] == {
        "disabled": False,
        "verified_signatures": 2,
        "differing_signatures": 0,
    }


def _eager_linear_lora_up_gelu(x, weight, bias, down, lora_B, scaling):
    return torch.nn.functional.gelu(
        _eager_linear_lora_up(x, weight, bias, down, lora_B, scaling),
        approximate="tanh",
    )


@pytest.fixture
def on_the_gelu_kernel_path(monkeypatch):
    """CPU operands of any size take the GELU kernel's path (a stand-in kernel), its
    GELU not yet checked; the reference runs the eager chain."""
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    monkeypatch.setattr(train_parity_kernels, "_takes", lambda x: True)
    monkeypatch.setattr(train_parity_kernels, "_LINEAR_LORA_GELU_MIN_ROWS", 1)
    monkeypatch.setattr(kernels, "can_use_linear_lora_gelu", lambda *operands: True)
    monkeypatch.setattr(kernels, "can_use_lora_b_scale_add", lambda *operands: False)


def test_the_gelu_kernel_is_checked_per_shape_and_on_every_bf16_input(
    on_the_gelu_kernel_path, monkeypatch
):
    """The MLP up-projection's kernel: its GELU is checked once on every BF16 input
    (through the kernel, as a zero GEMM's bias), then the kernel per shape as the
    base GEMM kernel is; a shape it differs on keeps the eager chain."""
    shapes = []

    def stand_in(x, weight, bias, down, lora_B, scaling):
        shapes.append(tuple(x.shape))
        out = _eager_linear_lora_up_gelu(x, weight, bias, down, lora_B, scaling)
        if x.shape[1] == 7:
            out.view(torch.int16).view(-1)[0] += 1
        return out

    monkeypatch.setattr(kernels, "linear_lora_gelu_bf16", stand_in)
    for rows in (5, 7, 5, 7):
        inputs = _linear_inputs(rows)
        out = train_parity_kernels.linear_add_lora_up(*inputs, 0.75, gelu_tanh=True)
        assert torch.equal(out, _eager_linear_lora_up_gelu(*inputs, 0.75))
    # every finite BF16 value once, then 5 rows: checked, then run; 7 rows: checked
    assert shapes == [(128, 64), (1, 5, 64), (1, 7, 64), (1, 5, 64)]
    assert train_parity_kernels.gate_states()[LINEAR_LORA_UP_GELU] == {
        "disabled": False,
        "verified_signatures": 1,
        "differing_signatures": 1,
    }
    (message,), _ = train_parity_kernels.logger.warning_once.call_args
    assert f"{LINEAR_LORA_UP_GELU} at (1, 7, 64)" in message


def test_a_gelu_kernel_whose_lookup_differs_is_not_used(
    on_the_gelu_kernel_path, monkeypatch
):
    """Control for the check over every BF16 input: a lookup wrong on one value that
    the call's data lacks turns the kernel off before its first output is used."""

    def stand_in(x, weight, bias, down, lora_B, scaling):
        out = _eager_linear_lora_up_gelu(x, weight, bias, down, lora_B, scaling)
        out.view(torch.int16)[..., bias == 3.0] += 1
        return out

    monkeypatch.setattr(kernels, "linear_lora_gelu_bf16", stand_in)
    inputs = _linear_inputs(5)
    for _ in range(2):
        out = train_parity_kernels.linear_add_lora_up(*inputs, 0.75, gelu_tanh=True)
        assert torch.equal(out, _eager_linear_lora_up_gelu(*inputs, 0.75))
    assert train_parity_kernels.gate_states()[LINEAR_LORA_UP_GELU] == {
        "disabled": False,
        "verified_signatures": 0,
        "differing_signatures": 1,
    }
    (message,), _ = train_parity_kernels.logger.warning_once.call_args
    assert (
        LINEAR_LORA_UP_GELU in message
        and "differs from aten's on 1 of 65280" in message
    )


def test_eager_joint_qk_norm_rope_is_the_attention_chain():
    from sglang.multimodal_gen.runtime.layers.layernorm import RMSNorm
    from sglang.multimodal_gen.runtime.utils import train_parity

    with train_parity.numerics_mode_context("train_parity"):
        norms = [RMSNorm(128, eps=1e-6).to(BF16) for _ in range(4)]
    for norm in norms:
        norm.weight.data.uniform_(0.8, 1.2)
    parts = []
    for length, (q_norm, k_norm) in ((3, norms[:2]), (5, norms[2:])):
        angles = torch.randn(length, 64)
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = (torch.randn(2, length, 2, 128).to(BF16) for _ in range(2))
        parts.append((q, k, q_norm, k_norm, freqs))
    query, key = train_parity_kernels.joint_qk_norm_rope(parts)
    for joint, index, norm_index in ((query, 0, 2), (key, 1, 3)):
        expected = torch.cat(
            [
                train_parity_ops.rotary_emb(part[norm_index](part[index]), part[4])
                for part in parts
            ],
            dim=1,
        )
        assert torch.equal(joint, expected)


GELU_GATE = "train_parity LoRA-B GEMM + scale-and-add + tanh GELU"


@pytest.mark.parametrize("differing_value", [None, 3.0])
def test_the_gelu_epilogue_is_checked_on_every_bf16_input(
    on_the_kernel_path, monkeypatch, differing_value
):
    """The first call's data lacks ``differing_value``; the check over every BF16
    input still finds the kernel's GELU wrong there and turns the kernel off."""
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    monkeypatch.setattr(kernels, "can_use_lora_b_scale_add", lambda *args: True)
    calls = []

    def stand_in(base, down, lora_B, scale, gelu_tanh=False):
        calls.append(base.shape)
        out = train_parity_kernels._add_lora_up(base, down, lora_B, scale, gelu_tanh)
        out.view(torch.int16)[base == differing_value] += 1
        return out

    monkeypatch.setattr(kernels, "lora_b_scale_add_bf16", stand_in)
    base = torch.rand(2, 5, 128).to(BF16)  # values in [0, 1)
    down = torch.randn(2, 5, 16).to(BF16)
    lora_B = torch.randn(128, 16).to(BF16)
    expected = torch.nn.functional.gelu(
        train_parity_ops.add_lora_up(base, down, lora_B, 0.5), approximate="tanh"
    )
    for _ in range(2):
        out = train_parity_kernels.add_lora_up(base, down, lora_B, 0.5, gelu_tanh=True)
        assert torch.equal(out, expected)
    disabled = train_parity_kernels.gate_states()[GELU_GATE]["disabled"]
    if differing_value is None:
        assert not disabled and calls == [(510, 128), (2, 5, 128), (2, 5, 128)]
        return
    assert disabled and calls == [(510, 128)]
    (message,), _ = train_parity_kernels.logger.warning_once.call_args
    assert GELU_GATE in message and "differs from aten's on 1 of 65280" in message


# Index math under Triton's interpreter. The interpreter computes an FMA in two roundings
# and truncates fp32 -> bf16, so values are checked to a few bf16 ULPs of the operands
# here; the bits are checked on CUDA below. Each run also checks a control: the same
# comparison against an off-by-one token or batch mapping fails.
_INTERPRETED = textwrap.dedent(
    """
    import torch, triton
    from sglang.kernels.ops.diffusion.gemm import lora_b_scale_add_triton as lb
    from sglang.kernels.ops.diffusion.modulate import add_product_triton as ap
    from sglang.kernels.ops.diffusion.rope import qknorm_complex_rope_joint_triton as qk

    def close(a, b):
        return bool(((a.float() - b.float()).abs() <= (b.float().abs() + 1) * 2**-5).all())

    torch.manual_seed(0)
    B, S, H, D, joint, offset = 2, 5, 3, 128, 11, 4
    q, k = (torch.randn(B, S, H, D).bfloat16() for _ in range(2))
    weights = [(torch.rand(D) * 0.4 + 0.8).bfloat16() for _ in range(2)]
    angles = torch.randn(S, D // 2)
    rope = torch.polar(torch.ones_like(angles), angles)

    def expected(x, w, table):
        var = x.float().pow(2).mean(-1, keepdim=True)
        y = (x * torch.rsqrt(var + 1e-6)).bfloat16() * w
        z = torch.view_as_complex(y.float().reshape(B, S, H, D // 2, 2)) * table[:, None]
        return torch.view_as_real(z).reshape(B, S, H, D).bfloat16()

    for heads_per_group in (4, 2):  # a group past the last head; two groups, the second part
        outs = [torch.full((B, joint, H, D), float("nan")).bfloat16() for _ in range(2)]
        qk._qknorm_complex_rope_joint_kernel[(B * S, 2)](
            q, k, *weights, torch.view_as_real(rope), *outs, S, joint, offset, 1e-6,
            HEADS=H, ROWS=heads_per_group, FUSE_REAL_SIN=True)
        for out, x, w in zip(outs, (q, k), weights):
            assert out[:, :offset].isnan().all() and out[:, offset + S:].isnan().all()
            assert close(out[:, offset:offset + S], expected(x, w, rope))
            assert not close(out[:, offset:offset + S], expected(x, w, rope.roll(1, 0)))

    for gate_dtype in (torch.bfloat16, torch.float32):
        a, b = (torch.randn(B, S, 70).bfloat16() for _ in range(2))
        gate = torch.randn(B, 3 * 70).to(gate_dtype)[:, 70:140]
        out = torch.empty_like(a)
        ap._add_product_kernel[(B * S, 1)](
            out, a, b, gate, 70, S, gate.stride(0), BLOCK=128,
            ROUND_PRODUCT=gate_dtype == torch.bfloat16)
        assert close(out, (a + gate[:, None] * b).bfloat16())
        assert not close(out, (a + gate.flip(0)[:, None] * b).bfloat16())

    rows, cols, rank = 130, 200, 32  # a partial row tile and a partial column tile
    base = torch.randn(rows, cols).bfloat16()
    down = torch.randn(rows, rank).bfloat16()
    lora_b = (torch.randn(cols, rank) * 0.1).bfloat16()
    out = torch.full_like(base, float("nan"))
    # The interpreter's tl.dot misreads BF16 operands (Triton 3.8): FP32 ones here.
    lb._lora_b_scale_add_kernel[(triton.cdiv(rows, 128), triton.cdiv(cols, 128))](
        out, base, down.float(), lora_b.float(), out, 1.5, rows, cols, RANK=rank,
        GELU_TANH=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=16)
    summed = base + torch.nn.functional.linear(down, lora_b) * 1.5
    assert close(out, summed)
    assert not close(out, base + torch.nn.functional.linear(down, lora_b.flip(1)) * 1.5)
    # the GELU looks the BF16 sum up by its bits; control: the table with its halves
    # swapped (each value reads the GELU of its negation) fails
    table = lb.gelu_tanh_table(torch.device("cpu"))
    for gelu_table, equal in ((table, True), (table.roll(2**15), False)):
        lb._lora_b_scale_add_kernel[(triton.cdiv(rows, 128), triton.cdiv(cols, 128))](
            out, base, down.float(), lora_b.float(), gelu_table, 1.5, rows, cols,
            RANK=rank, GELU_TANH=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=16)
        gelu = torch.nn.functional.gelu(summed.bfloat16(), approximate="tanh")
        assert close(out, gelu) == equal

    # The base GEMM kernel, persistent (fewer programs than tiles), with one and two
    # epilogue parts; the interpreter reads BF16 tensor descriptors wrongly (Triton
    # 3.8), so FP32 operands, and the roundings are FP32 ones here. Triton 3.6's
    # interpreter fails on the kernel's tl.range (int() of a one-element array).
    if tuple(map(int, triton.__version__.split(".")[:2])) < (3, 8):
        print("ok")
        raise SystemExit
    from triton.tools.tensor_descriptor import TensorDescriptor
    from sglang.kernels.ops.diffusion.gemm import linear_lora_triton as ll

    rows, inner, cols, rank = 130, 96, 200, 32
    x, weight = torch.randn(rows, inner), torch.randn(cols, inner) * 0.1
    bias, down, lora_b = torch.randn(cols), torch.randn(rows, rank), torch.randn(cols, rank) * 0.1
    linear = torch.nn.functional.linear
    expected = linear(x, weight, bias) + linear(down, lora_b) * 1.5
    for parts, programs in ((1, 3), (2, 5)):
        out = torch.full((rows, cols), float("nan"))
        ll._linear_lora_kernel[(programs,)](
            TensorDescriptor.from_tensor(x, [64, 32]),
            TensorDescriptor.from_tensor(weight, [64, 32]), bias,
            TensorDescriptor.from_tensor(out, [64, 64 // parts]),
            TensorDescriptor.from_tensor(down, [64, rank]),
            TensorDescriptor.from_tensor(lora_b, [64 // parts, rank]),
            rows, cols, inner, 1.5, programs, BLOCK_M=64, BLOCK_N=64,
            BLOCK_K=32, GROUP_M=2, EPILOGUE_PARTS=parts, WARP_SPECIALIZE=False)
        assert close(out, expected)
        assert not close(out, linear(x, weight, bias.flip(0)) + linear(down, lora_b) * 1.5)
    print("ok")
    """
)


def test_kernel_index_math_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETED],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def _qk_reduction_lane_layout(rows: int, num_warps: int) -> dict[str, int]:
    """How the Q/K kernel, compiled for sm_90 (no GPU needed), lays out the
    32 lane partials it sums per row: size per thread, threads per warp and
    warps along that dimension."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang.kernels.ops.diffusion.rope import qknorm_complex_rope_joint_triton as qk

    kernel = qk._qknorm_complex_rope_joint_kernel
    types = {
        "rope_ptr": "*fp32",
        "eps": "fp32",
        "HEADS": "constexpr",
        "ROWS": "constexpr",
        "FUSE_REAL_SIN": "constexpr",
    }
    names = kernel.arg_names
    source = ASTSource(
        kernel,
        {n: types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names},
        {"HEADS": 24, "ROWS": rows, "FUSE_REAL_SIN": True},
        attrs={
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(names)
            if n.endswith("_ptr")
        },
    )
    # the launch's options (qknorm_complex_rope_joint_)
    options = dict(
        num_warps=num_warps, enable_fp_fusion=False, enable_reflect_ftz=False
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ttgir = compiled.asm["ttgir"]
    # the sum's operand: [rows, 32], a slice of a 4-D blocked layout
    operand = re.search(
        r'"tt\.reduce".*?\}\) : \(tensor<\d+x32xf32, (.*?)\)\s*->', ttgir, re.S
    )
    parent = re.search(r"#blocked\d*", operand[1])[0]
    dims = list(range(4))
    for sliced in reversed([int(d) for d in re.findall(r"dim = (\d+)", operand[1])]):
        del dims[sliced]
    fields = re.search(re.escape(parent) + r" = #ttg\.blocked<\{(.*?)\}>", ttgir)[1]
    return {
        name: [int(v) for v in values.split(",")][dims[1]]
        for name, values in re.findall(r"(\w+) = \[([\d, ]+)\]", fields)
        if name != "order"
    }


def test_qk_kernel_sums_each_row_over_the_32_lanes_of_one_warp():
    # aten's tree (lane float4s, then shfl offsets 16..1) needs each row's 32
    # partials on the 32 lanes of one warp; Triton picks the layout, and 3.6
    # picked four warps per row for a [rows, 32, 4] load (docs/results.md, run 9)
    one_warp = {"sizePerThread": 1, "threadsPerWarp": 32, "warpsPerCTA": 1}
    for rows in (4, 8):
        assert _qk_reduction_lane_layout(rows, num_warps=rows) == one_warp
    # control: more warps than rows split each row over two warps
    assert _qk_reduction_lane_layout(4, num_warps=8) != one_warp


# CUDA: each kernel against its eager chain, bitwise, on the widths of Qwen-Image and on
# odd shapes, with a control computed with another rounding.
needs_cuda = pytest.mark.skipif(not CUDA, reason="the fused kernels run on CUDA")


def _adversarial_(x: torch.Tensor) -> torch.Tensor:
    """Where ``x`` has 16 rows or more: rows of zeros, signed zeros, large and tiny
    magnitudes (fp32-subnormal squares), and bf16 rounding ties; the rest stay random.
    """
    flat = x.view(-1, x.shape[-1])
    if flat.shape[0] >= 16:
        flat[0] = 0
        flat[1] = -0.0
        flat[2] *= 2.0**60
        flat[3] *= 2.0**-70
        flat[4] = 1 + 2.0**-8  # exactly between two bf16 values once rounded
    return x


@needs_cuda
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("seq", [1, 77, 211, 1023])
@pytest.mark.parametrize("dim", [3072, 1000])
def test_layer_norm_modulation_kernel(batch, seq, dim):
    x = _adversarial_(torch.randn(batch, seq, dim, device="cuda")).to(BF16)
    mod = torch.randn(batch, 6 * dim, device="cuda").to(BF16)
    shift, scale = mod[:, :dim], mod[:, dim : 2 * dim]
    for shift_ in (shift, None):
        eager = train_parity_ops.layer_norm_scale_shift(x, shift_, scale, 1e-6)
        fused = kernels.fused_layernorm_autocast_modulate(x, scale, shift_, 1e-6)
        assert train_parity_kernels.bitwise_equal(fused, eager)
    control = kernels.fused_layernorm_modulate_raw(x, scale, shift, 1e-6)
    assert not torch.equal(control, eager)  # bf16 after every op


@needs_cuda
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("seq", [1, 77, 4096])
@pytest.mark.parametrize("gate_dtype", [BF16, torch.float32])
def test_gated_residual_kernel(batch, seq, gate_dtype):
    residual, gate, update = _residual_inputs("cuda", batch, seq, 3072, gate_dtype)
    _adversarial_(update)
    eager = train_parity_ops.gated_residual(residual, gate, update)
    fused = kernels.residual_gate_add_bf16(residual, update, gate[:, 0])
    assert train_parity_kernels.bitwise_equal(fused, eager)
    # control: the other variant's rounding of the same values
    if gate_dtype == BF16:
        control = (residual.float() + gate.float() * update.float()).to(BF16)
    else:
        control = residual + (gate * update).to(BF16)
    assert not torch.equal(control, eager)


def _lora_down(rows, rank, device="cuda"):
    """A LoRA-A output with a wide dynamic range, so the order in which the rank is
    summed shows in the bits; zero and -0.0 rows where there are enough rows."""
    magnitude = torch.exp(torch.randn(rows, rank, device=device) * 3)
    down = (magnitude * torch.randn(rows, rank, device=device).sign()).to(BF16)
    if rows >= 16:
        down[0], down[1] = 0.0, -0.0
    return down


@needs_cuda
@pytest.mark.parametrize(
    "shape",
    [
        (1, 4096, 3072),
        (1, 4096, 12288),
        (2, 211, 3072),
        (1, 77, 12288),
        (1, 1, 3072),
        (2, 333, 1000),
    ],
)
@pytest.mark.parametrize("rank", [16, 64, 128])
@pytest.mark.parametrize("scaling", [2.0, 1 / 3])
def test_lora_b_scale_add_kernel(shape, rank, scaling):
    base = _adversarial_(torch.randn(shape, device="cuda")).to(BF16)
    down = _lora_down(base.numel() // shape[-1], rank).view(*shape[:-1], rank)
    lora_B = (torch.randn(shape[-1], rank, device="cuda") * 0.02).to(BF16)
    eager = train_parity_ops.add_lora_up(base, down, lora_B, scaling)
    fused = kernels.lora_b_scale_add_bf16(base, down, lora_B, scaling)
    assert train_parity_kernels.bitwise_equal(fused, eager)
    if rank == 16 or base.numel() // shape[-1] < 64:
        # one 16-wide MMA step sums its products at once: the order shows only across
        # steps, and only given enough products
        return
    # control: the same products summed over the rank in reverse order
    reversed_order = train_parity_ops.add_lora_up(
        base, down.flip(-1), lora_B.flip(-1), scaling
    )
    assert not torch.equal(fused, reversed_order)


@needs_cuda
@pytest.mark.parametrize(
    "shape", [(1, 4096, 12288), (2, 211, 12288), (1, 77, 12288), (2, 333, 1000)]
)
def test_lora_b_scale_add_gelu_tanh_kernel(shape):
    base = _adversarial_(torch.randn(shape, device="cuda")).to(BF16)
    down = _lora_down(base.numel() // shape[-1], 64).view(*shape[:-1], 64)
    lora_B = (torch.randn(shape[-1], 64, device="cuda") * 0.02).to(BF16)
    eager = torch.nn.functional.gelu(
        train_parity_ops.add_lora_up(base, down, lora_B, 2.0), approximate="tanh"
    )
    fused = kernels.lora_b_scale_add_bf16(base, down, lora_B, 2.0, gelu_tanh=True)
    assert train_parity_kernels.bitwise_equal(fused, eager)


@needs_cuda
@pytest.mark.parametrize(
    "shape",  # batch, rows, in, out: Qwen-Image's image and text streams, odd sizes
    [
        (1, 4096, 3072, 3072),
        (1, 4096, 3072, 12288),
        (1, 4096, 12288, 3072),
        (2, 211, 3072, 3072),
        (2, 211, 12288, 3072),
        (1, 1024, 3072, 12288),
        (1, 333, 1024, 1000),
    ],
)
def test_linear_lora_kernel(shape):
    _check_linear_kernel(shape, kernels.linear_lora_bf16, _eager_linear_lora_up)


def _check_linear_kernel(shape, kernel, eager_chain):
    batch, rows, inner, cols = shape
    x = _adversarial_(torch.randn(batch, rows, inner, device="cuda")).to(BF16)
    weight = (torch.randn(cols, inner, device="cuda") * inner**-0.5).to(BF16)
    bias = (torch.randn(cols, device="cuda") * 0.1).to(BF16)
    down = _lora_down(batch * rows, 64).view(batch, rows, 64)
    lora_B = (torch.randn(cols, 64, device="cuda") * 0.02).to(BF16)
    eager = eager_chain(x, weight, bias, down, lora_B, 2.0)
    fused = kernel(x, weight, bias, down, lora_B, 2.0)
    assert train_parity_kernels.bitwise_equal(fused, eager)
    # control: the same products summed over K in reverse order
    reversed_order = eager_chain(x.flip(-1), weight.flip(-1), bias, down, lora_B, 2.0)
    assert not torch.equal(fused, reversed_order)


@needs_cuda
def test_linear_add_lora_up_takes_the_kernel_and_verifies_it():
    inputs = _linear_inputs(4096, device="cuda", inner=3072, cols=3072, rank=64)
    with torch.no_grad():
        fused = train_parity_kernels.linear_add_lora_up(*inputs, 2.0)
    assert train_parity_kernels.bitwise_equal(
        fused, _eager_linear_lora_up(*inputs, 2.0)
    )
    assert train_parity_kernels.gate_states()[LINEAR_LORA_UP] == {
        "disabled": False,
        "verified_signatures": 1,
        "differing_signatures": 0,
    }


needs_hopper = pytest.mark.skipif(
    not (CUDA and torch.cuda.get_device_capability() == (9, 0)),
    reason="the GELU kernel runs on Hopper",
)


@needs_hopper
@pytest.mark.parametrize(
    "shape",  # batch, rows, in, out: Qwen-Image's MLP at 1024x1024, batch 2, 512x512
    [
        (1, 4096, 3072, 12288),
        (2, 4096, 3072, 12288),
        (1, 1024, 3072, 12288),
        (2, 2000, 3072, 12288),
        (1, 333, 1024, 1000),
    ],
)
def test_linear_lora_gelu_kernel(shape):
    _check_linear_kernel(
        shape, kernels.linear_lora_gelu_bf16, _eager_linear_lora_up_gelu
    )


@needs_hopper
def test_linear_add_lora_up_takes_the_gelu_kernel_and_verifies_it(monkeypatch):
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    inputs = _linear_inputs(4096, device="cuda", inner=3072, cols=12288, rank=64)
    with torch.no_grad():
        fused = train_parity_kernels.linear_add_lora_up(*inputs, 2.0, gelu_tanh=True)
    assert train_parity_kernels.bitwise_equal(
        fused, _eager_linear_lora_up_gelu(*inputs, 2.0)
    )
    assert train_parity_kernels.gate_states()[LINEAR_LORA_UP_GELU] == {
        "disabled": False,
        "verified_signatures": 1,
        "differing_signatures": 0,
    }


@needs_hopper
def test_gelu_kernel_matches_aten_on_every_bf16_input(monkeypatch):
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    device = torch.device("cuda", 0)
    train_parity_kernels._check_gelu_tanh_on_every_bf16(device, linear=True)
    # control: the same check against the erf GELU fails
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    gelu = torch.nn.functional.gelu
    monkeypatch.setattr(train_parity_kernels.F, "gelu", lambda x, approximate: gelu(x))
    with pytest.raises(RuntimeError, match="differs from aten's"):
        train_parity_kernels._check_gelu_tanh_on_every_bf16(device, linear=True)


@needs_cuda
def test_gelu_epilogue_matches_aten_on_every_bf16_input(monkeypatch):
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    train_parity_kernels._check_gelu_tanh_on_every_bf16(torch.device("cuda", 0))
    # control: the same check against the erf GELU fails
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    gelu = torch.nn.functional.gelu
    monkeypatch.setattr(train_parity_kernels.F, "gelu", lambda x, approximate: gelu(x))
    with pytest.raises(RuntimeError, match="differs from aten's"):
        train_parity_kernels._check_gelu_tanh_on_every_bf16(torch.device("cuda", 0))


@needs_cuda
def test_lora_up_takes_the_kernel_and_verifies_it():
    base = torch.randn(2, 211, 3072, device="cuda").to(BF16)
    down = _lora_down(2 * 211, 64).view(2, 211, 64)
    lora_B = (torch.randn(3072, 64, device="cuda") * 0.02).to(BF16)
    with torch.no_grad():
        fused = train_parity_kernels.add_lora_up(base, down, lora_B, 2.0)
    eager = train_parity_ops.add_lora_up(base, down, lora_B, 2.0)
    assert train_parity_kernels.bitwise_equal(fused, eager)
    assert train_parity_kernels.gate_states()[
        "train_parity LoRA-B GEMM + scale-and-add"
    ] == {"disabled": False, "verified_signatures": 1}


@needs_cuda
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("lengths", [(211, 4096), (77, 1024), (7, 13), (1, 3)])
def test_joint_qk_norm_rope_kernel(batch, lengths, monkeypatch):
    from sglang.kernels.ops.diffusion.rope import qknorm_complex_rope_joint_triton
    from sglang.multimodal_gen.runtime.layers.layernorm import RMSNorm
    from sglang.multimodal_gen.runtime.utils import train_parity

    heads = 24
    with train_parity.numerics_mode_context("train_parity"):
        norms = [RMSNorm(128, eps=1e-6).to("cuda", BF16) for _ in range(4)]
    for norm in norms:
        norm.weight.data.uniform_(0.8, 1.2)
    parts = []
    for length, (q_norm, k_norm) in zip(lengths, (norms[:2], norms[2:])):
        angles = torch.randn(length, 64, device="cuda") * 100
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = (
            _adversarial_(torch.randn(batch, length, heads, 128, device="cuda")).to(
                BF16
            )
            for _ in range(2)
        )
        parts.append((q, k, q_norm, k_norm, freqs))
    eager = [
        torch.cat(
            [
                train_parity_ops.rotary_emb(part[norm](part[index]), part[4])
                for part in parts
            ],
            dim=1,
        )
        for index, norm in ((0, 2), (1, 3))
    ]
    with torch.no_grad():
        fused = train_parity_kernels.joint_qk_norm_rope(parts)
    assert train_parity_kernels.bitwise_equal(fused, eager)
    assert train_parity_kernels.gate_states()[
        "train_parity Q/K RMSNorm + complex RoPE into the joint Q/K"
    ] == {"disabled": False, "verified_signatures": 2}
    if sum(lengths) < 100:
        return  # too few products for the control to be sure to show
    # control: the other imaginary-part FMA of the complex multiply
    fuse_real_sin = qknorm_complex_rope_joint_triton._fuse_real_sin(fused[0].device)
    monkeypatch.setattr(
        qknorm_complex_rope_joint_triton,
        "_fuse_real_sin",
        lambda device: not fuse_real_sin,
    )
    joint_q = torch.empty_like(eager[0])
    joint_k = torch.empty_like(eager[1])
    offset = 0
    for q, k, q_norm, k_norm, freqs in parts:
        kernels.qknorm_complex_rope_joint_(
            q, k, q_norm.weight, k_norm.weight, freqs, 1e-6, joint_q, joint_k, offset
        )
        offset += q.shape[1]
    assert not torch.equal(joint_q, eager[0])


def _qk_case():
    from sglang.multimodal_gen.runtime.layers.layernorm import RMSNorm
    from sglang.multimodal_gen.runtime.utils import train_parity

    with train_parity.numerics_mode_context("train_parity"):
        q_norm, k_norm = (RMSNorm(128, eps=1e-6).to("cuda", BF16) for _ in range(2))
    angles = torch.randn(77, 64, device="cuda") * 100
    freqs = torch.polar(torch.ones_like(angles), angles)
    q, k = (torch.randn(2, 77, 24, 128, device="cuda").to(BF16) for _ in range(2))

    def call(q, k, freqs):
        return train_parity_kernels.joint_qk_norm_rope([(q, k, q_norm, k_norm, freqs)])

    def eager(q, k, freqs):
        return train_parity_kernels._qk_norm_rope(q, k, q_norm, k_norm, freqs)

    return call, eager, [q, k, freqs], 0


def _layer_norm_case():
    x = torch.randn(2, 77, 3072, device="cuda").to(BF16)
    mod = torch.randn(2, 6 * 3072, device="cuda").to(BF16)
    shift, scale = mod[:, :3072], mod[:, 3072 : 2 * 3072]

    def call(x, shift, scale):
        return train_parity_kernels.layer_norm_scale_shift(x, shift, scale, 1e-6)

    def eager(x, shift, scale):
        return train_parity_ops.layer_norm_scale_shift(x, shift, scale, 1e-6)

    return call, eager, [x, shift, scale], 0


def _gated_residual_case():
    return (
        train_parity_kernels.gated_residual,
        EAGER_GATED_RESIDUAL,
        list(_residual_inputs("cuda", 2, 77, 3072)),
        0,
    )


def _lora_up_case(gelu_tanh=False):
    out = torch.randn(2, 211, 3072, device="cuda").to(BF16)
    down = _lora_down(2 * 211, 64).view(2, 211, 64)
    lora_B = (torch.randn(3072, 64, device="cuda") * 0.02).to(BF16)

    def call(out, down, lora_B):
        return train_parity_kernels.add_lora_up(out, down, lora_B, 2.0, gelu_tanh)

    def eager(out, down, lora_B):
        return train_parity_kernels._add_lora_up(out, down, lora_B, 2.0, gelu_tanh)

    return call, eager, [out, down, lora_B], 2


def _linear_case(gelu_tanh=False):
    rows, cols = (1024, 12288) if gelu_tanh else (4096, 3072)
    inputs = _linear_inputs(rows, device="cuda", inner=3072, cols=cols, rank=64)
    eager_chain = _eager_linear_lora_up_gelu if gelu_tanh else _eager_linear_lora_up

    def call(*operands):
        return train_parity_kernels.linear_add_lora_up(
            *operands, 2.0, gelu_tanh=gelu_tanh
        )

    # the bias: a TMA operand at such an address is refused before any check
    return call, partial(eager_chain, scaling=2.0), list(inputs), 2


KERNEL_CASES = {
    QK_NORM_ROPE: (_qk_case, needs_cuda),
    "train_parity LayerNorm + scale/shift modulation": (_layer_norm_case, needs_cuda),
    GATED_RESIDUAL: (_gated_residual_case, needs_cuda),
    LORA_UP: (_lora_up_case, needs_cuda),
    f"{LORA_UP} + tanh GELU": (partial(_lora_up_case, gelu_tanh=True), needs_cuda),
    LINEAR_LORA_UP: (_linear_case, needs_hopper),
    LINEAR_LORA_UP_GELU: (partial(_linear_case, gelu_tanh=True), needs_hopper),
}


@pytest.mark.parametrize(
    "gate", [pytest.param(name, marks=mark) for name, (_, mark) in KERNEL_CASES.items()]
)
def test_each_kernel_is_checked_per_alignment_and_not_on_zeros(gate, monkeypatch):
    """Every kernel's check through its train_parity_kernels entry point: a call
    whose first input is all zeros runs the eager chain and verifies nothing; a
    misaligned copy of an input is checked as a signature of its own."""
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    call, eager, inputs, moved = KERNEL_CASES[gate][0]()
    misaligned = list(inputs)
    misaligned[moved] = _misaligned(inputs[moved])

    def verified(operands, compare=True):
        with torch.no_grad():
            out = call(*operands)
        assert not compare or train_parity_kernels.bitwise_equal(out, eager(*operands))
        return train_parity_kernels.gate_states()[gate]["verified_signatures"]

    zeros = [torch.zeros_like(inputs[0]), *inputs[1:]]
    assert [verified(zeros) for _ in range(2)] == [0, 0]
    assert verified(inputs) == 1
    assert verified(misaligned) == 2
    assert verified(misaligned) == 2
    # control: keyed without the alignment, the misaligned call would have run
    # the build Triton compiles for it unchecked
    monkeypatch.setattr(
        train_parity_kernels,
        "_signature",
        lambda *ts: tuple((t.shape, t.stride(), t.dtype, t.device) for t in ts),
    )
    for gate_ in train_parity_kernels.GATES:
        if isinstance(gate_, train_parity_kernels.SignatureGates):
            gate_.gates.clear()
        else:
            gate_.verified_sigs.clear()
    assert verified(inputs) == 1
    assert verified(misaligned, compare=False) == 1
