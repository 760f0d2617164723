# SPDX-License-Identifier: Apache-2.0
"""The train_parity LayerNorm + modulation and gated residual kernels: the residual
kernel's index math under Triton's interpreter (on the CPU), and on CUDA each kernel
bitwise against its eager chain, with a control that rounds elsewhere."""

import pytest
import torch

from sglang.kernels.ops import diffusion as kernels
from sglang.multimodal_gen.runtime.layers import train_parity_kernels, train_parity_ops

BF16 = torch.bfloat16

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernels run on CUDA"
)


def test_gated_residual_index_math_under_the_triton_interpreter(
    run_under_triton_interpreter,
):
    # control: the gate rows of the other batch entries fail the same comparison
    run_under_triton_interpreter(
        """
        from sglang.kernels.ops.diffusion.modulate import add_product_triton as ap

        B, S = 2, 5
        for gate_dtype in (torch.bfloat16, torch.float32):
            a, b = (torch.randn(B, S, 70).bfloat16() for _ in range(2))
            gate = torch.randn(B, 3 * 70).to(gate_dtype)[:, 70:140]
            out = torch.empty_like(a)
            ap._add_product_kernel[(B * S, 1)](
                out, a, b, gate, 70, S, gate.stride(0), BLOCK=128,
                ROUND_PRODUCT=gate_dtype == torch.bfloat16)
            assert close(out, (a + gate[:, None] * b).bfloat16())
            assert not close(out, (a + gate.flip(0)[:, None] * b).bfloat16())
        print("ok")
        """
    )


@needs_cuda
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("seq", [1, 77, 211, 1023])
@pytest.mark.parametrize("dim", [3072, 1000])
def test_layer_norm_modulation_kernel(batch, seq, dim, adversarial):
    x = adversarial(torch.randn(batch, seq, dim, device="cuda")).to(BF16)
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
def test_gated_residual_kernel(batch, seq, gate_dtype, residual_inputs, adversarial):
    residual, gate, update = residual_inputs("cuda", batch, seq, 3072, gate_dtype)
    adversarial(update)
    eager = train_parity_ops.gated_residual(residual, gate, update)
    fused = kernels.residual_gate_add_bf16(residual, update, gate[:, 0])
    assert train_parity_kernels.bitwise_equal(fused, eager)
    # control: the other variant's rounding of the same values
    if gate_dtype == BF16:
        control = (residual.float() + gate.float() * update.float()).to(BF16)
    else:
        control = residual + (gate * update).to(BF16)
    assert not torch.equal(control, eager)
