# SPDX-License-Identifier: Apache-2.0
"""How a train_parity fused kernel is checked against its eager chain: when it runs,
what a signature is, when a check counts, and how a kernel that differs is turned
off. CPU tests with stand-in kernels; on CUDA every kernel's check through its entry
point."""

from functools import partial
from unittest.mock import MagicMock

import pytest
import torch

from sglang.kernels.ops import diffusion as kernels
from sglang.multimodal_gen.runtime.layers import train_parity_kernels, train_parity_ops

BF16 = torch.bfloat16
EAGER_GATED_RESIDUAL = train_parity_ops.gated_residual
GATED_RESIDUAL = "train_parity gated residual"
LORA_UP = "train_parity LoRA-B GEMM + scale-and-add"
QK_NORM_ROPE = "train_parity Q/K RMSNorm + complex RoPE into the joint Q/K"

pytestmark = pytest.mark.usefixtures("fresh_train_parity_gates")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused kernels run on CUDA"
)


def test_bitwise_equal_tells_signed_zeros_apart():
    zero = torch.zeros(3, dtype=BF16)
    assert torch.equal(zero, -zero)
    assert not train_parity_kernels.bitwise_equal(zero, -zero)
    assert train_parity_kernels.bitwise_equal((zero, -zero), (zero.clone(), -zero))


def test_cpu_tensors_run_the_eager_chain(monkeypatch, residual_inputs):
    monkeypatch.setattr(kernels, "residual_gate_add_bf16", _never_called)
    residual, gate, update = residual_inputs()
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


def test_a_kernel_is_checked_once_per_signature(
    on_the_kernel_path, monkeypatch, residual_inputs
):
    kernel = on_the_kernel_path(_StandIn())
    reference = MagicMock(side_effect=train_parity_ops.gated_residual)
    monkeypatch.setattr(train_parity_ops, "gated_residual", reference)
    inputs = residual_inputs()
    for _ in range(3):
        train_parity_kernels.gated_residual(*inputs)
    assert (kernel.calls, reference.call_count) == (3, 1)
    train_parity_kernels.gated_residual(*residual_inputs(seq=7))
    assert (kernel.calls, reference.call_count) == (4, 2)
    states = train_parity_kernels.gate_states()[GATED_RESIDUAL]
    assert states == {"disabled": False, "verified_signatures": 2}


@pytest.mark.parametrize(
    "stand_in", [_StandIn(ulps=1), _StandIn(error=RuntimeError("no launch"))]
)
def test_a_kernel_that_differs_is_replaced_for_good(
    on_the_kernel_path, stand_in, residual_inputs
):
    kernel = on_the_kernel_path(stand_in)
    inputs = residual_inputs()
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


def test_capture_runs_the_eager_chain_until_verified(
    on_the_kernel_path, monkeypatch, residual_inputs
):
    kernel = on_the_kernel_path(_StandIn())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    train_parity_kernels.gated_residual(*residual_inputs())
    assert kernel.calls == 0


def test_the_switch_runs_the_eager_chains(
    on_the_kernel_path, monkeypatch, residual_inputs
):
    kernel = on_the_kernel_path(_StandIn(ulps=1))
    monkeypatch.setattr(train_parity_kernels, "FUSED_KERNELS", False)
    inputs = residual_inputs()
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
    on_the_kernel_path, monkeypatch, residual_inputs
):
    kernel = on_the_kernel_path(_StandIn())
    reference = MagicMock(side_effect=train_parity_ops.gated_residual)
    monkeypatch.setattr(train_parity_ops, "gated_residual", reference)
    residual, gate, update = residual_inputs()
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
def test_an_all_zero_input_earns_no_credit(
    on_the_kernel_path, monkeypatch, residual_inputs, zero_input
):
    """Zeros compare equal whatever a kernel does with them (PEFT's initial
    lora_B): such a call runs the eager chain alone, and the kernel is checked on
    the first call without an all-zero input."""
    kernel = on_the_kernel_path(_StandIn(ulps=1))
    reference = MagicMock(side_effect=train_parity_ops.gated_residual)
    monkeypatch.setattr(train_parity_ops, "gated_residual", reference)
    inputs = list(residual_inputs())
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


def test_a_verified_kernel_runs_on_zeros_without_a_check(
    on_the_kernel_path, residual_inputs
):
    kernel = on_the_kernel_path(_StandIn())
    residual, gate, update = residual_inputs()
    train_parity_kernels.gated_residual(residual, gate, update)
    train_parity_kernels.gated_residual(residual, gate.zero_(), update)
    assert kernel.calls == 2
    assert train_parity_kernels.gate_states()[GATED_RESIDUAL] == {
        "disabled": False,
        "verified_signatures": 1,
    }


# CUDA: every kernel's check through its entry point. A case returns the entry
# point, its eager chain, the inputs, and which input to move off alignment.


def _qk_case(request):
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


def _layer_norm_case(request):
    x = torch.randn(2, 77, 3072, device="cuda").to(BF16)
    mod = torch.randn(2, 6 * 3072, device="cuda").to(BF16)
    shift, scale = mod[:, :3072], mod[:, 3072 : 2 * 3072]

    def call(x, shift, scale):
        return train_parity_kernels.layer_norm_scale_shift(x, shift, scale, 1e-6)

    def eager(x, shift, scale):
        return train_parity_ops.layer_norm_scale_shift(x, shift, scale, 1e-6)

    return call, eager, [x, shift, scale], 0


def _gated_residual_case(request):
    residual_inputs = request.getfixturevalue("residual_inputs")
    return (
        train_parity_kernels.gated_residual,
        EAGER_GATED_RESIDUAL,
        list(residual_inputs("cuda", 2, 77, 3072)),
        0,
    )


def _lora_up_case(request, gelu_tanh=False):
    out = torch.randn(2, 211, 3072, device="cuda").to(BF16)
    down = request.getfixturevalue("lora_down")(2 * 211, 64).view(2, 211, 64)
    lora_B = (torch.randn(3072, 64, device="cuda") * 0.02).to(BF16)

    def call(out, down, lora_B):
        return train_parity_kernels.add_lora_up(out, down, lora_B, 2.0, gelu_tanh)

    def eager(out, down, lora_B):
        return train_parity_kernels._add_lora_up(out, down, lora_B, 2.0, gelu_tanh)

    return call, eager, [out, down, lora_B], 2


KERNEL_CASES = {
    QK_NORM_ROPE: (_qk_case, needs_cuda),
    "train_parity LayerNorm + scale/shift modulation": (_layer_norm_case, needs_cuda),
    GATED_RESIDUAL: (_gated_residual_case, needs_cuda),
    LORA_UP: (_lora_up_case, needs_cuda),
    f"{LORA_UP} + tanh GELU": (partial(_lora_up_case, gelu_tanh=True), needs_cuda),
}


@pytest.mark.parametrize(
    "gate", [pytest.param(name, marks=mark) for name, (_, mark) in KERNEL_CASES.items()]
)
def test_each_kernel_is_checked_per_alignment_and_not_on_zeros(
    gate, monkeypatch, request
):
    """Every kernel's check through its train_parity_kernels entry point: a call
    whose first input is all zeros runs the eager chain and verifies nothing; a
    misaligned copy of an input is checked once, as a signature of its own. The
    eager chain may take another algorithm for it (cuBLAS does for the LoRA-B
    GEMM's operands), and then that check turns the kernel off."""
    monkeypatch.setattr(train_parity_kernels, "_GELU_TANH_CHECKED", set())
    call, eager, inputs, moved = KERNEL_CASES[gate][0](request)
    misaligned = list(inputs)
    misaligned[moved] = _misaligned(inputs[moved])
    equal = train_parity_kernels.bitwise_equal
    comparisons, nested = [], []

    def counted_equal(a, b):
        # a pair of outputs is compared element by element through this name
        if not nested:
            comparisons.append(gate)
        nested.append(True)
        try:
            return equal(a, b)
        finally:
            nested.pop()

    monkeypatch.setattr(train_parity_kernels, "bitwise_equal", counted_equal)

    def checks(operands, compare=True):
        """The comparisons with the eager chain that one call made."""
        before = len(comparisons)
        with torch.no_grad():
            out = call(*operands)
        made = len(comparisons) - before
        assert not compare or counted_equal(out, eager(*operands))
        return made

    def state():
        return train_parity_kernels.gate_states()[gate]

    zeros = [torch.zeros_like(inputs[0]), *inputs[1:]]
    assert [checks(zeros) for _ in range(2)] == [0, 0]
    assert state()["verified_signatures"] == 0
    assert checks(inputs) >= 1 and state()["verified_signatures"] == 1
    assert checks(misaligned) == 1
    assert checks(misaligned) == 0
    assert state()["verified_signatures"] == 2 or state()["disabled"]
    # control: keyed without the alignment, the misaligned call would have run
    # the build Triton compiles for it unchecked
    monkeypatch.setattr(
        train_parity_kernels,
        "_signature",
        lambda *ts: tuple((t.shape, t.stride(), t.dtype, t.device) for t in ts),
    )
    for gate_ in train_parity_kernels.GATES:
        gate_.verified_sigs.clear()
        gate_.disabled = False
    assert checks(inputs) >= 1
    assert checks(misaligned, compare=False) == 0
