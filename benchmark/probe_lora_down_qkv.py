"""GPU probe: can the q, k and v projections' LoRA-A products (`lora_A(x)` for
one input x, rank r each) run as one GEMM that reads x once, with the bits of
the three `F.linear(x, A)` calls the contract runs (cuBLAS, K = 3072, no
split)? Run 76 (docs/results.md) found the image stream's LoRA-A GEMMs the
largest pass left in the Qwen-Image train_parity step.

Candidates, each checked bitwise against the three calls (ULP distance where
not equal) and timed by CUDA-graph replay (`probe_fused_tiles.checked_timing`):

* `cublas_concat`: one `F.linear(x, cat([A_q, A_k, A_v]))`, its output split
  (cuBLAS picks its kernel for N = 3r, which may split K);
* `triton`: one Triton kernel, a row tile per program, three FP32 accumulators
  fed by one load of each x tile, the K tiles in order from zero (as cuBLAS's
  unsplit kernels accumulate, patch 0019), one BF16 rounding, three outputs;
  for each tile choice.

The GPU run compares with the installed fork's `bitwise_equal`
(PYTHONPATH=/tmp/site on the device machine), under `gpu_common.setup`'s
stand-ins for the packages the device image lacks. `--interpret` checks the
Triton kernel's index math on the CPU under TRITON_INTERPRET=1 against an
FP32 product (no bits).

    PYTHONPATH=/tmp/site python3 benchmark/probe_lora_down_qkv.py --out $OUT/lora_down_qkv.json
    TRITON_INTERPRET=1 python3 benchmark/probe_lora_down_qkv.py --interpret
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark import gpu_common  # noqa: E402
from benchmark.probe_fused_tiles import checked_timing  # noqa: E402

# (BLOCK_M, BLOCK_K, num_stages, num_warps)
TILES = [(32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 3, 4), (128, 64, 3, 8)]


@triton.jit
def _lora_down_qkv_kernel(
    x_ptr,
    a_q_ptr,
    a_k_ptr,
    a_v_ptr,
    out_q_ptr,
    out_k_ptr,
    out_v_ptr,
    n_rows,
    n_inner,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, RANK)
    inner = tl.arange(0, BLOCK_K)
    row_mask = rows < n_rows
    acc_q = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    acc_k = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    acc_v = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for k in range(0, n_inner, BLOCK_K):
        x = tl.load(
            x_ptr + rows[:, None] * n_inner + (k + inner)[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )
        # A is [RANK, K] row-major: the tile [BLOCK_K, RANK] is A's transpose
        a_offsets = ranks[None, :] * n_inner + (k + inner)[:, None]
        acc_q = tl.dot(x, tl.load(a_q_ptr + a_offsets), acc_q)
        acc_k = tl.dot(x, tl.load(a_k_ptr + a_offsets), acc_k)
        acc_v = tl.dot(x, tl.load(a_v_ptr + a_offsets), acc_v)
    out_offsets = rows[:, None] * RANK + ranks[None, :]
    dtype = out_q_ptr.dtype.element_ty
    tl.store(out_q_ptr + out_offsets, acc_q.to(dtype), mask=row_mask[:, None])
    tl.store(out_k_ptr + out_offsets, acc_k.to(dtype), mask=row_mask[:, None])
    tl.store(out_v_ptr + out_offsets, acc_v.to(dtype), mask=row_mask[:, None])


def lora_down_qkv(x, a_q, a_k, a_v, tiles):
    """`(F.linear(x, a_q), F.linear(x, a_k), F.linear(x, a_v))` in one kernel,
    for contiguous x [M, K] and A [r, K] with K a multiple of BLOCK_K."""
    block_m, block_k, stages, warps = tiles
    rows, inner = x.shape
    rank = a_q.shape[0]
    if inner % block_k:
        raise ValueError(f"K = {inner} is not a multiple of BLOCK_K = {block_k}")
    outs = [x.new_empty(rows, rank) for _ in range(3)]
    _lora_down_qkv_kernel[(triton.cdiv(rows, block_m),)](
        x, a_q, a_k, a_v, *outs, rows, inner,
        RANK=rank, BLOCK_M=block_m, BLOCK_K=block_k, num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return outs


def operands(rows, inner, rank, device, gen):
    # LayerNorm-scaled activations and LoRA-A at PEFT's kaiming-uniform scale
    x = (torch.randn(rows, inner, generator=gen, device=device) * 1.3).bfloat16()
    bound = 1 / inner**0.5
    a = [
        ((torch.rand(rank, inner, generator=gen, device=device) * 2 - 1) * bound).bfloat16()
        for _ in range(3)
    ]
    return x, a


def interpret_check():
    """The kernel's index math on the CPU (TRITON_INTERPRET=1): a partial row
    tile and two K tiles, against `F.linear`. FP32 operands: the interpreter's
    `tl.dot` misreads BF16 ones (Triton 3.8). The control: A's K order reversed
    must not match."""
    gen = torch.Generator().manual_seed(0)
    x, a = operands(100, 256, 64, "cpu", gen)
    x, a = x.float(), [weight.float() for weight in a]
    for tiles in [(32, 128, 1, 4), (64, 64, 1, 4)]:
        got = lora_down_qkv(x, *a, tiles)
        for g, weight in zip(got, a):
            if not torch.allclose(g, F.linear(x, weight), rtol=1e-5, atol=1e-5):
                raise SystemExit(f"tiles {tiles}: the kernel's output is not x @ A.T")
            if torch.allclose(g, F.linear(x, weight.flip(1)), rtol=1e-5, atol=1e-5):
                raise SystemExit("the control matched: the check cannot see the K order")
    print("interpret: every output equals F.linear(x, A) to FP32 rounding; the control differs")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON summary (GPU run)")
    ap.add_argument("--interpret", action="store_true", help="CPU check of the index math")
    ap.add_argument("--rows", default="4096,1024,8192,4001")
    ap.add_argument("--inner", type=int, default=3072)
    ap.add_argument("--rank", type=int, default=64)
    args = ap.parse_args()
    if args.interpret:
        interpret_check()
        return
    if not args.out:
        ap.error("--out is required for a GPU run")
    gpu_common.setup("cuda", "off")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for rows in map(int, args.rows.split(",")):
        x, a = operands(rows, args.inner, args.rank, "cuda", gen)
        want = [F.linear(x, weight) for weight in a]
        concat = torch.cat(a)
        case = {
            "rows": rows,
            "inner": args.inner,
            "rank": args.rank,
            "three_f_linear": checked_timing(lambda: [F.linear(x, w) for w in a], None),
            "cublas_concat": checked_timing(
                lambda: F.linear(x, concat).split(args.rank, dim=1), want
            ),
            "triton": [
                {"tiles": tiles, **checked_timing(lambda: lora_down_qkv(x, *a, tiles), want)}
                for tiles in TILES
            ],
        }
        print(json.dumps(case), flush=True)
        results["cases"].append(case)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
