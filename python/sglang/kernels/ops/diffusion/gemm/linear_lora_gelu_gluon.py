# SPDX-License-Identifier: Apache-2.0
"""An MLP up-projection with PEFT's unmerged LoRA update and tanh GELU:
``F.gelu(F.linear(x, weight, bias) + F.linear(down, lora_B) * scale,
approximate="tanh")`` for BF16 operands, in one persistent warp-specialized
Gluon kernel for Hopper (sm_90a).

An 8-warp partition loads the operand tiles with TMA, runs the K loop's
``wgmma``s on a 128 x 256 tile and rounds ``acc + bias`` to BF16 into a
shared-memory buffer. A 4-warp partition takes the buffer, adds the update
in 64-column slices, looks up the GELU and stores the tile with TMA, while
the first partition already runs the next tile's K loop: the epilogue costs
no MMA time, where in the MMA warps' own epilogue the GELU stalled them.

Numerics contract: bit-exact vs those aten ops on CUDA, as checked on H100
against cuBLAS at Qwen-Image's shapes:

- ``F.linear(x, weight, bias)``: as ``linear_lora_triton``, 16-wide MMA steps
  in K order from a zero accumulator, the bias added in FP32, one rounding.
- the update, its scale, the sum and the GELU: as ``lora_b_scale_add_triton``
  (the GELU looked up in ``gelu_tanh_table``).

The order of the base GEMM's K steps is cuBLAS's for these shapes, not a
property cuBLAS states: callers compare the kernel with the eager chain per
shape before trusting it (``BitExactFusionGate``).
"""

import functools
import inspect

import torch
import triton

from sglang.kernels.ops.diffusion.gemm.linear_lora_triton import (
    _num_sms,
    can_use_linear_lora,
)
from sglang.kernels.ops.diffusion.gemm.lora_b_scale_add_triton import gelu_tanh_table

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the list-of-partitions form this kernel is written in (Triton 3.6 on)
    _HAS_GLUON = (
        "functions_and_args" in inspect.signature(gl.warp_specialize).parameters
    )
except ImportError:
    _HAS_GLUON = False

_BLOCK_M, _BLOCK_N, _BLOCK_K = 128, 256, 64
_GROUP_M, _STAGES, _SLICE_N = 8, 3, 64
_EPILOGUE_WARPS, _EPILOGUE_REGS = 4, 128
# the epilogue's LoRA-B MMA takes the whole rank at once (a power of two), and
# its slice and the base tile fill the shared memory the stages leave
_RANKS = (16, 32, 64)


if _HAS_GLUON:

    @gluon.jit
    def _tile_offsets(
        tile,
        n_rows,
        n_cols,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        GROUP_M: gl.constexpr,
    ):
        # GROUP_M row tiles share their column tiles of the weight in L2
        tiles_m = gl.cdiv(n_rows, BLOCK_M)
        group_tiles = GROUP_M * gl.cdiv(n_cols, BLOCK_N)
        group = tile // group_tiles
        group_m = min(tiles_m - group * GROUP_M, GROUP_M)
        off_m = (group * GROUP_M + (tile % group_tiles) % group_m) * BLOCK_M
        off_n = ((tile % group_tiles) // group_m) * BLOCK_N
        return off_m, off_n

    @gluon.jit
    def _issue_loads(
        step,
        tile,
        k_step,
        my_tiles,
        k_steps,
        off_m,
        off_n,
        x_desc,
        w_desc,
        a_bufs,
        b_bufs,
        ready,
        n_rows,
        n_cols,
        GROUP_M: gl.constexpr,
    ):
        # the loads of the program's K step ``step`` (counted over its tiles): K
        # step ``k_step`` of its tile ``tile`` at (off_m, off_n); returns the
        # next step's coordinates, advanced without divisions
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        stage = step % a_bufs.shape[0]
        pred = tile < my_tiles
        bar = ready.index(stage)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred)
        k = k_step * BLOCK_K
        tma.async_copy_global_to_shared(
            x_desc, [off_m, k], bar, a_bufs.index(stage), pred
        )
        tma.async_copy_global_to_shared(
            w_desc, [off_n, k], bar, b_bufs.index(stage), pred
        )
        k_step += 1
        if k_step == k_steps:
            k_step = 0
            tile += 1
            off_m, off_n = _tile_offsets(
                gl.program_id(0) + tile * gl.num_programs(0),
                n_rows,
                n_cols,
                BLOCK_M,
                BLOCK_N,
                GROUP_M,
            )
        return tile, k_step, off_m, off_n

    @gluon.jit
    def _mma_partition(
        x_desc,
        w_desc,
        bias_ptr,
        a_bufs,
        b_bufs,
        ready,
        base_smem,
        base_ready,
        base_empty,
        n_rows,
        n_cols,
        n_inner,
        GROUP_M: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0],
            warps_per_cta=[gl.num_warps(), 1],
            instr_shape=[16, BLOCK_N, 16],
        )
        num_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
        k_steps = gl.cdiv(n_inner, BLOCK_K)
        my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
        load_tile = 0
        load_k = 0
        load_m, load_n = _tile_offsets(
            gl.program_id(0), n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M
        )
        for first in gl.static_range(STAGES - 1):
            load_tile, load_k, load_m, load_n = _issue_loads(
                first,
                load_tile,
                load_k,
                my_tiles,
                k_steps,
                load_m,
                load_n,
                x_desc,
                w_desc,
                a_bufs,
                b_bufs,
                ready,
                n_rows,
                n_cols,
                GROUP_M,
            )
        step = 0
        for t in range(my_tiles):
            off_m, off_n = _tile_offsets(
                gl.program_id(0) + t * gl.num_programs(0),
                n_rows,
                n_cols,
                BLOCK_M,
                BLOCK_N,
                GROUP_M,
            )
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
            for _ in range(k_steps):
                stage = step % STAGES
                mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
                acc = warpgroup_mma(
                    a_bufs.index(stage),
                    b_bufs.index(stage).permute((1, 0)),
                    acc,
                    is_async=True,
                )
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # both warp groups are past the previous step's MMA: its stage
                # takes step + STAGES - 1
                gl.thread_barrier()
                load_tile, load_k, load_m, load_n = _issue_loads(
                    step + STAGES - 1,
                    load_tile,
                    load_k,
                    my_tiles,
                    k_steps,
                    load_m,
                    load_n,
                    x_desc,
                    w_desc,
                    a_bufs,
                    b_bufs,
                    ready,
                    n_rows,
                    n_cols,
                    GROUP_M,
                )
                step += 1
            # the bias load's latency hides behind the last MMA
            cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            bias = gl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            base = (acc + bias.to(gl.float32)[None, :]).to(gl.bfloat16)
            mbarrier.wait(base_empty, (t & 1) ^ 1)
            base_smem.store(base)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(base_ready)

    @gluon.jit
    def _epilogue_partition(
        out_desc,
        down_ptr,
        lora_b_ptr,
        gelu_table_ptr,
        scale,
        base_smem,
        base_ready,
        base_empty,
        lora_b_smem,
        n_rows,
        n_cols,
        GROUP_M: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
        SLICE_N: gl.constexpr = lora_b_smem.shape[0]
        RANK: gl.constexpr = lora_b_smem.shape[1]
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0],
            warps_per_cta=[gl.num_warps(), 1],
            instr_shape=[16, SLICE_N, 16],
        )
        down_layout: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=layout, k_width=2
        )
        load_layout: gl.constexpr = gl.BlockedLayout(
            [1, 8], [4, 8], [gl.num_warps(), 1], [1, 0]
        )
        num_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
        t = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_m, off_n = _tile_offsets(
                tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M
            )
            rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, down_layout))
            down_ranks = gl.arange(0, RANK, layout=gl.SliceLayout(0, down_layout))
            down = gl.load(
                down_ptr + rows.to(gl.int64)[:, None] * RANK + down_ranks[None, :],
                mask=(rows < n_rows)[:, None],
                other=0.0,
            )
            ranks = gl.arange(0, RANK, layout=gl.SliceLayout(0, load_layout))
            mbarrier.wait(base_ready, t & 1)
            for j in gl.static_range(BLOCK_N // SLICE_N):
                slice_rows = gl.arange(
                    0, SLICE_N, layout=gl.SliceLayout(1, load_layout)
                )
                b_rows = off_n + j * SLICE_N + slice_rows
                lora_b = gl.load(
                    lora_b_ptr + b_rows[:, None] * RANK + ranks[None, :],
                    mask=(b_rows < n_cols)[:, None],
                    other=0.0,
                )
                lora_b_smem.store(lora_b)
                fence_async_shared()
                gl.thread_barrier()
                update = warpgroup_mma(
                    down,
                    lora_b_smem.permute((1, 0)),
                    gl.zeros((BLOCK_M, SLICE_N), gl.float32, layout),
                    use_acc=False,
                )
                update = update.to(gl.bfloat16).to(gl.float32)
                scaled = (update * scale).to(gl.bfloat16).to(gl.float32)
                part = base_smem.slice(j * SLICE_N, SLICE_N, dim=1)
                out = (part.load(layout).to(gl.float32) + scaled).to(gl.bfloat16)
                bits = out.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
                out = gl.load(gelu_table_ptr + bits)
                # every warp is done with the LoRA-B slice and its part of the
                # base before either is overwritten
                gl.thread_barrier()
                part.store(out)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(out_desc, [off_m, off_n], base_smem)
            tma.store_wait(pendings=0)
            mbarrier.arrive(base_empty)
            t += 1

    @gluon.jit(do_not_specialize=["n_rows", "scale"])
    def _linear_lora_gelu_kernel(
        x_desc,
        w_desc,
        out_desc,
        bias_ptr,
        down_ptr,
        lora_b_ptr,
        gelu_table_ptr,
        scale,
        n_rows,
        n_cols,
        n_inner,
        RANK: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        SLICE_N: gl.constexpr,
        EPILOGUE_WARPS: gl.constexpr,
        EPILOGUE_REGS: gl.constexpr,
    ):
        dtype: gl.constexpr = x_desc.dtype
        a_bufs = gl.allocate_shared_memory(
            dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout
        )
        b_bufs = gl.allocate_shared_memory(
            dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout
        )
        base_smem = gl.allocate_shared_memory(
            dtype, out_desc.block_type.shape, out_desc.layout
        )
        lora_b_smem = gl.allocate_shared_memory(
            dtype,
            [SLICE_N, RANK],
            gl.NVMMASharedLayout.get_default_for([SLICE_N, RANK], dtype),
        )
        ready = gl.allocate_shared_memory(
            gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()
        )
        base_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        base_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        mbarrier.init(base_ready, count=1)
        mbarrier.init(base_empty, count=1)
        gl.warp_specialize(
            [
                (
                    _mma_partition,
                    (
                        x_desc,
                        w_desc,
                        bias_ptr,
                        a_bufs,
                        b_bufs,
                        ready,
                        base_smem,
                        base_ready,
                        base_empty,
                        n_rows,
                        n_cols,
                        n_inner,
                        GROUP_M,
                    ),
                ),
                (
                    _epilogue_partition,
                    (
                        out_desc,
                        down_ptr,
                        lora_b_ptr,
                        gelu_table_ptr,
                        scale,
                        base_smem,
                        base_ready,
                        base_empty,
                        lora_b_smem,
                        n_rows,
                        n_cols,
                        GROUP_M,
                    ),
                ),
            ],
            [EPILOGUE_WARPS],
            [EPILOGUE_REGS],
        )


def can_use_linear_lora_gelu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    down: torch.Tensor,
    lora_B: torch.Tensor,
) -> bool:
    """What ``can_use_linear_lora`` takes, with R 16, 32 or 64, on a Hopper GPU
    (compute capability 9.0) and a Triton with Gluon's warp specialization."""
    return (
        _HAS_GLUON
        and can_use_linear_lora(x, weight, bias, down, lora_B)
        and lora_B.shape[-1] in _RANKS
        and torch.cuda.get_device_capability(x.device) == (9, 0)
    )


@functools.cache
def _smem_layout(block: tuple[int, int]):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def linear_lora_gelu_bf16(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    down: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias) + F.linear(down, lora_B) * scale,
    approximate="tanh")`` for operands that ``can_use_linear_lora_gelu`` takes."""
    if not can_use_linear_lora_gelu(x, weight, bias, down, lora_B):
        raise RuntimeError(
            "linear_lora_gelu_bf16 expects contiguous, 16-byte aligned BF16 CUDA x "
            "[..., K], weight [N, K] (N a multiple of 8), bias [N], down [..., R] "
            "and lora_B [N, R] with R 16, 32 or 64, on compute "
            "capability 9.0 and a Triton with Gluon's warp specialization"
        )
    n_cols, n_inner = weight.shape
    x2 = x.view(-1, n_inner)
    n_rows = x2.shape[0]
    out = x.new_empty(*x.shape[:-1], n_cols)

    def descriptor(t, block):
        return TensorDescriptor.from_tensor(t, list(block), _smem_layout(block))

    num_programs = min(
        _num_sms(x.device),
        triton.cdiv(n_rows, _BLOCK_M) * triton.cdiv(n_cols, _BLOCK_N),
    )
    with torch.cuda.device(x.device):
        _linear_lora_gelu_kernel[(num_programs,)](
            descriptor(x2, (_BLOCK_M, _BLOCK_K)),
            descriptor(weight, (_BLOCK_N, _BLOCK_K)),
            descriptor(out.view(n_rows, n_cols), (_BLOCK_M, _BLOCK_N)),
            bias,
            down,
            lora_B,
            gelu_tanh_table(x.device),
            scale,
            n_rows,
            n_cols,
            n_inner,
            RANK=lora_B.shape[-1],
            GROUP_M=_GROUP_M,
            STAGES=_STAGES,
            SLICE_N=_SLICE_N,
            EPILOGUE_WARPS=_EPILOGUE_WARPS,
            EPILOGUE_REGS=_EPILOGUE_REGS,
            num_warps=8,
            enable_fp_fusion=False,
        )
    return out
