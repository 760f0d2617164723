# SPDX-License-Identifier: Apache-2.0
"""The train_parity LoRA-B GEMM + scale-and-add kernel and its tanh GELU epilogue:
how the GELU is checked on every BF16 input, the kernel's index math under Triton's
interpreter (on the CPU), and on CUDA the kernel bitwise against PEFT's eager chain,
with a control that sums the rank in another order."""

from unittest.mock import MagicMock

import pytest
import torch

from sglang.kernels.ops import diffusion as kernels
from sglang.multimodal_gen.runtime.layers import train_parity_kernels, train_parity_ops

BF16 = torch.bfloat16
LORA_UP = "train_parity LoRA-B GEMM + scale-and-add"
GELU_GATE = f"{LORA_UP} + tanh GELU"

pytestmark = pytest.mark.usefixtures("fresh_train_parity_gates")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernels run on CUDA"
)


@pytest.mark.parametrize("differing_value", [None, 3.0])
def test_the_gelu_epilogue_is_checked_on_every_bf16_input(monkeypatch, differing_value):
    """The first call's data lacks ``differing_value``; the check over every BF16
    input still finds the kernel's GELU wrong there and turns the kernel off."""
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    monkeypatch.setattr(train_parity_kernels, "_takes", lambda x: True)
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
    assert train_parity_kernels.gate_states()[LORA_UP] == {
        "disabled": False,
        "verified_signatures": 1,
    }


def test_lora_b_index_math_under_the_triton_interpreter(run_under_triton_interpreter):
    # a partial row tile and a partial column tile; control: the rank's columns of
    # lora_B reversed fail the same comparison
    run_under_triton_interpreter(
        """
        from sglang.kernels.ops.diffusion.gemm import lora_b_scale_add_triton as lb

        rows, cols, rank = 130, 200, 32
        base = torch.randn(rows, cols).bfloat16()
        down = torch.randn(rows, rank).bfloat16()
        lora_b = (torch.randn(cols, rank) * 0.1).bfloat16()
        out = torch.full_like(base, float("nan"))
        grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
        # The interpreter's tl.dot misreads BF16 operands (Triton 3.8): FP32 ones here.
        lb._lora_b_scale_add_kernel[grid](
            out, base, down.float(), lora_b.float(), out, 1.5, rows, cols, RANK=rank,
            GELU_TANH=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=16)
        summed = base + torch.nn.functional.linear(down, lora_b) * 1.5
        assert close(out, summed)
        flipped = torch.nn.functional.linear(down, lora_b.flip(1))
        assert not close(out, base + flipped * 1.5)
        # the GELU looks the BF16 sum up by its bits; control: the table with its
        # halves swapped (each value reads the GELU of its negation) fails
        table = lb.gelu_tanh_table(torch.device("cpu"))
        for gelu_table, equal in ((table, True), (table.roll(2**15), False)):
            lb._lora_b_scale_add_kernel[grid](
                out, base, down.float(), lora_b.float(), gelu_table, 1.5, rows, cols,
                RANK=rank, GELU_TANH=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=16)
            gelu = torch.nn.functional.gelu(summed.bfloat16(), approximate="tanh")
            assert close(out, gelu) == equal
        print("ok")
        """
    )


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
def test_lora_b_scale_add_kernel(shape, rank, scaling, adversarial, lora_down):
    base = adversarial(torch.randn(shape, device="cuda")).to(BF16)
    down = lora_down(base.numel() // shape[-1], rank).view(*shape[:-1], rank)
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
def test_lora_b_scale_add_gelu_tanh_kernel(shape, adversarial, lora_down):
    base = adversarial(torch.randn(shape, device="cuda")).to(BF16)
    down = lora_down(base.numel() // shape[-1], 64).view(*shape[:-1], 64)
    lora_B = (torch.randn(shape[-1], 64, device="cuda") * 0.02).to(BF16)
    eager = torch.nn.functional.gelu(
        train_parity_ops.add_lora_up(base, down, lora_B, 2.0), approximate="tanh"
    )
    fused = kernels.lora_b_scale_add_bf16(base, down, lora_B, 2.0, gelu_tanh=True)
    assert train_parity_kernels.bitwise_equal(fused, eager)


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
def test_lora_up_takes_the_kernel_and_verifies_it(lora_down):
    base = torch.randn(2, 211, 3072, device="cuda").to(BF16)
    down = lora_down(2 * 211, 64).view(2, 211, 64)
    lora_B = (torch.randn(3072, 64, device="cuda") * 0.02).to(BF16)
    with torch.no_grad():
        fused = train_parity_kernels.add_lora_up(base, down, lora_B, 2.0)
    eager = train_parity_ops.add_lora_up(base, down, lora_B, 2.0)
    assert train_parity_kernels.bitwise_equal(fused, eager)
    assert train_parity_kernels.gate_states()[LORA_UP] == {
        "disabled": False,
        "verified_signatures": 1,
    }
