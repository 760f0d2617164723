"""Qwen-Image's MLP up-projection (``F.linear(x, W, bias)``, PEFT's LoRA update, tanh GELU)
as one warp-specialized Gluon GEMM for Hopper (Triton 3.6's Gluon API): an 8-warp partition that loads the operands with
TMA, runs the MMAs and rounds ``acc + bias`` to BF16 into shared memory,
and a 4-warp epilogue partition that adds the LoRA update, rounds as PEFT does, looks the
GELU up in aten's table and stores the tile with TMA, while the MMA partition already runs
the next tile's K loop. Probe code: ``probe_gluon_mlp_up.py`` checks it bitwise against
aten's chain and times it.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _tile_offsets(
    tile,
    n_rows,
    n_cols,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    tiles_m = gl.cdiv(n_rows, BLOCK_M)
    tiles_n = gl.cdiv(n_cols, BLOCK_N)
    group_tiles = GROUP_M * tiles_n
    group = tile // group_tiles
    group_m = min(tiles_m - group * GROUP_M, GROUP_M)
    off_m = (group * GROUP_M + (tile % group_tiles) % group_m) * BLOCK_M
    off_n = ((tile % group_tiles) // group_m) * BLOCK_N
    return off_m, off_n


@gluon.jit
def _issue_loads(
    i,
    load_tile,
    load_k,
    my_tiles,
    k_tiles,
    off_m,
    off_n,
    x_desc,
    w_desc,
    a_bufs,
    b_bufs,
    ready,
    n_rows,
    n_cols,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    # the loads of the program's i-th K step, counted over all of its tiles: K step load_k
    # of its tile load_tile at (off_m, off_n); returns the next step's coordinates
    STAGES: gl.constexpr = a_bufs.shape[0]
    s = i % STAGES
    pred = load_tile < my_tiles
    bar = ready.index(s)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(
        x_desc, [off_m, load_k * BLOCK_K], bar, a_bufs.index(s), pred
    )
    tma.async_copy_global_to_shared(
        w_desc, [off_n, load_k * BLOCK_K], bar, b_bufs.index(s), pred
    )
    load_k += 1
    if load_k == k_tiles:
        load_k = 0
        load_tile += 1
        off_m, off_n = _tile_offsets(
            gl.program_id(0) + load_tile * gl.num_programs(0),
            n_rows,
            n_cols,
            BLOCK_M,
            BLOCK_N,
            GROUP_M,
        )
    return load_tile, load_k, off_m, off_n


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
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    STAGES: gl.constexpr = a_bufs.shape[0]
    NW: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16]
    )
    num_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
    k_tiles = gl.cdiv(n_inner, BLOCK_K)
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
            k_tiles,
            load_m,
            load_n,
            x_desc,
            w_desc,
            a_bufs,
            b_bufs,
            ready,
            n_rows,
            n_cols,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GROUP_M,
        )
    i = 0
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
        for kk in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(
                a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # both warp groups are past step i - 1's MMA: its stage takes step i + STAGES - 1
            gl.thread_barrier()
            load_tile, load_k, load_m, load_n = _issue_loads(
                i + STAGES - 1,
                load_tile,
                load_k,
                my_tiles,
                k_tiles,
                load_m,
                load_n,
                x_desc,
                w_desc,
                a_bufs,
                b_bufs,
                ready,
                n_rows,
                n_cols,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                GROUP_M,
            )
            i += 1
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
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUP_M: gl.constexpr,
    RANK: gl.constexpr,
    SLICE_N: gl.constexpr,
    GELU_TANH: gl.constexpr,
):
    NW: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, SLICE_N, 16]
    )
    down_layout: gl.constexpr = gl.DotOperandLayout(
        operand_index=0, parent=layout, k_width=2
    )
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    num_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
    done = 0
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
        mbarrier.wait(base_ready, done & 1)
        for j in gl.static_range(BLOCK_N // SLICE_N):
            b_rows = (
                off_n
                + j * SLICE_N
                + gl.arange(0, SLICE_N, layout=gl.SliceLayout(1, load_layout))
            )
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
            if GELU_TANH:
                bits = out.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
                out = gl.load(gelu_table_ptr + bits)
            # every warp has read lora_b_smem and its part of the base before they are overwritten
            gl.thread_barrier()
            part.store(out)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_desc, [off_m, off_n], base_smem)
        tma.store_wait(pendings=0)
        mbarrier.arrive(base_empty)
        done += 1


@gluon.jit
def linear_lora_gelu_kernel(
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
    GROUP_M: gl.constexpr,
    RANK: gl.constexpr,
    SLICE_N: gl.constexpr,
    GELU_TANH: gl.constexpr,
    STAGES: gl.constexpr,
    EPILOGUE_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(
        x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout
    )
    b_bufs = gl.allocate_shared_memory(
        w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout
    )
    base_smem = gl.allocate_shared_memory(
        out_desc.dtype, out_desc.block_type.shape, out_desc.layout
    )
    lora_b_smem = gl.allocate_shared_memory(
        gl.bfloat16,
        [SLICE_N, RANK],
        gl.NVMMASharedLayout.get_default_for([SLICE_N, RANK], gl.bfloat16),
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
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
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
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
                    BLOCK_M,
                    BLOCK_N,
                    GROUP_M,
                    RANK,
                    SLICE_N,
                    GELU_TANH,
                ),
            ),
        ],
        [4],
        [EPILOGUE_REGS],
    )


@gluon.jit
def _load_partition(
    x_desc,
    w_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    n_rows,
    n_cols,
    n_inner,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    STAGES: gl.constexpr = a_bufs.shape[0]
    num_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        for k in range(0, n_inner, BLOCK_K):
            s = count % STAGES
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, b_bufs.index(s))
            count += 1


@gluon.jit
def _mma_consumer_partition(
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
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    # the MMA partition's K loop when a 1-warp partition issues the loads
    STAGES: gl.constexpr = a_bufs.shape[0]
    NW: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16]
    )
    num_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
    i = 0
    t = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_offsets(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
        for k in range(0, n_inner, BLOCK_K):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(
                a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=k > 0)
            i += 1
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        bias = gl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
        base = (acc + bias.to(gl.float32)[None, :]).to(gl.bfloat16)
        mbarrier.wait(base_empty, (t & 1) ^ 1)
        base_smem.store(base)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(base_ready)
        t += 1


@gluon.jit
def linear_lora_gelu_producer_kernel(
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
    GROUP_M: gl.constexpr,
    RANK: gl.constexpr,
    SLICE_N: gl.constexpr,
    GELU_TANH: gl.constexpr,
    STAGES: gl.constexpr,
    EPILOGUE_REGS: gl.constexpr,
):
    """``linear_lora_gelu_kernel`` with the loads on a 1-warp partition of their own and the
    MMAs on one warp group (the kernel's 4 warps): 12 warps in all."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(
        x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout
    )
    b_bufs = gl.allocate_shared_memory(
        w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout
    )
    base_smem = gl.allocate_shared_memory(
        out_desc.dtype, out_desc.block_type.shape, out_desc.layout
    )
    lora_b_smem = gl.allocate_shared_memory(
        gl.bfloat16,
        [SLICE_N, RANK],
        gl.NVMMASharedLayout.get_default_for([SLICE_N, RANK], gl.bfloat16),
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    base_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    base_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(base_ready, count=1)
    mbarrier.init(base_empty, count=1)
    gl.warp_specialize(
        [
            (
                _mma_consumer_partition,
                (
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
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
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
                    BLOCK_M,
                    BLOCK_N,
                    GROUP_M,
                    RANK,
                    SLICE_N,
                    GELU_TANH,
                ),
            ),
            (
                _load_partition,
                (
                    x_desc,
                    w_desc,
                    a_bufs,
                    b_bufs,
                    ready,
                    empty,
                    n_rows,
                    n_cols,
                    n_inner,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    GROUP_M,
                ),
            ),
        ],
        [4, 1],
        [EPILOGUE_REGS, 40],
    )


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, SLICE_N, EPILOGUE_REGS)
DEFAULT_TILES = (128, 256, 64, 8, 3, 64, 128)


def descriptors(x2, weight, out2, tiles):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block_m, block_n, block_k = tiles[:3]

    def desc(t, block):
        return TensorDescriptor.from_tensor(
            t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        )

    return (
        desc(x2, [block_m, block_k]),
        desc(weight, [block_n, block_k]),
        desc(out2, [block_m, block_n]),
    )


def linear_lora_gelu_bf16(
    x,
    weight,
    bias,
    down,
    lora_B,
    scale,
    gelu_table,
    tiles=DEFAULT_TILES,
    num_sms=None,
    gelu_tanh=True,
    producer=False,
):
    import torch

    n_cols, n_inner = weight.shape
    rank = lora_B.shape[1]
    x2 = x.reshape(-1, n_inner)
    n_rows = x2.shape[0]
    out = x.new_empty(*x.shape[:-1], n_cols)
    block_m, block_n, block_k, group_m, stages, slice_n, epi_regs = tiles
    x_desc, w_desc, out_desc = descriptors(x2, weight, out.view(n_rows, n_cols), tiles)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(num_sms, triton.cdiv(n_rows, block_m) * triton.cdiv(n_cols, block_n)),)
    kernel = linear_lora_gelu_producer_kernel if producer else linear_lora_gelu_kernel
    kernel[grid](
        x_desc,
        w_desc,
        out_desc,
        bias,
        down,
        lora_B,
        gelu_table if gelu_tanh else out,
        scale,
        n_rows,
        n_cols,
        n_inner,
        GROUP_M=group_m,
        RANK=rank,
        SLICE_N=slice_n,
        GELU_TANH=gelu_tanh,
        STAGES=stages,
        EPILOGUE_REGS=epi_regs,
        num_warps=4 if producer else 8,
    )
    return out
