# SPDX-License-Identifier: Apache-2.0
"""Q/K RMSNorm + complex RoPE written into a joint-sequence buffer.

Numerics contract: bit-exact vs the eager chain of diffusers' ``RMSNorm``
with a BF16 weight followed by complex64 RoPE on CUDA::

    variance = x.float().pow(2).mean(-1, keepdim=True)
    y = (x * torch.rsqrt(variance + eps)).to(bf16) * weight
    out = view_as_real(view_as_complex(y.float()) * freqs).to(bf16)

- ``pow(2)`` is one rounding per element; the mean is aten's reduction of
  a contiguous 128-wide fp32 row on CUDA (torch >= 2.10): lane ``l`` sums
  its float4 ``s[4l..4l+3]`` left to right, the 32 lane partials fold with
  ``shfl_down`` offsets 16, 8, 4, 2, 1, and the sum is multiplied by 1/128.
  One row per warp, each lane loading its four components as one vector,
  makes ``tl.sum`` over the lanes the same butterfly (as
  ``qknorm_complex_rope_triton``); more rows per warp would change it.
- ``rsqrt.approx.f32`` without flush-to-zero, as ``rsqrtf``.
- The normalized value rounds to BF16 before the weight multiply.
- The complex multiply contracts one product into an FMA on each part, as
  PyTorch's CUDA build does; which imaginary product is contracted differs
  between builds and is probed at runtime (``_fuse_real_sin``). The other
  product is negated exactly, signed zeros included.

Bit-exactness depends on the installed torch's reduction and complex
multiply, so callers verify the kernel against the live eager chain on
first use and fall back on a mismatch.

Q and K share one launch; a program runs one token of one of them, so the
token's RoPE row and the weight are loaded once for all its heads and every
address is a per-token scalar plus a head offset. Rows are read from
contiguous ``[B, S, H, 128]`` tensors and written at ``[:, offset:offset +
S]`` of ``[B, S_joint, H, 128]`` buffers, so a joint text + image sequence
needs no ``torch.cat``. The head count is compiled in; batch, sequence length
and offset are runtime arguments: a new prompt length does not recompile.
"""

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.diffusion.rope.complex_rope_triton import _fuse_real_sin

_HEAD_DIM = 128
# One row per warp: the reduction order depends on it. A program runs a
# token's heads in groups of _ROWS, loading the next group while it computes one.
_ROWS = 4


@triton.jit
def _row_offsets(ROWS: tl.constexpr):
    # [ROWS * 32, 4]: lane l of row r's warp loads the float4 s[4l..4l+3] of
    # aten's reduction, complex numbers 2l and 2l + 1 of the row. One flat
    # lane dimension lets the compiler give each warp one row (with separate
    # row and lane dimensions, Triton 3.6 spreads a row over four warps).
    return tl.arange(0, ROWS * 32)[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _pairs(x, ROWS: tl.constexpr):
    # [ROWS * 32, 4] -> [ROWS, 32, 2 numbers, 2 parts]
    return tl.reshape(x, (ROWS, 32, 2, 2))


@triton.jit
def _norm_rope(value, weight, cos, sin, eps, FUSE_REAL_SIN: tl.constexpr):
    value = value.to(tl.float32)
    # split (number i, part j) -> s[4l + 2i + j]
    even, odd = tl.split(value * value)
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    variance = tl.sum(((s0 + s1) + s2) + s3, 1) * 0.0078125
    inv = tl.rsqrt(variance + eps)
    value = (value * inv[:, None, None, None]).to(tl.bfloat16).to(tl.float32)
    value = (value * weight).to(tl.bfloat16).to(tl.float32)
    real, imag = tl.split(value)
    # ``* -1.0`` negates as aten's FFMA does; Triton's ``-x`` is ``0 - x``,
    # which turns -0.0 into +0.0
    out_real = tl.fma(real, cos, (imag * sin) * -1.0)
    if FUSE_REAL_SIN:
        out_imag = tl.fma(real, sin, imag * cos)
    else:
        out_imag = tl.fma(imag, cos, real * sin)
    return tl.join(out_real, out_imag)


@triton.jit(do_not_specialize=["seq_len", "joint_len", "offset"])
def _qknorm_complex_rope_joint_kernel(
    q_ptr,
    k_ptr,
    q_weight_ptr,
    k_weight_ptr,
    rope_ptr,
    q_out_ptr,
    k_out_ptr,
    seq_len,
    joint_len,
    offset,
    eps,
    HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    FUSE_REAL_SIN: tl.constexpr,
):
    if tl.program_id(1) == 0:
        x_ptr, weight_ptr, out_ptr = q_ptr, q_weight_ptr, q_out_ptr
    else:
        x_ptr, weight_ptr, out_ptr = k_ptr, k_weight_ptr, k_out_ptr
    token = tl.program_id(0)
    position = token % seq_len
    x_ptr += token.to(tl.int64) * (HEADS * 128)
    # in whole tokens, so that the compiler sees 128-element aligned rows
    out_token = (token // seq_len).to(tl.int64) * joint_len + offset + position
    out_ptr += out_token * (HEADS * 128)
    offsets = _row_offsets(ROWS)
    weight = _pairs(tl.load(weight_ptr + _row_offsets(1)), 1).to(tl.float32)
    rotation = tl.load(rope_ptr + position.to(tl.int64) * 128 + _row_offsets(1))
    cos, sin = tl.split(_pairs(rotation, 1))
    head = (tl.arange(0, ROWS * 32) // 32)[:, None]
    value = tl.load(x_ptr + offsets, head < HEADS, 0.0)
    for group in tl.static_range(triton.cdiv(HEADS, ROWS)):
        row_offsets = offsets + group * ROWS * 128
        if (group + 1) * ROWS < HEADS:
            next_value = tl.load(
                x_ptr + row_offsets + ROWS * 128, head + (group + 1) * ROWS < HEADS, 0.0
            )
        out = _norm_rope(_pairs(value, ROWS), weight, cos, sin, eps, FUSE_REAL_SIN)
        tl.store(
            out_ptr + row_offsets,
            tl.reshape(out, (ROWS * 32, 4)).to(out_ptr.dtype.element_ty),
            head + group * ROWS < HEADS,
        )
        if (group + 1) * ROWS < HEADS:
            value = next_value


def _validate(q, k, q_weight, k_weight, rope, q_out, k_out, offset):
    batch, seq_len, heads, head_dim = q.shape
    if not (
        q.is_cuda
        and torch.version.hip is None
        and q.dtype == torch.bfloat16
        and head_dim == _HEAD_DIM
        and q.numel() > 0
        and q.is_contiguous()
        and k.shape == q.shape
        and k.dtype == q.dtype
        and k.device == q.device
        and k.is_contiguous()
        and all(
            w.shape == (head_dim,)
            and w.dtype == q.dtype
            and w.device == q.device
            and w.is_contiguous()
            for w in (q_weight, k_weight)
        )
        and rope.dtype == torch.complex64
        and rope.device == q.device
        and rope.shape == (seq_len, head_dim // 2)
        and rope.is_contiguous()
        and all(
            out.dtype == q.dtype
            and out.device == q.device
            and out.is_contiguous()
            and out.shape[0] == batch
            and out.shape[2:] == q.shape[2:]
            for out in (q_out, k_out)
        )
        and q_out.shape == k_out.shape
        and 0 <= offset <= q_out.shape[1] - seq_len
    ):
        raise RuntimeError(
            "qknorm_complex_rope_joint expects contiguous BF16 CUDA q/k "
            "[B, S, H, 128], BF16 [128] weights, complex64 [S, 64] rope and "
            "contiguous [B, S_joint, H, 128] outputs holding rows offset:offset+S"
        )


def qknorm_complex_rope_joint_(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    rope: torch.Tensor,
    eps: float,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    offset: int,
    rows: int = _ROWS,
) -> None:
    """Write the RMSNorm + complex RoPE of ``q`` and ``k`` ([B, S, H, 128])
    into ``q_out[:, offset:offset + S]`` and ``k_out[:, offset:offset + S]``
    ([B, S_joint, H, 128]). ``rows`` overrides the heads per group (one per
    warp)."""
    _validate(q, k, q_weight, k_weight, rope, q_out, k_out, offset)
    batch, seq_len, heads, head_dim = q.shape
    with torch.cuda.device(q.device):
        _qknorm_complex_rope_joint_kernel[(batch * seq_len, 2)](
            q,
            k,
            q_weight,
            k_weight,
            torch.view_as_real(rope),
            q_out,
            k_out,
            seq_len,
            q_out.shape[1],
            offset,
            eps,
            HEADS=heads,
            ROWS=rows,
            FUSE_REAL_SIN=_fuse_real_sin(q.device),
            num_warps=rows,
            enable_fp_fusion=False,
            enable_reflect_ftz=False,
        )
