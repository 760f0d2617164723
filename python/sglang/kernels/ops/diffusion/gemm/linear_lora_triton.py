# SPDX-License-Identifier: Apache-2.0
"""A linear layer with PEFT's unmerged LoRA update in its epilogue:
``F.linear(x, weight, bias) + F.linear(down, lora_B) * scale`` for BF16
operands, in one persistent kernel that loads its tiles with TMA (Hopper and
later).

Numerics contract: bit-exact vs those aten ops on CUDA, as checked on H200
against cuBLAS at Qwen-Image's shapes:

- ``F.linear(x, weight, bias)``: cuBLAS's kernels for these shapes do not
  split K: they accumulate in FP32 in 16-wide MMA steps in K order from a zero
  accumulator, add the bias in FP32 in their epilogue and round once to BF16.
  The kernel accumulates its K tiles in order with ``tl.dot`` and rounds
  ``acc + bias`` once. cuBLAS picks its kernel per shape and splits K for
  some (small row counts, no bias), which gives other bits: callers compare
  the kernel with the eager chain per shape before trusting it
  (``BitExactFusionGate``).
- the update, its scale and the sum: as ``lora_b_scale_add_triton``, with
  the base read from registers instead of memory.

The base output is never written to memory: the eager chain writes it, reads
it back to add the update, and writes the sum.
"""

import functools

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.diffusion.gemm.lora_b_scale_add_triton import (
    _MAX_RANK,
    _RANK_STEP,
)


@triton.jit
def _store_tile_part(
    acc,
    bias_ptr,
    out_desc,
    down_desc,
    lora_b_desc,
    off_m,
    off_n,
    n_cols,
    scale,
    BLOCK_N: tl.constexpr,
):
    dtype = out_desc.dtype
    cols = off_n + tl.arange(0, BLOCK_N)
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0)
    base = (acc + bias.to(tl.float32)[None, :]).to(dtype)
    update = tl.dot(down_desc.load([off_m, 0]), lora_b_desc.load([off_n, 0]).T)
    update = update.to(dtype).to(tl.float32)
    scaled = (update * scale).to(dtype).to(tl.float32)
    out = (base.to(tl.float32) + scaled).to(dtype)
    out_desc.store([off_m, off_n], out)


@triton.jit(do_not_specialize=["n_rows", "scale", "num_programs"])
def _linear_lora_kernel(
    x_desc,
    weight_desc,
    bias_ptr,
    out_desc,
    down_desc,
    lora_b_desc,
    n_rows,
    n_cols,
    n_inner,
    scale,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_PARTS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    tiles_m = tl.cdiv(n_rows, BLOCK_M)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    group_tiles = GROUP_M * tiles_n
    for tile in tl.range(
        tl.program_id(0),
        tiles_m * tiles_n,
        num_programs,
        flatten=True,
        warp_specialize=WARP_SPECIALIZE,
    ):
        # GROUP_M row tiles share their column tiles of the weight in L2
        group = tile // group_tiles
        group_m = min(tiles_m - group * GROUP_M, GROUP_M)
        off_m = (group * GROUP_M + (tile % group_tiles) % group_m) * BLOCK_M
        off_n = ((tile % group_tiles) // group_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, n_inner, BLOCK_K):
            acc = tl.dot(x_desc.load([off_m, k]), weight_desc.load([off_n, k]).T, acc)
        if EPILOGUE_PARTS == 2:
            # two half-width epilogues hold fewer registers than one
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            _store_tile_part(
                left,
                bias_ptr,
                out_desc,
                down_desc,
                lora_b_desc,
                off_m,
                off_n,
                n_cols,
                scale,
                BLOCK_N // 2,
            )
            _store_tile_part(
                right,
                bias_ptr,
                out_desc,
                down_desc,
                lora_b_desc,
                off_m,
                off_n + BLOCK_N // 2,
                n_cols,
                scale,
                BLOCK_N // 2,
            )
        else:
            _store_tile_part(
                acc,
                bias_ptr,
                out_desc,
                down_desc,
                lora_b_desc,
                off_m,
                off_n,
                n_cols,
                scale,
                BLOCK_N,
            )


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps, epilogue parts,
# warp specialization)
Tiles = tuple[int, int, int, int, int, int, int, bool]


def _tiles(n_rows: int) -> Tiles:
    """The fastest on H200 at Qwen-Image's shapes (211 to 4096 rows, widths 3072
    and 12288, rank 64), of eight tile choices that each gave cuBLAS's bits."""
    if n_rows >= 1024:
        return (128, 256, 64, 8, 3, 8, 2, True)
    return (64, 128, 64, 8, 4, 4, 1, False)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_ready(t: torch.Tensor) -> bool:
    # TMA wants 16-byte aligned base addresses and row strides
    return t.data_ptr() % 16 == 0 and all(
        s * t.element_size() % 16 == 0 for s in t.stride()[:-1]
    )


def can_use_linear_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    down: torch.Tensor,
    lora_B: torch.Tensor,
) -> bool:
    """Contiguous BF16 CUDA ``x`` [..., K], ``weight`` [N, K], ``bias`` [N],
    ``down`` [..., R] and ``lora_B`` [N, R], R a multiple of 16 up to 128, on
    a GPU with TMA (compute capability 9.0 or later)."""
    rank = lora_B.shape[-1]
    return (
        x.is_cuda
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and all(
            t.dtype == torch.bfloat16 and t.device == x.device and t.is_contiguous()
            for t in (x, weight, bias, down, lora_B)
        )
        and x.numel() > 0
        and weight.dim() == 2
        and lora_B.dim() == 2
        and rank % _RANK_STEP == 0
        and 0 < rank <= _MAX_RANK
        and weight.shape[1] == x.shape[-1]
        and bias.shape == (weight.shape[0],)
        and down.shape == (*x.shape[:-1], rank)
        and lora_B.shape == (weight.shape[0], rank)
        and all(_tma_ready(t) for t in (x, weight, down, lora_B))
        and weight.shape[0] % 8 == 0
    )


def linear_lora_bf16(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    down: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) + F.linear(down, lora_B) * scale`` for
    operands that ``can_use_linear_lora`` takes. ``tiles`` overrides the tile
    choice (``Tiles``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not can_use_linear_lora(x, weight, bias, down, lora_B):
        raise RuntimeError(
            "linear_lora_bf16 expects contiguous, 16-byte aligned BF16 CUDA x "
            "[..., K], weight [N, K] (N a multiple of 8), bias [N], down [..., R] "
            "and lora_B [N, R] with R a multiple of 16 up to 128, on compute "
            "capability 9.0 or later"
        )
    n_cols, n_inner = weight.shape
    rank = lora_B.shape[-1]
    x2 = x.view(-1, n_inner)
    n_rows = x2.shape[0]
    out = x.new_empty(*x.shape[:-1], n_cols)
    block_m, block_n, block_k, group_m, stages, warps, parts, specialize = (
        tiles or _tiles(n_rows)
    )
    part_n = block_n // parts
    num_programs = min(
        _num_sms(x.device), triton.cdiv(n_rows, block_m) * triton.cdiv(n_cols, block_n)
    )
    with torch.cuda.device(x.device):
        _linear_lora_kernel[(num_programs,)](
            TensorDescriptor.from_tensor(x2, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [block_n, block_k]),
            bias,
            TensorDescriptor.from_tensor(out.view(n_rows, n_cols), [block_m, part_n]),
            TensorDescriptor.from_tensor(down.view(n_rows, rank), [block_m, rank]),
            TensorDescriptor.from_tensor(lora_B, [part_n, rank]),
            n_rows,
            n_cols,
            n_inner,
            scale,
            num_programs,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=group_m,
            EPILOGUE_PARTS=parts,
            WARP_SPECIALIZE=specialize,
            num_stages=stages,
            num_warps=warps,
            enable_fp_fusion=False,
        )
    return out
