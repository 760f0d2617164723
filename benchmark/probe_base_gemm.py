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
from triton.language.extra.cuda import libdevice
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from sglang_train_parity.compare import ulp_distance  # noqa: E402

RANK = 64
SCALING = 2.0


@triton.jit
def _gelu_tanh(x):
    inner = 0.7978845608028654 * tl.fma(0.044715, x * x * x, x)
    return 0.5 * x * (1.0 + libdevice.tanh(inner))


@triton.jit
def _scaled_update(down_desc, lb_desc, off_m, off_n, scaling):
    # RN(RN(down @ lora_B^T) * scaling): PEFT's update under autocast
    up = tl.dot(down_desc.load([off_m, 0]), lb_desc.load([off_n, 0]).T).to(tl.bfloat16)
    return (up.to(tl.float32) * scaling).to(tl.bfloat16)


@triton.jit
def _store_part(
    acc,
    bias_ptr,
    out_desc,
    down_desc,
    lb_desc,
    off_m,
    off_n,
    N,
    scaling,
    update,
    LORA: tl.constexpr,
    HAVE_UPDATE: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = off_n + tl.arange(0, BLOCK_N)
    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = (acc + bias.to(tl.float32)[None, :]).to(tl.bfloat16)
    if LORA:
        if not HAVE_UPDATE:
            update = _scaled_update(down_desc, lb_desc, off_m, off_n, scaling)
        out = (out.to(tl.float32) + update.to(tl.float32)).to(tl.bfloat16)
    if GELU:
        out = _gelu_tanh(out.to(tl.float32)).to(tl.bfloat16)
    out_desc.store([off_m, off_n], out)


@triton.jit
def _tile(
    x_desc,
    w_desc,
    bias_ptr,
    out_desc,
    down_desc,
    lb_desc,
    off_m,
    off_n,
    N,
    K,
    scaling,
    LORA: tl.constexpr,
    PROLOGUE: tl.constexpr,
    SUBTILE: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    update = None
    if LORA and PROLOGUE:
        update = _scaled_update(down_desc, lb_desc, off_m, off_n, scaling)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = x_desc.load([off_m, ki * BLOCK_K])
        b = w_desc.load([off_n, ki * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    if SUBTILE == 2:
        acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc0, acc1 = tl.split(acc)
        _store_part(
            acc0,
            bias_ptr,
            out_desc,
            down_desc,
            lb_desc,
            off_m,
            off_n,
            N,
            scaling,
            None,
            LORA,
            False,
            GELU,
            BLOCK_N // 2,
        )
        _store_part(
            acc1,
            bias_ptr,
            out_desc,
            down_desc,
            lb_desc,
            off_m,
            off_n + BLOCK_N // 2,
            N,
            scaling,
            None,
            LORA,
            False,
            GELU,
            BLOCK_N // 2,
        )
    else:
        _store_part(
            acc,
            bias_ptr,
            out_desc,
            down_desc,
            lb_desc,
            off_m,
            off_n,
            N,
            scaling,
            update,
            LORA,
            PROLOGUE,
            GELU,
            BLOCK_N,
        )


@triton.jit
def _gemm_v2_kernel(
    x_desc,
    w_desc,
    bias_ptr,
    out_desc,
    down_desc,
    lb_desc,
    M,
    N,
    K,
    scaling,
    LORA: tl.constexpr,
    PROLOGUE: tl.constexpr,
    SUBTILE: tl.constexpr,
    GELU: tl.constexpr,
    PERSISTENT: tl.constexpr,
    NUM_SMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for tile in tl.range(
            tl.program_id(0),
            num_m * num_n,
            NUM_SMS,
            flatten=True,
            warp_specialize=WARP_SPECIALIZE,
        ):
            group = tile // (GROUP_M * num_n)
            size_m = min(num_m - group * GROUP_M, GROUP_M)
            pid_m = group * GROUP_M + (tile % (GROUP_M * num_n)) % size_m
            pid_n = (tile % (GROUP_M * num_n)) // size_m
            _tile(
                x_desc,
                w_desc,
                bias_ptr,
                out_desc,
                down_desc,
                lb_desc,
                pid_m * BLOCK_M,
                pid_n * BLOCK_N,
                N,
                K,
                scaling,
                LORA,
                PROLOGUE,
                SUBTILE,
                GELU,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
    else:
        tile = tl.program_id(0)
        group = tile // (GROUP_M * num_n)
        size_m = min(num_m - group * GROUP_M, GROUP_M)
        pid_m = group * GROUP_M + (tile % (GROUP_M * num_n)) % size_m
        pid_n = (tile % (GROUP_M * num_n)) // size_m
        _tile(
            x_desc,
            w_desc,
            bias_ptr,
            out_desc,
            down_desc,
            lb_desc,
            pid_m * BLOCK_M,
            pid_n * BLOCK_N,
            N,
            K,
            scaling,
            LORA,
            PROLOGUE,
            SUBTILE,
            GELU,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )


_SMS = None


def gemm_v2(
    x,
    w,
    bias,
    down=None,
    lora_b=None,
    gelu=False,
    *,
    tiles,
    persistent,
    ws,
    prologue=False,
    subtile=1,
):
    from triton.tools.tensor_descriptor import TensorDescriptor

    global _SMS
    if _SMS is None:
        _SMS = torch.cuda.get_device_properties(x.device).multi_processor_count
    bm, bn, bk, group, stages, warps = tiles
    m, k = x.shape
    n = w.shape[0]
    out = x.new_empty(m, n)
    lora = down is not None
    if not lora:
        down = x.new_zeros(m, RANK)
        lora_b = x.new_zeros(n, RANK)
    n_part = bn // subtile
    tiles_total = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    _gemm_v2_kernel[(min(_SMS, tiles_total) if persistent else tiles_total,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk]),
        bias,
        TensorDescriptor.from_tensor(out, [bm, n_part]),
        TensorDescriptor.from_tensor(down, [bm, RANK]),
        TensorDescriptor.from_tensor(lora_b, [n_part, RANK]),
        m,
        n,
        k,
        SCALING,
        LORA=lora,
        PROLOGUE=prologue,
        SUBTILE=subtile,
        GELU=gelu,
        PERSISTENT=persistent,
        NUM_SMS=_SMS,
        WARP_SPECIALIZE=ws,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group,
        num_stages=stages,
        num_warps=warps,
    )
    return out


def peft_chain(x, w, bias, down, lora_b, gelu=False):
    out = F.linear(x, w, bias) + F.linear(down, lora_b) * SCALING
    return F.gelu(out, approximate="tanh") if gelu else out


def cublas_kernel_names(fn):
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})


def us(fn):
    fn()
    return round(do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3, 1)


VARIANTS = {  # name: gemm_v2 keywords
    "p-ws-256": dict(tiles=(128, 256, 64, 8, 3, 8), persistent=True, ws=True),
    "p-ws-256-sub2": dict(
        tiles=(128, 256, 64, 8, 3, 8), persistent=True, ws=True, subtile=2
    ),
    "p-ws-256-pro": dict(
        tiles=(128, 256, 64, 8, 3, 8), persistent=True, ws=True, prologue=True
    ),
    "p-256-sub2": dict(
        tiles=(128, 256, 64, 8, 3, 8), persistent=True, ws=False, subtile=2
    ),
    "np-256": dict(tiles=(128, 256, 64, 8, 3, 8), persistent=False, ws=False),
    "np-256-sub2": dict(
        tiles=(128, 256, 64, 8, 3, 8), persistent=False, ws=False, subtile=2
    ),
    "p-ws-128w4": dict(tiles=(128, 128, 64, 8, 4, 4), persistent=True, ws=True),
    "np-64x128w4": dict(tiles=(64, 128, 64, 8, 4, 4), persistent=False, ws=False),
}
SHAPES = [  # rows, in, out
    (4096, 3072, 3072),
    (4096, 3072, 12288),
    (4096, 12288, 3072),
    (1024, 3072, 3072),
    (211, 3072, 3072),
    (211, 3072, 12288),
    (211, 12288, 3072),
]


def _equal(a, b):
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


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
        if n == 12288:
            expected_gelu = peft_chain(x, w, bias, down, lora_b, gelu=True)
            row["peft_gelu_chain_us"] = us(
                lambda: peft_chain(x, w, bias, down, lora_b, gelu=True)
            )
        for name, kw in VARIANTS.items():
            entry = {}
            cases = [
                ("", {}, expected),
                ("lora_", dict(down=down, lora_b=lora_b), expected_lora),
            ]
            if n == 12288:
                cases.append(
                    ("gelu_", dict(down=down, lora_b=lora_b, gelu=True), expected_gelu)
                )
            for prefix, extra, want in cases:
                try:
                    got = gemm_v2(x, w, bias, **extra, **kw)
                    entry[prefix + "equal"] = _equal(got, want)
                    if not entry[prefix + "equal"]:
                        entry[prefix + "max_ulp"] = ulp_distance(got, want)
                    entry[prefix + "us"] = us(
                        lambda: gemm_v2(x, w, bias, **extra, **kw)
                    )
                except (
                    Exception
                ) as exc:  # a variant this Triton cannot compile is a result too
                    entry[prefix + "error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["variants"][name] = entry
        print(
            f"{m:5d}x{k:5d}->{n:5d} cuBLAS {row['cublas_us']:7.1f} us peft {row['peft_chain_us']:7.1f} "
            f"gelu {row.get('peft_gelu_chain_us')} kernels {row['cublas_kernels']}",
            flush=True,
        )
        for name, e in row["variants"].items():
            print(f"    {name:28s} {json.dumps(e)}", flush=True)
        rows_out.append(row)
    survey = []
    for m in (1, 7, 13, 64, 77, 128, 333, 512, 1000, 2048):
        for k, n in ((3072, 3072), (3072, 12288), (12288, 3072)):
            x = torch.randn(m, k, device="cuda").bfloat16()
            w = (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16()
            bias = (torch.randn(n, device="cuda") * 0.1).bfloat16()
            expected = F.linear(x, w, bias)
            entry = {
                "shape": [m, k, n],
                "cublas_kernels": cublas_kernel_names(lambda: F.linear(x, w, bias)),
            }
            for name in ("p-ws-128w4", "np-64x128w4"):
                entry[name] = _equal(gemm_v2(x, w, bias, **VARIANTS[name]), expected)
            print("survey", json.dumps(entry), flush=True)
            survey.append(entry)
    result = {
        "survey": survey,
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
