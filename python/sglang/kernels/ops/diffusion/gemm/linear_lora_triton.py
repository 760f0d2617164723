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

``linear_lora_gelu_bf16`` adds tanh GELU (the MLP up-projection's activation),
looked up in aten's table as ``lora_b_scale_add_triton`` does. An epilogue
that long would stall the tensor cores, so it overlaps the program's next
tile instead: each program stores its tile's rounded ``acc + bias`` and
finishes it, one column slice per K step, while the MMAs of its next tile
run. A slice's LoRA-B MMA is issued before the K step's MMA, whose wait then
covers both; its loads, roundings and table reads run during the K step's
MMA. The program's last tile is finished after its loop.
"""

import functools

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.diffusion.gemm.lora_b_scale_add_triton import (
    _MAX_RANK,
    _RANK_STEP,
    gelu_tanh_table,
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


@triton.jit
def _tile_offsets(
    tile,
    tiles_m,
    tiles_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # GROUP_M row tiles share their column tiles of the weight in L2
    group_tiles = GROUP_M * tiles_n
    group = tile // group_tiles
    group_m = min(tiles_m - group * GROUP_M, GROUP_M)
    off_m = (group * GROUP_M + (tile % group_tiles) % group_m) * BLOCK_M
    off_n = ((tile % group_tiles) // group_m) * BLOCK_N
    return off_m, off_n


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
    for tile in tl.range(
        tl.program_id(0),
        tiles_m * tiles_n,
        num_programs,
        flatten=True,
        warp_specialize=WARP_SPECIALIZE,
    ):
        off_m, off_n = _tile_offsets(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
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


@triton.jit
def _scaled_update(down, lora_b_ptr, cols, n_cols, scale, RANK: tl.constexpr):
    # RN(RN(down @ lora_B[cols]^T) * scale)
    ks = tl.arange(0, RANK)
    lora_b = tl.load(
        lora_b_ptr + cols[None, :] * RANK + ks[:, None],
        mask=cols[None, :] < n_cols,
        other=0.0,
    )
    update = tl.dot(down, lora_b).to(tl.bfloat16).to(tl.float32)
    return (update * scale).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _finish_slice(out_ptr, scaled, gelu_table_ptr, rows, cols, n_rows, n_cols, valid):
    # GELU(RN(base + scaled)) over the stored base
    mask = valid & (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    base = tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    bits = (base + scaled).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    out = tl.load(gelu_table_ptr + (bits & 0xFFFF), mask=mask)
    tl.store(out_ptr + offsets, out, mask=mask)


@triton.jit
def _load_down(down_ptr, rows, n_rows, valid, RANK: tl.constexpr):
    ks = tl.arange(0, RANK)
    return tl.load(
        down_ptr + rows[:, None].to(tl.int64) * RANK + ks[None, :],
        mask=valid & (rows[:, None] < n_rows),
        other=0.0,
    )


@triton.jit(do_not_specialize=["n_rows", "scale", "num_programs"])
def _linear_lora_gelu_kernel(
    x_desc,
    weight_desc,
    bias_ptr,
    out_ptr,
    down_ptr,
    lora_b_ptr,
    gelu_table_ptr,
    n_rows,
    n_cols,
    n_inner,
    scale,
    num_programs,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SLICE_N: tl.constexpr,
):
    tiles_m = tl.cdiv(n_rows, BLOCK_M)
    tiles_n = tl.cdiv(n_cols, BLOCK_N)
    # the previous tile, finished during this one's first K steps; runtime
    # values, as the loop reassigns them
    prev_m = tl.program_id(0) * 0
    prev_n = prev_m
    has_prev = prev_m < 0
    for tile in range(tl.program_id(0), tiles_m * tiles_n, num_programs):
        off_m, off_n = _tile_offsets(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
        prev_rows = prev_m + tl.arange(0, BLOCK_M)
        prev_down = _load_down(down_ptr, prev_rows, n_rows, has_prev, RANK)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, BLOCK_N // SLICE_N):
            cols = prev_n + s * SLICE_N + tl.arange(0, SLICE_N)
            # issued before the K step's MMA, so that waiting for it leaves
            # that MMA running while the slice is finished
            scaled = _scaled_update(prev_down, lora_b_ptr, cols, n_cols, scale, RANK)
            k = s * BLOCK_K
            acc = tl.dot(x_desc.load([off_m, k]), weight_desc.load([off_n, k]).T, acc)
            _finish_slice(
                out_ptr,
                scaled,
                gelu_table_ptr,
                prev_rows,
                cols,
                n_rows,
                n_cols,
                has_prev,
            )
        for k in range(BLOCK_N // SLICE_N * BLOCK_K, n_inner, BLOCK_K):
            acc = tl.dot(x_desc.load([off_m, k]), weight_desc.load([off_n, k]).T, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        bias = tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0)
        tl.store(
            out_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :],
            (acc + bias.to(tl.float32)[None, :]).to(tl.bfloat16),
            mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols),
        )
        # the next tile's slices read what every thread of the program stored
        tl.debug_barrier()
        prev_m = off_m
        prev_n = off_n
        has_prev = off_m >= 0
    prev_rows = prev_m + tl.arange(0, BLOCK_M)
    prev_down = _load_down(down_ptr, prev_rows, n_rows, has_prev, RANK)
    for s in range(0, BLOCK_N // SLICE_N):
        cols = prev_n + s * SLICE_N + tl.arange(0, SLICE_N)
        scaled = _scaled_update(prev_down, lora_b_ptr, cols, n_cols, scale, RANK)
        _finish_slice(
            out_ptr, scaled, gelu_table_ptr, prev_rows, cols, n_rows, n_cols, has_prev
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


def _num_programs(
    device: torch.device, n_rows: int, n_cols: int, block_m: int, block_n: int
) -> int:
    # persistent: one program per SM, at most one per tile
    tiles = triton.cdiv(n_rows, block_m) * triton.cdiv(n_cols, block_n)
    return min(_num_sms(device), tiles)


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
    num_programs = _num_programs(x.device, n_rows, n_cols, block_m, block_n)
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


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps, SLICE_N)
GeluTiles = tuple[int, int, int, int, int, int, int]
_GELU_TILES: GeluTiles = (128, 256, 64, 8, 3, 8, 16)


def _finishing_steps(tiles: GeluTiles) -> int:
    # the K steps that finish the previous tile, one slice each
    block_n, block_k, slice_n = tiles[1], tiles[2], tiles[6]
    return block_n // slice_n * block_k


def can_use_linear_lora_gelu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    down: torch.Tensor,
    lora_B: torch.Tensor,
) -> bool:
    """The operands ``can_use_linear_lora`` takes, with K long enough for the
    K steps that finish the previous tile (1024)."""
    return can_use_linear_lora(x, weight, bias, down, lora_B) and x.shape[
        -1
    ] >= _finishing_steps(_GELU_TILES)


def linear_lora_gelu_bf16(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    down: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    tiles: GeluTiles | None = None,
) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias) + F.linear(down, lora_B) * scale,
    approximate="tanh")`` for operands that ``can_use_linear_lora_gelu``
    takes. ``tiles`` overrides the tile choice (``GeluTiles``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tiles = tiles or _GELU_TILES
    if not (
        can_use_linear_lora(x, weight, bias, down, lora_B)
        and x.shape[-1] >= _finishing_steps(tiles)
    ):
        raise RuntimeError(
            "linear_lora_gelu_bf16 expects the operands linear_lora_bf16 takes, "
            f"with K at least {_finishing_steps(tiles)}"
        )
    n_cols, n_inner = weight.shape
    x2 = x.view(-1, n_inner)
    n_rows = x2.shape[0]
    out = x.new_empty(*x.shape[:-1], n_cols)
    block_m, block_n, block_k, group_m, stages, warps, slice_n = tiles
    num_programs = _num_programs(x.device, n_rows, n_cols, block_m, block_n)
    with torch.cuda.device(x.device):
        _linear_lora_gelu_kernel[(num_programs,)](
            TensorDescriptor.from_tensor(x2, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [block_n, block_k]),
            bias,
            out,
            down,
            lora_B,
            gelu_tanh_table(x.device),
            n_rows,
            n_cols,
            n_inner,
            scale,
            num_programs,
            RANK=lora_B.shape[-1],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=group_m,
            SLICE_N=slice_n,
            num_stages=stages,
            num_warps=warps,
            enable_fp_fusion=False,
        )
    return out
