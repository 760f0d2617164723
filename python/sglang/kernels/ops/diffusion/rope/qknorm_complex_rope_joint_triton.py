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
  Four rows on four warps give each lane those four components and make
  ``tl.sum`` over the lanes the same butterfly (as
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

Q and K share one launch. Rows are read from contiguous ``[B, S, H, 128]``
tensors and written at ``[:, offset:offset + S]`` of ``[B, S_joint, H,
128]`` buffers, so a joint text + image sequence needs no ``torch.cat``.
Shapes are runtime arguments: a new prompt length does not recompile.
"""

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.diffusion.rope.complex_rope_triton import _fuse_real_sin

_HEAD_DIM = 128
# One row per warp: the reduction order depends on it. Each program runs
# _GROUPS groups of _ROWS rows, loading the next group while it computes one
# (7% faster than one group at 4096 x 24 rows on H200).
_ROWS = 4
_GROUPS = 4
_WARPS = 4


@triton.jit
def _load_rows(x_ptr, rope_ptr, row, n_rows, seq_len, heads):
    column = tl.arange(0, 128)
    mask = (row < n_rows)[:, None]
    value = tl.load(x_ptr + row[:, None] * 128 + column[None, :], mask, 0.0)
    token = row // heads % seq_len
    rotation = tl.load(rope_ptr + token[:, None] * 128 + column[None, :], mask, 0.0)
    return value, rotation


@triton.jit
def _norm_rope_store(
    value,
    rotation,
    weight,
    out_ptr,
    row,
    n_rows,
    seq_len,
    heads,
    out_batch_stride,
    out_offset,
    eps,
    ROWS: tl.constexpr,
    FUSE_REAL_SIN: tl.constexpr,
):
    column = tl.arange(0, 128)
    value = value.to(tl.float32)
    # lane l owns s[4l..4l+3]: split (l, i, j) -> s[4l + 2i + j]
    even, odd = tl.split(tl.reshape(value * value, (ROWS, 32, 2, 2)))
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    variance = tl.sum(((s0 + s1) + s2) + s3, 1) * 0.0078125
    inv = tl.rsqrt(variance + eps)
    value = (value * inv[:, None]).to(tl.bfloat16).to(tl.float32)
    value = (value * weight[None, :]).to(tl.bfloat16).to(tl.float32)
    real, imag = tl.split(tl.reshape(value, (ROWS, 64, 2)))
    cos, sin = tl.split(tl.reshape(rotation, (ROWS, 64, 2)))
    # ``* -1.0`` negates as aten's FFMA does; Triton's ``-x`` is ``0 - x``,
    # which turns -0.0 into +0.0
    out_real = tl.fma(real, cos, (imag * sin) * -1.0)
    if FUSE_REAL_SIN:
        out_imag = tl.fma(real, sin, imag * cos)
    else:
        out_imag = tl.fma(imag, cos, real * sin)
    out = tl.reshape(tl.join(out_real, out_imag), (ROWS, 128))
    batch_rows = seq_len * heads
    target = (row // batch_rows) * out_batch_stride + out_offset
    target += (row % batch_rows) * 128
    tl.store(
        out_ptr + target[:, None] + column[None, :],
        out.to(out_ptr.dtype.element_ty),
        (row < n_rows)[:, None],
    )


@triton.jit(
    do_not_specialize=["n_rows", "seq_len", "heads", "out_batch_stride", "out_offset"]
)
def _qknorm_complex_rope_joint_kernel(
    q_ptr,
    k_ptr,
    q_weight_ptr,
    k_weight_ptr,
    rope_ptr,
    q_out_ptr,
    k_out_ptr,
    n_rows,
    seq_len,
    heads,
    out_batch_stride,
    out_offset,
    eps,
    ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    FUSE_REAL_SIN: tl.constexpr,
):
    if tl.program_id(1) == 0:
        x_ptr, weight_ptr, out_ptr = q_ptr, q_weight_ptr, q_out_ptr
    else:
        x_ptr, weight_ptr, out_ptr = k_ptr, k_weight_ptr, k_out_ptr
    weight = tl.load(weight_ptr + tl.arange(0, 128)).to(tl.float32)
    row = tl.program_id(0).to(tl.int64) * (GROUPS * ROWS) + tl.arange(0, ROWS)
    value, rotation = _load_rows(x_ptr, rope_ptr, row, n_rows, seq_len, heads)
    for group in tl.static_range(GROUPS):
        if group + 1 < GROUPS:
            next_value, next_rotation = _load_rows(
                x_ptr, rope_ptr, row + ROWS, n_rows, seq_len, heads
            )
        _norm_rope_store(
            value,
            rotation,
            weight,
            out_ptr,
            row,
            n_rows,
            seq_len,
            heads,
            out_batch_stride,
            out_offset,
            eps,
            ROWS,
            FUSE_REAL_SIN,
        )
        if group + 1 < GROUPS:
            value, rotation, row = next_value, next_rotation, row + ROWS


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
    tiles: tuple[int, int, int] | None = None,
) -> None:
    """Write the RMSNorm + complex RoPE of ``q`` and ``k`` ([B, S, H, 128])
    into ``q_out[:, offset:offset + S]`` and ``k_out[:, offset:offset + S]``
    ([B, S_joint, H, 128]). ``tiles`` overrides (rows per group, groups per
    program, num_warps)."""
    _validate(q, k, q_weight, k_weight, rope, q_out, k_out, offset)
    batch, seq_len, heads, head_dim = q.shape
    n_rows = batch * seq_len * heads
    rows, groups, num_warps = tiles or (_ROWS, _GROUPS, _WARPS)
    with torch.cuda.device(q.device):
        _qknorm_complex_rope_joint_kernel[(triton.cdiv(n_rows, rows * groups), 2)](
            q,
            k,
            q_weight,
            k_weight,
            torch.view_as_real(rope),
            q_out,
            k_out,
            n_rows,
            seq_len,
            heads,
            q_out.stride(0),
            offset * heads * head_dim,
            eps,
            ROWS=rows,
            GROUPS=groups,
            FUSE_REAL_SIN=_fuse_real_sin(q.device),
            num_warps=num_warps,
            enable_fp_fusion=False,
            enable_reflect_ftz=False,
        )
