# SPDX-License-Identifier: Apache-2.0
"""The train_parity Q/K RMSNorm + complex RoPE kernel, written into the joint text +
image Q/K: the eager chain it replaces, its index math under Triton's interpreter (on
the CPU), and on CUDA the kernel bitwise against the eager chain, with a control
that contracts the other product of the complex multiply."""

import pytest
import torch

from sglang.kernels.ops import diffusion as kernels
from sglang.multimodal_gen.runtime.layers import train_parity_kernels, train_parity_ops
from sglang.multimodal_gen.runtime.layers.layernorm import RMSNorm
from sglang.multimodal_gen.runtime.utils import train_parity

BF16 = torch.bfloat16
QK_NORM_ROPE = "train_parity Q/K RMSNorm + complex RoPE into the joint Q/K"

pytestmark = pytest.mark.usefixtures("fresh_train_parity_gates")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernels run on CUDA"
)


def _norms(device="cpu"):
    with train_parity.numerics_mode_context("train_parity"):
        norms = [RMSNorm(128, eps=1e-6).to(device, BF16) for _ in range(4)]
    for norm in norms:
        norm.weight.data.uniform_(0.8, 1.2)
    return norms


def _eager_joint(parts):
    return [
        torch.cat(
            [
                train_parity_ops.rotary_emb(part[norm](part[index]), part[4])
                for part in parts
            ],
            dim=1,
        )
        for index, norm in ((0, 2), (1, 3))
    ]


def test_eager_joint_qk_norm_rope_is_the_attention_chain():
    norms = _norms()
    parts = []
    for length, (q_norm, k_norm) in ((3, norms[:2]), (5, norms[2:])):
        angles = torch.randn(length, 64)
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = (torch.randn(2, length, 2, 128).to(BF16) for _ in range(2))
        parts.append((q, k, q_norm, k_norm, freqs))
    query, key = train_parity_kernels.joint_qk_norm_rope(parts)
    expected_query, expected_key = _eager_joint(parts)
    assert torch.equal(query, expected_query) and torch.equal(key, expected_key)


def test_qk_index_math_under_the_triton_interpreter(run_under_triton_interpreter):
    # rows outside [offset, offset + S) stay unwritten; control: the RoPE table
    # shifted by one token fails the same comparison
    run_under_triton_interpreter(
        """
        from sglang.kernels.ops.diffusion.rope import (
            qknorm_complex_rope_joint_triton as qk,
        )

        B, S, H, D, joint, offset = 2, 5, 3, 128, 11, 4
        q, k = (torch.randn(B, S, H, D).bfloat16() for _ in range(2))
        weights = [(torch.rand(D) * 0.4 + 0.8).bfloat16() for _ in range(2)]
        angles = torch.randn(S, D // 2)
        rope = torch.polar(torch.ones_like(angles), angles)

        def expected(x, w, table):
            var = x.float().pow(2).mean(-1, keepdim=True)
            y = (x * torch.rsqrt(var + 1e-6)).bfloat16() * w
            z = torch.view_as_complex(y.float().reshape(B, S, H, D // 2, 2))
            z = z * table[:, None]
            return torch.view_as_real(z).reshape(B, S, H, D).bfloat16()

        # a group past the last head; two groups, the second one partial
        for heads_per_group in (4, 2):
            outs = [torch.full((B, joint, H, D), float("nan")).bfloat16() for _ in "qk"]
            qk._qknorm_complex_rope_joint_kernel[(B * S, 2)](
                q, k, *weights, torch.view_as_real(rope), *outs, S, joint, offset,
                1e-6, HEADS=H, ROWS=heads_per_group, FUSE_REAL_SIN=True)
            for out, x, w in zip(outs, (q, k), weights):
                assert out[:, :offset].isnan().all()
                assert out[:, offset + S:].isnan().all()
                written = out[:, offset:offset + S]
                assert close(written, expected(x, w, rope))
                assert not close(written, expected(x, w, rope.roll(1, 0)))
        print("ok")
        """
    )


@needs_cuda
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("lengths", [(211, 4096), (77, 1024), (7, 13), (1, 3)])
def test_joint_qk_norm_rope_kernel(batch, lengths, monkeypatch, adversarial):
    """Bitwise equal to the eager chain, whose RMSNorm mean is aten's reduction: the
    kernel sums each row on the 32 lanes of one warp, in aten's order."""
    from sglang.kernels.ops.diffusion.rope import qknorm_complex_rope_joint_triton

    heads = 24
    norms = _norms("cuda")
    parts = []
    for length, (q_norm, k_norm) in zip(lengths, (norms[:2], norms[2:])):
        angles = torch.randn(length, 64, device="cuda") * 100
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = (
            adversarial(torch.randn(batch, length, heads, 128, device="cuda")).to(BF16)
            for _ in range(2)
        )
        parts.append((q, k, q_norm, k_norm, freqs))
    eager = _eager_joint(parts)
    with torch.no_grad():
        fused = train_parity_kernels.joint_qk_norm_rope(parts)
    assert train_parity_kernels.bitwise_equal(fused, eager)
    assert train_parity_kernels.gate_states()[QK_NORM_ROPE] == {
        "disabled": False,
        "verified_signatures": 2,
    }
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
