"""Probe kernel (not in the series): the LoRA'd linear of patch 0022's Gluon kernel
(``F.linear(x, weight, bias) + F.linear(down, lora_B) * scale``, PEFT's roundings,
optionally through the tanh GELU table) with the K loop split as CUTLASS's cooperative
Hopper GEMMs split it: a 1-warp partition issues the TMA loads, two 4-warp MMA
partitions each run the ``wgmma``s of one 64-row half of the 128 x 256 tile and
release each stage through an ``empty`` barrier (no block-wide ``bar.sync`` in the K
loop), and the default 4-warp partition runs the epilogue (LoRA-B MMA in column
slices, roundings, GELU lookup, TMA store) while the MMA partitions run the next
tile. The MMA partitions ask for more registers than the kernel's 16 warps leave
each (``worker_num_regs``: setmaxnreg), the producer for fewer.

Arithmetic: as ``linear_lora_gelu_gluon`` (16-wide MMA steps in K order from a zero
accumulator, the bias added in FP32, one rounding; the update as PEFT rounds it).
"""

import functools

import triton

from sglang.kernels.ops.diffusion.gemm.linear_lora_gelu_gluon import _tile_offsets
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
GROUP_M, STAGES, SLICE_N = 8, 3, 64
MMA_REGS = 192


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
    empty,
    n_rows,
    n_cols,
    GROUP_M: gl.constexpr,
):
    # the loads of the program's K step ``step`` (counted over its tiles), once both
    # MMA partitions released the stage's previous K step; returns the next step's
    # coordinates, advanced without divisions
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    stage = step % STAGES
    pred = tile < my_tiles
    mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1, pred=pred)
    bar = ready.index(stage)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred)
    k = k_step * BLOCK_K
    tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, a_bufs.index(stage), pred)
    tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, b_bufs.index(stage), pred)
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
    empty,
    base_smem,
    base_ready,
    base_empty,
    n_rows,
    n_cols,
    n_inner,
    HALF: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    # HALF 0 also issues the loads, STAGES - 1 K steps ahead
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    HALF_M: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 16]
    )
    num_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
    k_steps = gl.cdiv(n_inner, BLOCK_K)
    my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
    load_tile = 0
    load_k = 0
    load_m, load_n = _tile_offsets(
        gl.program_id(0), n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M
    )
    if HALF == 0:
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
                empty,
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
        acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout)
        for k_step in range(k_steps):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            acc = warpgroup_mma(
                a_bufs.index(stage).slice(HALF * HALF_M, HALF_M, dim=0),
                b_bufs.index(stage).permute((1, 0)),
                acc,
                is_async=True,
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous K step's MMA is done: this half releases its stage
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k_step > 0)
            if HALF == 0:
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
                    empty,
                    n_rows,
                    n_cols,
                    GROUP_M,
                )
            step += 1
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        bias = gl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        base = (acc + bias.to(gl.float32)[None, :]).to(gl.bfloat16)
        mbarrier.wait(base_empty, (t & 1) ^ 1)
        base_smem.slice(HALF * HALF_M, HALF_M, dim=0).store(base)
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
    GELU: gl.constexpr,
):
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    SLICE_N: gl.constexpr = lora_b_smem.shape[0]
    RANK: gl.constexpr = lora_b_smem.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, SLICE_N, 16]
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
        off_m, off_n = _tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
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
            slice_rows = gl.arange(0, SLICE_N, layout=gl.SliceLayout(1, load_layout))
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
            if GELU:
                bits = out.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
                out = gl.load(gelu_table_ptr + bits)
            gl.thread_barrier()
            part.store(out)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_desc, [off_m, off_n], base_smem)
        tma.store_wait(pendings=0)
        mbarrier.arrive(base_empty)
        t += 1


@gluon.jit(do_not_specialize=["n_rows", "scale"])
def linear_lora_coop_kernel(
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
    GELU: gl.constexpr,
    MMA_REGS: gl.constexpr,
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
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    base_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    base_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(base_ready, count=2)
    mbarrier.init(base_empty, count=1)
    gl.warp_specialize(
        [
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
                    GELU,
                ),
            ),
            (
                _mma_partition,
                (
                    x_desc,
                    w_desc,
                    bias_ptr,
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    base_smem,
                    base_ready,
                    base_empty,
                    n_rows,
                    n_cols,
                    n_inner,
                    0,
                    GROUP_M,
                ),
            ),
            (
                _mma_partition,
                (
                    x_desc,
                    w_desc,
                    bias_ptr,
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    base_smem,
                    base_ready,
                    base_empty,
                    n_rows,
                    n_cols,
                    n_inner,
                    1,
                    GROUP_M,
                ),
            ),
        ],
        [4, 4],
        [MMA_REGS, MMA_REGS],
    )


@functools.cache
def _smem_layout(block):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def linear_lora_coop(
    x,
    weight,
    bias,
    down,
    lora_B,
    scale,
    gelu_table=None,
    *,
    stages=STAGES,
    mma_regs=MMA_REGS
):
    """``linear_lora_gelu_bf16``'s result (``gelu_table`` given) or
    ``linear_lora_bf16``'s (None) for the operands those take."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n_cols, n_inner = weight.shape
    x2 = x.view(-1, n_inner)
    n_rows = x2.shape[0]
    out = x.new_empty(*x.shape[:-1], n_cols)

    def descriptor(t, block):
        return TensorDescriptor.from_tensor(t, list(block), _smem_layout(block))

    num_programs = min(
        torch.cuda.get_device_properties(x.device).multi_processor_count,
        triton.cdiv(n_rows, BLOCK_M) * triton.cdiv(n_cols, BLOCK_N),
    )
    with torch.cuda.device(x.device):
        linear_lora_coop_kernel[(num_programs,)](
            descriptor(x2, (BLOCK_M, BLOCK_K)),
            descriptor(weight, (BLOCK_N, BLOCK_K)),
            descriptor(out.view(n_rows, n_cols), (BLOCK_M, BLOCK_N)),
            bias,
            down,
            lora_B,
            bias if gelu_table is None else gelu_table,
            scale,
            n_rows,
            n_cols,
            n_inner,
            RANK=lora_B.shape[-1],
            GROUP_M=GROUP_M,
            STAGES=stages,
            SLICE_N=SLICE_N,
            GELU=gelu_table is not None,
            MMA_REGS=mma_regs,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out
