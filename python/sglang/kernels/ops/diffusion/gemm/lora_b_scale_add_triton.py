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
- ``F.gelu(..., approximate="tanh")``: its input is the BF16 sum, so its
  output depends on those 16 bits alone; the kernel looks it up in a table of
  aten's own GELU of every BF16 value, computed once per device
  (``gelu_tanh_table``). The table is the function, where an FP32 formula
  would have to reproduce nvcc's FMA contraction and libdevice's ``tanhf``
  instruction for instruction, and costs one cached load per element in
  place of some thirty FP32 instructions. Callers still check the lookup on
  every BF16 input.

The update is never written to memory: the kernel reads ``base`` once and
writes the result once, where the eager chain writes the update, reads it
back with ``base`` and writes the sum (and GELU reads and writes it again).
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_RANK_STEP = 16
_MAX_RANK = 128


@functools.cache
def gelu_tanh_table(device: torch.device) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` of every BF16 ``x``, indexed by the
    bits of ``x`` read as an unsigned 16-bit integer."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the GELU table is built outside CUDA-graph capture")
    bits = torch.arange(2**16, dtype=torch.int32, device=device)
    values = torch.where(bits < 2**15, bits, bits - 2**16).to(torch.int16)
    return F.gelu(values.view(torch.bfloat16), approximate="tanh")


@triton.jit(do_not_specialize=["n_rows", "scale"])
def _lora_b_scale_add_kernel(
    out_ptr,
    base_ptr,
    down_ptr,
    lora_b_ptr,
    gelu_table_ptr,
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
        bits = out.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        out = tl.load(gelu_table_ptr + bits, mask=mask)
    tl.store(out_ptr + offsets, out, mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps): the fastest on H200 at Qwen-Image's
# shapes (77 to 8192 rows, widths 3072 and 12288, rank 64), with and without
# the GELU. Each of 15 tile choices gave the same bits.
_TILES = (64, 128, 64, 4)


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
    block_m, block_n, block_k, num_warps = tiles or _TILES
    block_k = min(block_k, rank & -rank)  # the largest power of two dividing R
    out = torch.empty_like(base)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
    with torch.cuda.device(base.device):
        _lora_b_scale_add_kernel[grid](
            out,
            base,
            down,
            lora_B,
            gelu_tanh_table(base.device) if gelu_tanh else out,
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
