"""H200 probe: can a Triton GEMM reproduce cuBLAS's BF16 LoRA-B product bit for bit,
and can a Triton GELU (tanh) reproduce aten's over every BF16 value?

Standalone (torch + triton only). Prints one line per case and a JSON summary.

    python3 benchmark/probe_lora_b_gemm.py --out /tmp/probe.json
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
from triton.language.extra import libdevice

# the fork's tools (torch only), so the probe runs without the fork installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from sglang_train_parity.compare import ulp_distance  # noqa: E402


@triton.jit
def _lora_b_kernel(
    u_ptr,
    b_ptr,
    base_ptr,
    out_ptr,
    M,
    N,
    scaling,
    R: tl.constexpr,
    K_STEP: tl.constexpr,
    REVERSE_K: tl.constexpr,
    EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K_STEP)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in tl.static_range(R // K_STEP):
        k0 = (R // K_STEP - 1 - step) * K_STEP if REVERSE_K else step * K_STEP
        a = tl.load(
            u_ptr + offs_m[:, None] * R + (k0 + offs_k)[None, :],
            mask=m_mask[:, None],
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_n[None, :] * R + (k0 + offs_k)[:, None],
            mask=n_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(a, b, acc)
    h = acc.to(tl.bfloat16)
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if EPILOGUE == 0:
        out = h
    else:
        t = (h.to(tl.float32) * scaling).to(tl.bfloat16)
        base = tl.load(base_ptr + offs, mask=mask, other=0.0)
        out = (base.to(tl.float32) + t.to(tl.float32)).to(tl.bfloat16)
        if EPILOGUE == 2:
            out = _gelu_tanh(out.to(tl.float32), 1).to(tl.bfloat16)
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _gelu_tanh(x, FORM: tl.constexpr):
    k_beta: tl.constexpr = 0.7978845608028654
    k_kappa: tl.constexpr = 0.044715
    x_cube = x * x * x
    if FORM == 1:
        inner = k_beta * tl.fma(k_kappa, x_cube, x)
    else:
        inner = k_beta * (x + k_kappa * x_cube)
    return 0.5 * x * (1.0 + libdevice.tanh(inner))


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, n, FORM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, _gelu_tanh(x, FORM).to(tl.bfloat16), mask=mask)


def lora_b(u, b, base, scaling, *, k_step, reverse=False, epilogue=0, bm=128, bn=128, warps=8):
    m, r = u.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=u.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _lora_b_kernel[grid](
        u, b, base if base is not None else out, out, m, n, scaling,
        R=r, K_STEP=k_step, REVERSE_K=reverse, EPILOGUE=epilogue,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
    )
    return out


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def operands(m, n, r, adversarial, gen):
    if adversarial:
        mag = torch.exp(torch.randn(m, r, generator=gen, device="cuda") * 3)
        u = (mag * torch.randn(m, r, generator=gen, device="cuda").sign()).bfloat16()
        u[: max(1, m // 64)] = 0.0
        u[m // 64 : m // 32] = -0.0
    else:
        u = (torch.randn(m, r, generator=gen, device="cuda") * 0.5).bfloat16()
    b = (torch.randn(n, r, generator=gen, device="cuda") * 0.05).bfloat16()
    base = torch.randn(m, n, generator=gen, device="cuda").bfloat16()
    return u, b, base


def time_ms(fn, iters=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"gemm": [], "gelu": {}, "timing": []}
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    configs = [(16, 128, 128, 8), (64, 128, 128, 8), (16, 128, 256, 8), (16, 64, 128, 4), (64, 128, 64, 4)]
    for r in (64, 16, 32, 128):
        for m in (4096, 8192, 1024, 4307, 211, 77, 1):
            for n in (3072, 12288):
                if r != 64 and (m not in (4096, 211) or n != 3072):
                    continue
                for adversarial in (False, True):
                    u, b, base = operands(m, n, r, adversarial, gen)
                    ref = F.linear(u, b)
                    row = {"r": r, "m": m, "n": n, "adversarial": adversarial, "configs": {}}
                    for k_step, bm, bn, warps in configs:
                        if k_step > r:
                            continue
                        got = lora_b(u, b, None, 0.0, k_step=k_step, bm=bm, bn=bn, warps=warps)
                        row["configs"][f"k{k_step}_{bm}x{bn}_w{warps}"] = (
                            "equal" if same_bits(got, ref) else f"ulp {ulp_distance(got, ref)}"
                        )
                    if r >= 32:
                        got = lora_b(u, b, None, 0.0, k_step=16, reverse=True)
                        row["control_reversed_k"] = "equal" if same_bits(got, ref) else f"ulp {ulp_distance(got, ref)}"
                    print(json.dumps(row), flush=True)
                    result["gemm"].append(row)

    # GELU over every finite BF16 value.
    bits = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)].contiguous()
    ref = F.gelu(x, approximate="tanh")
    for form in (1, 0):
        out = torch.empty_like(x)
        _gelu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), FORM=form, BLOCK=1024)
        diff = (out.view(torch.int16) != ref.view(torch.int16)) & ~(torch.isnan(out) & torch.isnan(ref))
        result["gelu"][f"form{form}"] = {"differing": int(diff.sum()), "ulp": ulp_distance(out[~torch.isnan(ref)], ref[~torch.isnan(ref)])}
        if diff.any():
            idx = diff.nonzero()[:5, 0]
            result["gelu"][f"form{form}"]["examples"] = [
                [float(x[i]), float(out[i]), float(ref[i])] for i in idx
            ]
    print("gelu", json.dumps(result["gelu"]), flush=True)

    # Cost: cuBLAS LoRA-B + eager scale-and-add vs one fused kernel (+ GELU).
    for m, n in ((4096, 3072), (4096, 12288), (211, 3072), (8192, 3072)):
        u, b, base = operands(m, n, 64, False, gen)
        s = 2.0
        eager = time_ms(lambda: base + F.linear(u, b) * s)
        gemm_only = time_ms(lambda: F.linear(u, b))
        cfgs = {}
        for k_step, bm, bn, warps in configs:
            cfgs[f"k{k_step}_{bm}x{bn}_w{warps}"] = round(
                time_ms(lambda: lora_b(u, b, base, s, k_step=k_step, epilogue=1, bm=bm, bn=bn, warps=warps)) * 1e3, 1
            )
        fused_ref = base + F.linear(u, b) * s
        fused = lora_b(u, b, base, s, k_step=16, epilogue=1)
        gelu_eager = time_ms(lambda: F.gelu(base + F.linear(u, b) * s, approximate="tanh"))
        gelu_fused = time_ms(lambda: lora_b(u, b, base, s, k_step=16, epilogue=2))
        row = {
            "m": m, "n": n,
            "eager_us": round(eager * 1e3, 1), "cublas_gemm_us": round(gemm_only * 1e3, 1),
            "fused_us": cfgs, "fused_equal": same_bits(fused, fused_ref),
            "gelu_eager_us": round(gelu_eager * 1e3, 1), "gelu_fused_us": round(gelu_fused * 1e3, 1),
            "gelu_fused_equal": same_bits(lora_b(u, b, base, s, k_step=16, epilogue=2), F.gelu(fused_ref, approximate="tanh")),
        }
        print(json.dumps(row), flush=True)
        result["timing"].append(row)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
