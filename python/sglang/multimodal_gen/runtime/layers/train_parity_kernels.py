# SPDX-License-Identifier: Apache-2.0
"""Fused CUDA kernels for the train_parity DiT forward.

Each function here returns what its ``train_parity_ops`` namesake returns,
bit for bit. On CUDA BF16 inputs of a layout the kernel takes it launches one
kernel in place of that eager op chain; anywhere else (CPU tensors, other
dtypes or layouts) it runs the eager chain.

Every kernel reproduces the eager chain's roundings by construction, and is
still compared with it on first use per input signature, with a bitwise
comparison (``BitExactFusionGate``): the reductions, FMA contractions and GEMM
accumulation order it reproduces belong to the installed torch and cuBLAS
builds. A signature is everything Triton compiles a kernel for: each tensor's
shape, strides, dtype and device, and whether its address is a multiple of 16
bytes (Triton builds another kernel for a pointer that is not); the integer
arguments Triton specializes on are sizes and strides of these tensors. A
comparison in which an input is all zeros (PEFT's initial ``lora_B``) proves
nothing about the arithmetic it skips: such a call runs the eager chain and
leaves the signature unverified, to be checked on a later call. A
mismatch or a failed launch logs one line naming the kernel and turns that
kernel off for the process; the eager chain runs from then on. No check runs
inside CUDA-graph capture or compile tracing: there, a signature not yet
verified runs the eager chain.

``SGLANG_TRAIN_PARITY_FUSED_KERNELS=0`` runs the eager chains everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from sglang.kernels.ops import diffusion as kernels
from sglang.kernels.ops.diffusion import BitExactFusionGate
from sglang.multimodal_gen import envs
from sglang.multimodal_gen.runtime.layers import train_parity_ops
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

logger = init_logger(__name__)

# Read once: the process serves one numerics configuration.
FUSED_KERNELS = envs.SGLANG_TRAIN_PARITY_FUSED_KERNELS

_QK_NORM_ROPE = BitExactFusionGate(
    "train_parity Q/K RMSNorm + complex RoPE into the joint Q/K", per_signature=True
)
_LAYER_NORM_MODULATION = BitExactFusionGate(
    "train_parity LayerNorm + scale/shift modulation", per_signature=True
)
_GATED_RESIDUAL = BitExactFusionGate("train_parity gated residual", per_signature=True)
_LORA_UP = BitExactFusionGate(
    "train_parity LoRA-B GEMM + scale-and-add", per_signature=True
)
_LORA_UP_GELU = BitExactFusionGate(
    "train_parity LoRA-B GEMM + scale-and-add + tanh GELU", per_signature=True
)
GATES = (
    _QK_NORM_ROPE,
    _LAYER_NORM_MODULATION,
    _GATED_RESIDUAL,
    _LORA_UP,
    _LORA_UP_GELU,
)

_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bitwise_equal(a: Any, b: Any) -> bool:
    """Equal bits, for a tensor or a sequence of tensors. Stricter than
    ``torch.equal``: -0.0 differs from +0.0."""
    if not isinstance(a, torch.Tensor):
        return all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = _SAME_WIDTH_INT.get(a.dtype)
    if as_int is None:
        return torch.equal(a, b)
    return torch.equal(a.view(as_int), b.view(as_int))


# Triton compiles a kernel per pointer argument whose address is a multiple of
# 16 bytes or not (``tt.divisibility``).
_POINTER_ALIGNMENT = 16


def _signature(*tensors: torch.Tensor) -> tuple:
    return tuple(
        (
            t.shape,
            t.stride(),
            t.dtype,
            t.device,
            t.data_ptr() % _POINTER_ALIGNMENT == 0,
        )
        for t in tensors
    )


def _verified(
    gate: BitExactFusionGate,
    fused: Callable[[], Any],
    reference: Callable[[], Any],
    *inputs: torch.Tensor,
    written: tuple[torch.Tensor, ...] = (),
) -> Any:
    """``fused()`` where ``gate`` has verified it for the signature of
    ``inputs`` and the buffers the kernel writes into (``written``), else the
    check of ``BitExactFusionGate.run``, except with an all-zero input: that
    call runs ``reference()`` and the signature stays unverified."""
    sig = _signature(*inputs, *written)
    if (
        not gate.is_verified(sig)
        and not gate.disabled
        and _can_check_now(inputs[0])
        and _an_input_is_all_zeros(inputs)
    ):
        return reference()
    return gate.run(fused, reference, sig=sig, equal=bitwise_equal, logger=logger)


def _can_check_now(t: torch.Tensor) -> bool:
    # reading a tensor's values waits for the device: not while capturing
    return not (
        torch.compiler.is_compiling()
        or (t.is_cuda and torch.cuda.is_current_stream_capturing())
    )


def _an_input_is_all_zeros(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether one of ``tensors`` holds only zeros (one wait for the device)."""
    return not bool(torch.stack([t.any() for t in tensors]).all())


def _takes(x: torch.Tensor) -> bool:
    return FUSED_KERNELS and x.is_cuda and not torch.is_grad_enabled()


def _is_bf16_dense(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return all(
        t.dtype == torch.bfloat16
        and t.device == first.device
        and t.is_contiguous()
        and t.numel() > 0
        for t in tensors
    )


def _modulation_rows(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A [B, D] or [B, 1, D] modulation of ``x`` [B, S, D] (B may be 1, broadcast)
    as [B, D] rows with a packed last dim; None for any other shape."""
    if t is None or t.dim() not in (2, 3) or (t.dim() == 3 and t.shape[1] != 1):
        return None
    rows = t[:, 0] if t.dim() == 3 else t
    if rows.shape[0] == 1:
        rows = rows.expand(x.shape[0], -1)
    if rows.shape != (x.shape[0], x.shape[2]) or rows.stride(1) != 1:
        return None
    return rows


def layer_norm_scale_shift(
    x: torch.Tensor,
    shift: torch.Tensor | None,
    scale: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``train_parity_ops.layer_norm_scale_shift``; one kernel for a norm
    without affine parameters and BF16 [B, D] modulation rows."""
    reference = partial(
        train_parity_ops.layer_norm_scale_shift, x, shift, scale, eps, weight, bias
    )
    if not (_takes(x) and weight is None and bias is None and x.dim() == 3):
        return reference()
    scale_rows = _modulation_rows(scale, x)
    shift_rows = _modulation_rows(shift, x)
    if (
        scale_rows is None
        or (shift is not None and shift_rows is None)
        or x.shape[-1] % 4
        or x.shape[-1] > 8192
        or not _is_bf16_dense(x)
        or scale_rows.dtype != torch.bfloat16
        or scale_rows.device != x.device
        or (
            shift_rows is not None
            and (
                shift_rows.dtype != torch.bfloat16
                or shift_rows.device != x.device
                or (x.shape[0] > 1 and shift_rows.stride() != scale_rows.stride())
            )
        )
    ):
        return reference()
    fused = partial(
        kernels.fused_layernorm_autocast_modulate, x, scale_rows, shift_rows, eps
    )
    modulation = (scale_rows,) if shift_rows is None else (scale_rows, shift_rows)
    return _verified(_LAYER_NORM_MODULATION, fused, reference, x, *modulation)


def gated_residual(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """``train_parity_ops.gated_residual``; one kernel for BF16 ``residual``
    and ``x`` [B, S, D] and a BF16 or FP32 [B, D] gate."""
    reference = partial(train_parity_ops.gated_residual, residual, gate, x)
    if not (_takes(residual) and residual.dim() == 3):
        return reference()
    gate_rows = _modulation_rows(gate, residual)
    if (
        gate_rows is None
        or gate_rows.dtype not in (torch.bfloat16, torch.float32)
        or gate_rows.device != residual.device
        or x.shape != residual.shape
        or not _is_bf16_dense(residual, x)
    ):
        return reference()
    fused = partial(kernels.residual_gate_add_bf16, residual, x, gate_rows)
    return _verified(_GATED_RESIDUAL, fused, reference, residual, gate_rows, x)


def add_lora_up(
    out: torch.Tensor,
    down: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    gelu_tanh: bool = False,
) -> torch.Tensor:
    """``train_parity_ops.add_lora_up``, through ``F.gelu(approximate="tanh")``
    if ``gelu_tanh``; one kernel, the LoRA-B GEMM with the scale-and-add (and
    the GELU) as its epilogue, for BF16 operands and a rank the kernel takes.
    Its accumulation order is cuBLAS's for such a rank on the GPUs it was
    measured on, not a property cuBLAS states: the gate is the proof."""
    reference = partial(_add_lora_up, out, down, lora_B, scaling, gelu_tanh)
    if not (_takes(out) and kernels.can_use_lora_b_scale_add(out, down, lora_B)):
        return reference()
    fused = partial(kernels.lora_b_scale_add_bf16, out, down, lora_B, scaling)
    if not gelu_tanh:
        return _verified(_LORA_UP, fused, reference, out, down, lora_B)

    def fused_gelu():
        _check_gelu_tanh_on_every_bf16(out.device)
        return fused(gelu_tanh=True)

    return _verified(_LORA_UP_GELU, fused_gelu, reference, out, down, lora_B)


def _add_lora_up(out, down, lora_B, scaling, gelu_tanh):
    out = train_parity_ops.add_lora_up(out, down, lora_B, scaling)
    return F.gelu(out, approximate="tanh") if gelu_tanh else out


_GELU_TANH_CHECKED: set[torch.device] = set()


def _check_gelu_tanh_on_every_bf16(device: torch.device) -> None:
    """The GELU epilogue looks each BF16 input up in a table, so one call's
    data cannot prove it: it runs once per device on every finite BF16 value,
    through the kernel with a zero update, against aten's GELU."""
    if device in _GELU_TANH_CHECKED:
        return
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device)
    values = bits.to(torch.int16).view(torch.bfloat16)
    base = values[values.isfinite()].view(-1, 128)
    down = base.new_zeros(base.shape[0], 16)
    lora_B = base.new_zeros(128, 16)
    fused = kernels.lora_b_scale_add_bf16(base, down, lora_B, 1.0, gelu_tanh=True)
    expected = _add_lora_up(base, down, lora_B, 1.0, True)
    if not bitwise_equal(fused, expected):
        differ = int((fused.view(torch.int16) != expected.view(torch.int16)).sum())
        raise RuntimeError(
            f"its tanh GELU differs from aten's on {differ} of {base.numel()} "
            "BF16 inputs"
        )
    _GELU_TANH_CHECKED.add(device)


def joint_qk_norm_rope(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, Any, Any, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each part's query and key ([B, S_i, H, D]) through its own per-head
    ``RMSNorm`` and ``train_parity_ops.rotary_emb`` with its table
    [S_i, D / 2], joined along the sequence in order. Parts: ``(query, key,
    query_norm, key_norm, freqs)``. The kernel writes each part straight into
    the joint buffers."""
    first = parts[0][0]
    if not (
        _takes(first)
        and all(
            query.dim() == 4
            and query.shape[0] == first.shape[0]
            and query.shape[2:] == first.shape[2:]
            and key.shape == query.shape
            and _is_bf16_dense(first, query, key, query_norm.weight, key_norm.weight)
            and query_norm.variance_epsilon == key_norm.variance_epsilon
            and query_norm.variance_size_override is None
            and key_norm.variance_size_override is None
            for query, key, query_norm, key_norm, _ in parts
        )
    ):
        queries, keys = zip(*(_qk_norm_rope(*part) for part in parts))
        return torch.cat(queries, dim=1), torch.cat(keys, dim=1)

    batch, _, heads, head_dim = first.shape
    joint_len = sum(part[0].shape[1] for part in parts)
    joint_query = first.new_empty(batch, joint_len, heads, head_dim)
    joint_key = torch.empty_like(joint_query)
    offset = 0
    for part in parts:
        _write_qk_norm_rope(part, joint_query, joint_key, offset)
        offset += part[0].shape[1]
    return joint_query, joint_key


def _qk_norm_rope(query, key, query_norm, key_norm, freqs):
    return (
        train_parity_ops.rotary_emb(query_norm(query), freqs),
        train_parity_ops.rotary_emb(key_norm(key), freqs),
    )


def _write_qk_norm_rope(part, joint_query, joint_key, offset):
    query, key, query_norm, key_norm, freqs = part
    rows = slice(offset, offset + query.shape[1])
    written = (joint_query[:, rows], joint_key[:, rows])

    def fused():
        kernels.qknorm_complex_rope_joint_(
            query,
            key,
            query_norm.weight,
            key_norm.weight,
            freqs,
            query_norm.variance_epsilon,
            joint_query,
            joint_key,
            offset,
        )
        return written

    out = _verified(
        _QK_NORM_ROPE,
        fused,
        partial(_qk_norm_rope, *part),
        query,
        key,
        query_norm.weight,
        key_norm.weight,
        freqs,
        written=(joint_query, joint_key),
    )
    if out is not written:
        written[0].copy_(out[0])
        written[1].copy_(out[1])


def log_selection() -> None:
    """One line at DiT load: which fused kernels the train_parity forward runs."""
    if not FUSED_KERNELS:
        logger.info(
            "train_parity fused kernels: off (SGLANG_TRAIN_PARITY_FUSED_KERNELS=0); "
            "the DiT runs the eager op chains"
        )
        return
    logger.info(
        "train_parity fused kernels on CUDA BF16 inputs: %s; each is compared "
        "bitwise with its eager chain on first use per input signature and "
        "replaced by it for good on a mismatch (SGLANG_TRAIN_PARITY_FUSED_KERNELS=0 "
        "turns them off)",
        ", ".join(gate.name.removeprefix("train_parity ") for gate in GATES),
    )


def gate_states() -> dict[str, dict[str, Any]]:
    """Per kernel: whether it is off for good, and how many signatures it has
    matched its eager chain on."""
    return {
        gate.name: {
            "disabled": gate.disabled,
            "verified_signatures": len(gate.verified_sigs),
        }
        for gate in GATES
    }
