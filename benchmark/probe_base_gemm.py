"""H200 probe: can a Triton GEMM reproduce cuBLAS's BF16 base linears of Qwen-Image bit for bit,
at cuBLAS's speed, and carry PEFT's LoRA update in its epilogue?

For each (rows, in, out) of the per-block GEMMs, compares ``F.linear(x, w, bias)`` (what the trainer's
aten runs) with Triton GEMMs that accumulate K in order, plain (pointer loads) and persistent with
TMA loads, over a few tile shapes; then the same GEMMs with the LoRA-B product, PEFT's two
roundings and the add in the epilogue against ``RN(base) + RN(RN(B·down) · s)``. Prints the cuBLAS
kernel each shape runs (its name says split-K or stream-K), ULP distances where not equal, and
CUDA-graph replay times. Standalone (torch + triton only).

    python3 benchmark/probe_base_gemm.py --out /tmp/probe_gemm.json
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
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from sglang_train_parity.compare import ulp_distance  # noqa: E402

RANK = 64
SCALING = 2.0


@triton.jit
def _epilogue(acc, bias_ptr, down_ptr, b_ptr, offs_m, offs_n, M, N, scaling, R: tl.constexpr, LORA: tl.constexpr):
    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = (acc + bias.to(tl.float32)[None, :]).to(tl.bfloat16)
    if LORA:
        offs_r = tl.arange(0, R)
        d = tl.load(down_ptr + offs_m[:, None] * R + offs_r[None, :], mask=(offs_m < M)[:, None], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * R + offs_r[:, None], mask=(offs_n < N)[None, :], other=0.0)
        up = tl.dot(d, b).to(tl.bfloat16)
        scaled = (up.to(tl.float32) * scaling).to(tl.bfloat16)
        out = (out.to(tl.float32) + scaled.to(tl.float32)).to(tl.bfloat16)
    return out


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, down_ptr, b_ptr, M, N, K, scaling,
    R: tl.constexpr, LORA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * K + offs_k[:, None]
    m_mask = (offs_m < M)[:, None]
    n_mask = (offs_n < N)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(x_ptrs, mask=m_mask, other=0.0)
        b = tl.load(w_ptrs, mask=n_mask, other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = _epilogue(acc, bias_ptr, down_ptr, b_ptr, offs_m, offs_n, M, N, scaling, R, LORA)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], out, mask=m_mask & n_mask)


@triton.jit
def _gemm_tma_persistent_kernel(
    x_desc, w_desc, bias_ptr, out_ptr, down_ptr, b_ptr, M, N, K, scaling,
    R: tl.constexpr, LORA: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_m * num_n
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        group = tile // (GROUP_M * num_n)
        first_m = group * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * num_n)) % size_m
        pid_n = (tile % (GROUP_M * num_n)) // size_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([off_m, ki * BLOCK_K])
            b = w_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        out = _epilogue(acc, bias_ptr, down_ptr, b_ptr, offs_m, offs_n, M, N, scaling, R, LORA)
        tl.store(
            out_ptr + offs_m[:, None] * N + offs_n[None, :],
            out,
            mask=(offs_m < M)[:, None] & (offs_n < N)[None, :],
        )


def gemm(x, w, bias, down=None, lora_b=None, tiles=(128, 128, 64, 8, 3, 8)):
    bm, bn, bk, group, stages, warps = tiles
    m, k = x.shape
    n = w.shape[0]
    out = x.new_empty(m, n)
    lora = down is not None
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_kernel[grid](
        x, w, bias, out, down if lora else x, lora_b if lora else x, m, n, k, SCALING,
        R=RANK, LORA=lora, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        num_stages=stages, num_warps=warps,
    )
    return out


_SMS = None


def gemm_tma(x, w, bias, down=None, lora_b=None, tiles=(128, 128, 64, 8, 3, 8), ws=False):
    from triton.tools.tensor_descriptor import TensorDescriptor

    global _SMS
    if _SMS is None:
        _SMS = torch.cuda.get_device_properties(x.device).multi_processor_count
    bm, bn, bk, group, stages, warps = tiles
    m, k = x.shape
    n = w.shape[0]
    out = x.new_empty(m, n)
    lora = down is not None
    tiles_total = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    _gemm_tma_persistent_kernel[(min(_SMS, tiles_total),)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        bias, out, down if lora else x, lora_b if lora else x, m, n, k, SCALING,
        R=RANK, LORA=lora, NUM_SMS=_SMS, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        WARP_SPECIALIZE=ws, num_stages=stages, num_warps=warps,
    )
    return out


def peft_chain(x, w, bias, down, lora_b):
    return F.linear(x, w, bias) + F.linear(down, lora_b) * SCALING


def cublas_kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})


def us(fn):
    fn()
    return round(do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3, 1)


PLAIN_TILES = [
    (128, 128, 64, 8, 4, 8),
    (128, 256, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 4),
]
TMA_TILES = [
    (128, 128, 64, 8, 4, 8, False),
    (128, 256, 64, 8, 3, 8, False),
    (128, 128, 64, 8, 4, 4, True),
    (128, 256, 64, 8, 3, 8, True),
]
SHAPES = [  # rows, in, out
    (4096, 3072, 3072),
    (4096, 3072, 12288),
    (4096, 12288, 3072),
    (8192, 3072, 3072),
    (8192, 12288, 3072),
    (1024, 3072, 3072),
    (1024, 3072, 12288),
    (211, 3072, 3072),
    (211, 12288, 3072),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16()
        bias = (torch.randn(n, device="cuda") * 0.1).bfloat16()
        down = (torch.randn(m, RANK, device="cuda") * 2).bfloat16()
        lora_b = (torch.randn(n, RANK, device="cuda") * 0.05).bfloat16()
        expected = F.linear(x, w, bias)
        expected_lora = peft_chain(x, w, bias, down, lora_b)
        row = {
            "shape": [m, k, n],
            "cublas_kernels": cublas_kernel_names(lambda: F.linear(x, w, bias)),
            "cublas_us": us(lambda: F.linear(x, w, bias)),
            "peft_chain_us": us(lambda: peft_chain(x, w, bias, down, lora_b)),
            "variants": {},
        }
        # without a bias, aten takes another cuBLAS path (no bias epilogue)
        got = gemm(x, w, torch.zeros_like(bias), tiles=PLAIN_TILES[0])
        row["no_bias_equal"] = bool(torch.equal(got.view(torch.int16), F.linear(x, w).view(torch.int16)))
        row["no_bias_cublas_kernels"] = cublas_kernel_names(lambda: F.linear(x, w))
        variants = [(f"plain{'x'.join(map(str, t))}", lambda t=t, **kw: gemm(x, w, bias, tiles=t, **kw)) for t in PLAIN_TILES]
        variants += [
            (f"tma{'x'.join(map(str, t[:6]))}{'ws' if t[6] else ''}",
             lambda t=t, **kw: gemm_tma(x, w, bias, tiles=t[:6], ws=t[6], **kw))
            for t in TMA_TILES
        ]
        for name, fn in variants:
            entry = {}
            try:
                got = fn()
                entry["equal"] = bool(torch.equal(got.view(torch.int16), expected.view(torch.int16)))
                if not entry["equal"]:
                    entry["max_ulp"] = ulp_distance(got, expected)
                    entry["frac_differ"] = float((got != expected).float().mean())
                entry["us"] = us(fn)
                got_lora = fn(down=down, lora_b=lora_b)
                entry["lora_equal"] = bool(torch.equal(got_lora.view(torch.int16), expected_lora.view(torch.int16)))
                entry["lora_us"] = us(lambda: fn(down=down, lora_b=lora_b))
            except Exception as exc:  # a tile shape this Triton cannot compile is a result too
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            row["variants"][name] = entry
        print(
            f"{m:5d}x{k:5d}->{n:5d} cuBLAS {row['cublas_us']:7.1f} us peft {row['peft_chain_us']:7.1f} "
            f"kernels {row['cublas_kernels']} no-bias equal {row['no_bias_equal']} "
            f"{row['no_bias_cublas_kernels']}",
            flush=True,
        )
        for name, e in row["variants"].items():
            print(f"    {name:28s} {json.dumps(e)}", flush=True)
        rows_out.append(row)
    result = {
        "script": "benchmark/probe_base_gemm.py",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "rows": rows_out,
    }
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
