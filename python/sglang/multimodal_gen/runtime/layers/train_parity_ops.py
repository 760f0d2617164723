# SPDX-License-Identifier: Apache-2.0
"""The training forward's arithmetic, op by op, for ``--numerics train_parity``.

The training forward is diffusers + PEFT LoRA with bf16 parameters under
``torch.autocast("cuda", dtype=torch.bfloat16)``. Under that autocast,
``layer_norm``, ``pow``, ``rsqrt`` and ``norm`` run in fp32, GEMMs and SDPA
in bf16, and every other op in its inputs' dtype. The DiT runs without
autocast, so each function below spells out those dtypes and rounds exactly
where the training forward rounds. The ``forward_train_parity`` methods of the
layers call these, so each rule of the contract lives here once; where two
families' arithmetic differs, the difference is a named variant here.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglang.multimodal_gen.runtime.layers.rotary_embedding.utils import (
    _apply_rotary_emb_complex,
)


def rms_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """diffusers ``RMSNorm``: fp32 statistics, the normalized value rounded to
    a half-precision weight's dtype *before* the weight multiply."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    normed = x * torch.rsqrt(variance + eps)
    if weight is None:
        return normed.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype)
    return normed * weight


def zero_centred_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Qwen-Image 2.1's text norm: statistics, normalization and the
    ``weight + 1`` multiply all in fp32, rounded once to ``x``'s dtype."""
    value = x.float()
    rrms = torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + eps)
    return (value * rrms * (weight.float() + 1)).to(x.dtype)


def as_modulation(t: torch.Tensor) -> torch.Tensor:
    """[B, D] shift/scale/gate broadcast over the sequence as [B, 1, D]."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def layer_norm_scale_shift(
    x: torch.Tensor,
    shift: Optional[torch.Tensor],
    scale: torch.Tensor,
    eps: float,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``nn.LayerNorm`` under CUDA autocast (fp32 out), then diffusers'
    ``x * (1 + scale) + shift``: ``1 + scale`` in the modulation's dtype, the
    product and the sum in fp32. Rounded once to ``x``'s dtype, which is what
    autocast does where the training forward feeds the result to a Linear.
    ``shift=None`` is the scale-only ``x * (1 + scale)`` of Qwen-Image 2.1
    (adding a zero shift would turn a ``-0.0`` into ``+0.0``)."""
    normed = F.layer_norm(
        x.float(),
        x.shape[-1:],
        None if weight is None else weight.float(),
        None if bias is None else bias.float(),
        eps,
    )
    modulated = normed * (1 + as_modulation(scale))
    if shift is not None:
        modulated = modulated + as_modulation(shift)
    return modulated.to(x.dtype)


def gated_residual(
    residual: torch.Tensor, gate: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """diffusers' ``residual + gate * x``, stored in the residual's dtype. The
    gate's dtype picks the variant: a bf16 gate (Qwen-Image) rounds the
    product and the sum each in bf16; Wan's fp32 gate computes both in fp32
    and rounds once (its ``(residual.float() + x * gate).type_as(residual)``)."""
    return (residual + as_modulation(gate) * x).to(residual.dtype)


# CUDA autocast runs rms_norm in fp32 from torch 2.12 on (pytorch#174824);
# torch 2.11 leaves it in the input dtype.
AUTOCAST_RMS_NORM_IN_FP32 = torch.__version__ >= (2, 12)


def torch_rms_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """``torch.nn.RMSNorm`` / ``F.rms_norm`` (Wan's Q/K norms, LTX-2's norms)
    under CUDA autocast: torch's own kernel, which does not round before the
    weight multiply (unlike ``rms_norm``); in fp32, with an fp32 result, where
    autocast runs it so."""
    if AUTOCAST_RMS_NORM_IN_FP32:
        x = x.float()
        weight = None if weight is None else weight.float()
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def rms_norm_scale_shift(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    """LTX-2's ``rms_norm(x) * (1 + scale) + shift`` under CUDA autocast: the
    weightless ``torch_rms_norm``, ``1 + scale`` in the modulation's dtype, the
    product and the sum in the norm's output dtype, rounded to ``x``'s dtype
    as autocast rounds it at the Linear that reads it."""
    return (torch_rms_norm(x, None, eps) * (1 + scale) + shift).to(x.dtype)


def rotary_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers ``apply_rotary_emb_qwen(use_real=False)``: interleaved pairs of
    ``x`` [B, S, H, D] as complex64 times the complex table ``freqs``
    [S, D / 2], rounded back to ``x``'s dtype."""
    return _apply_rotary_emb_complex(x, freqs.unsqueeze(1))


def rotary_emb_real(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """diffusers Wan's RoPE: interleaved pairs of ``x`` [B, S, H, D] rotated
    with the real fp32 tables ``cos``/``sin`` [S, D / 2], each product and sum
    in fp32, stored in ``x``'s dtype."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None], sin[None, :, None]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def split_rotary_emb(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """LTX-2's split RoPE (ltx-core ``apply_split_rotary_emb``): each head of
    ``x`` [B, S, H * D] is two halves rotated by the tables [B, H, S, D / 2],
    the cos product and the ``addcmul_`` in the dtype ``x`` and the tables
    promote to. Returns [B, S, H * D] in that dtype."""
    batch, heads, seq_len, _ = cos.shape
    halves = x.reshape(batch, seq_len, heads, -1).swapaxes(1, 2).unflatten(-1, (2, -1))
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = halves * cos
    out[..., :1, :].addcmul_(-sin, halves[..., 1:, :])
    out[..., 1:, :].addcmul_(sin, halves[..., :1, :])
    return out.flatten(-2).swapaxes(1, 2).reshape(batch, seq_len, -1)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """diffusers' ``native`` attention backend on [B, S, H, D] tensors: SDPA
    on the [B, H, S, D] views, with the kernel torch picks for them.
    ``attn_mask`` is passed through (bool, broadcast to [B, H, Sq, Sk])."""
    out = F.scaled_dot_product_attention(
        query.permute(0, 2, 1, 3),
        key.permute(0, 2, 1, 3),
        value.permute(0, 2, 1, 3),
        attn_mask=attn_mask,
        dropout_p=0.0,
        is_causal=False,
    )
    return out.permute(0, 2, 1, 3)


def joint_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``attention`` with ``attn_mask`` a [B, S] bool mask of valid tokens;
    pass None when every token is valid. Without a mask on CUDA the flash
    kernel is pinned, as diffusers' ``_native_flash`` backend does."""
    if attn_mask is not None:
        attn_mask = attn_mask[:, None, None, :]
    pin_flash = attn_mask is None and query.is_cuda
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if pin_flash else nullcontext():
        return attention(query, key, value, attn_mask)


def math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``attention`` on SDPA's math kernel, which LTX-2's RL trainer pins;
    ``attn_mask`` is additive, broadcast to [B, H, Sq, Sk]."""
    with sdpa_kernel(SDPBackend.MATH):
        return attention(query, key, value, attn_mask)


def lora_down(x: torch.Tensor, lora_A: torch.Tensor) -> torch.Tensor:
    """PEFT ``lora.Linear``'s ``lora_A(x)``, with the input cast to the
    adapter's dtype."""
    return F.linear(x.to(lora_A.dtype), lora_A)


def add_lora_up(
    out: torch.Tensor, down: torch.Tensor, lora_B: torch.Tensor, scaling: float
) -> torch.Tensor:
    """PEFT's ``result + lora_B(down) * scaling`` on the base layer's output
    (bias included): ``lora_B(down)`` and its product with ``scaling`` each
    rounded to the adapter's dtype, then the sum."""
    return out + F.linear(down, lora_B) * scaling


def cfg_norm_rescale(combined: torch.Tensor, conditional: torch.Tensor) -> torch.Tensor:
    """The true-CFG rescale ``combined * (|conditional| / |combined|)`` per token,
    run inside the trainer's autocast: ``torch.norm`` is an fp32 op there, so the
    norms and the result are fp32. The clamp guards an all-zero prediction."""
    cond_norm = torch.norm(conditional.float(), dim=-1, keepdim=True)
    noise_norm = torch.norm(combined.float(), dim=-1, keepdim=True).clamp_min(1e-12)
    return combined * (cond_norm / noise_norm)
