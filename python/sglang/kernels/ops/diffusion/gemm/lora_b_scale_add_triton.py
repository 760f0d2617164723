# SPDX-License-Identifier: Apache-2.0
"""PEFT's unmerged LoRA epilogue with its up-projection in one kernel:
``base + F.linear(down, lora_B) * scale`` for BF16 operands, optionally
followed by tanh GELU (the MLP up-projection's activation).

Numerics contract: bit-exact vs those aten ops on CUDA, as checked on H200
against cuBLAS for ranks 16 to 128:

- ``F.linear(down, lora_B)``: the rank (K) is small, so cuBLAS does not split
  it: it accumulates in FP32 in 16-wide MMA steps in K order from a zero
  accumulator and rounds once to BF16. The kernel accumulates the same steps
  in the same order with ``tl.dot`` (a 64-wide ``tl.dot`` issues four 16-wide
  MMAs in K order). Reversing the K order changes the bits, so the order is
  observable; cuBLAS does not promise it, and callers compare the kernel with
  the eager chain before trusting it (``BitExactFusionGate``).
- ``* scale``: FP32 product with the Python float as FP32, rounded to BF16.
- ``base + ...``: FP32 sum rounded to BF16.
- ``F.gelu(..., approximate="tanh")``: aten's FP32 formula, with the
  ``x + kappa * x^3`` that nvcc contracts into one FMA and libdevice's
  ``tanhf``, rounded to BF16. ``tanhf`` is data dependent, so callers check
  it on every BF16 input, not only on the first call's data.

The update is never written to memory: the kernel reads ``base`` once and
writes the result once, where the eager chain writes the update, reads it
back with ``base`` and writes the sum (and GELU reads and writes it again).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

_RANK_STEP = 16
_MAX_RANK = 128


@triton.jit
def _gelu_tanh(x):
    # aten's GeluCUDAKernelImpl (tanh): beta * (x + kappa * x^3), contracted
    inner = 0.7978845608028654 * tl.fma(0.044715, x * x * x, x)
    return 0.5 * x * (1.0 + libdevice.tanh(inner))


@triton.jit(do_not_specialize=["n_rows", "scale"])
def _lora_b_scale_add_kernel(
    out_ptr,
    base_ptr,
    down_ptr,
    lora_b_ptr,
    scale,
    n_rows,
    n_cols,
    RANK: tl.constexpr,
    GELU_TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    update = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(0, RANK, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        down = tl.load(
            down_ptr + rows[:, None] * RANK + ks[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )
        lora_b = tl.load(
            lora_b_ptr + cols[None, :] * RANK + ks[:, None],
            mask=col_mask[None, :],
            other=0.0,
        )
        update = tl.dot(down, lora_b, update)
    update = update.to(tl.bfloat16).to(tl.float32)
    scaled = (update * scale).to(tl.bfloat16).to(tl.float32)
    offsets = rows[:, None] * n_cols + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    base = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = (base + scaled).to(tl.bfloat16)
    if GELU_TANH:
        out = _gelu_tanh(out.to(tl.float32)).to(tl.bfloat16)
    tl.store(out_ptr + offsets, out, mask=mask)


def _tiles(gelu_tanh: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): the fastest on H200 at Qwen-Image's
    shapes (77 to 8192 rows, widths 3072 and 12288, rank 64). Each of 15 tile
    choices gave the same bits; the GELU's ``tanhf`` wants smaller tiles."""
    return (32, 64, 64, 4) if gelu_tanh else (64, 128, 64, 4)


def can_use_lora_b_scale_add(
    base: torch.Tensor, down: torch.Tensor, lora_B: torch.Tensor
) -> bool:
    """Contiguous BF16 CUDA ``base`` [..., N], ``down`` [..., R] and ``lora_B``
    [N, R], R a multiple of 16 up to 128."""
    rank = lora_B.shape[-1]
    return (
        base.is_cuda
        and all(
            t.dtype == torch.bfloat16 and t.device == base.device and t.is_contiguous()
            for t in (base, down, lora_B)
        )
        and base.numel() > 0
        and lora_B.dim() == 2
        and rank % _RANK_STEP == 0
        and 0 < rank <= _MAX_RANK
        and down.shape == (*base.shape[:-1], rank)
        and lora_B.shape[0] == base.shape[-1]
    )


def lora_b_scale_add_bf16(
    base: torch.Tensor,
    down: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    gelu_tanh: bool = False,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``base + F.linear(down, lora_B) * scale``, through tanh GELU if
    ``gelu_tanh``, for operands that ``can_use_lora_b_scale_add`` takes.
    ``tiles`` overrides the (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) choice."""
    if not can_use_lora_b_scale_add(base, down, lora_B):
        raise RuntimeError(
            "lora_b_scale_add_bf16 expects contiguous BF16 CUDA base [..., N], "
            "down [..., R] and lora_B [N, R] with R a multiple of 16 up to 128"
        )
    n_cols, rank = base.shape[-1], lora_B.shape[-1]
    n_rows = base.numel() // n_cols
    block_m, block_n, block_k, num_warps = tiles or _tiles(gelu_tanh)
    block_k = min(block_k, rank & -rank)  # the largest power of two dividing R
    out = torch.empty_like(base)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    with torch.cuda.device(base.device):
        _lora_b_scale_add_kernel[grid](
            out,
            base,
            down,
            lora_B,
            scale,
            n_rows,
            n_cols,
            RANK=rank,
            GELU_TANH=gelu_tanh,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=num_warps,
            enable_fp_fusion=False,
        )
    return out
