"""Plain-PyTorch versions of the three sgl_kernel CPU ops upstream's default CPU path calls.

sglang 0.5.23's default (non-train_parity) norm + scale/shift ops call
`torch.ops.sgl_kernel.{fused_norm_scale_shift_cpu, fused_scale_residual_norm_scale_shift_cpu,
fused_scale_shift_cpu}` on CPU. Only a CPU build of sgl-kernel compiled from sglang's repository
has them; no installable package does. To run upstream's default path at all on a CPU machine
(the negative controls of the parity tools and tests), `register_cpu_kernels()` registers one
plain-PyTorch implementation of each: fp32 math, output in the input's dtype. The train_parity path
never calls them, so they are never a parity reference. Nothing else of sgl_kernel is provided:
`import sgl_kernel` still fails.

`stand_in_vllm_rotary_embedding()` lets sglang's Qwen3-VL text encoder (Qwen-Image 2.1's) be built
on a CPU machine at all: see there.
"""

from __future__ import annotations

import collections
import sys
import types
from importlib.util import find_spec

import torch
import torch.nn.functional as F

_SCHEMAS = {
    "fused_scale_shift_cpu": "(Tensor x, Tensor scale, Tensor shift, float scale_constant) -> Tensor",
    "fused_norm_scale_shift_cpu": "(Tensor x, Tensor? weight, Tensor? bias, Tensor scale, "
    "Tensor shift, str norm_type, float eps) -> Tensor",
    "fused_scale_residual_norm_scale_shift_cpu": "(Tensor residual, Tensor x, Tensor? gate, "
    "Tensor? weight, Tensor? bias, Tensor scale, Tensor shift, str norm_type, float eps) "
    "-> (Tensor, Tensor)",
}
calls: collections.Counter = collections.Counter()
_library = None


def _norm(x, weight, bias, norm_type, eps):
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    if norm_type == "layer":
        return F.layer_norm(x, x.shape[-1:], w, b, eps)
    if norm_type == "rms":
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        y = y if w is None else y * w
        return y if b is None else y + b
    raise NotImplementedError(norm_type)


def _fused_scale_shift_cpu(x, scale, shift, scale_constant):
    calls["fused_scale_shift_cpu"] += 1
    return (x.float() * (scale_constant + scale.float()) + shift.float()).to(x.dtype)


def _fused_norm_scale_shift_cpu(x, weight, bias, scale, shift, norm_type, eps):
    calls["fused_norm_scale_shift_cpu"] += 1
    y = _norm(x.float(), weight, bias, norm_type, eps)
    return (y * (1 + scale.float()) + shift.float()).to(x.dtype)


def _fused_scale_residual_norm_scale_shift_cpu(
    residual, x, gate, weight, bias, scale, shift, norm_type, eps
):
    calls["fused_scale_residual_norm_scale_shift_cpu"] += 1
    gated = x.float() if gate is None else x.float() * gate.float()
    residual_out = (residual.float() + gated).to(residual.dtype)
    y = _norm(residual_out.float(), weight, bias, norm_type, eps)
    return (y * (1 + scale.float()) + shift.float()).to(x.dtype), residual_out


def register_cpu_kernels() -> collections.Counter:
    """Register the stand-ins (once per process); returns the per-op call counter."""
    global _library
    if _library is None:
        _library = torch.library.Library("sgl_kernel", "DEF")
        for name, schema in _SCHEMAS.items():
            _library.define(name + schema)
            _library.impl(name, globals()[f"_{name}"], "CPU")
    return calls


def _vllm_rotary_embedding(*args, **kwargs):
    raise RuntimeError(
        "vllm's rotary_embedding stand-in was called (sglang_train_parity.cpu_kernels)"
    )


def stand_in_vllm_rotary_embedding() -> None:
    """On a host that is neither CUDA nor sglang's CPU engine, sglang's srt `RotaryEmbedding`
    imports `vllm._custom_ops.rotary_embedding` when it is built, and sglang's Qwen3-VL encoder
    builds one (with no fallback for Qwen-Image 2.1). Its Qwen-VL text RoPE only runs
    `forward_native`. Where vllm is not installed, a stand-in module whose op raises if called
    lets the encoder build; an installed vllm is left alone."""
    if find_spec("vllm") is not None:
        return
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = _vllm_rotary_embedding
    vllm = types.ModuleType("vllm")
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)
