"""Probe: the base GEMM kernel with the gated residual in its epilogue against the
plain kernel followed by the gated residual kernel, at Qwen-Image's image-stream
out- and down-projection shapes (4096 rows, width 3072, rank 64)."""
import torch

from sglang.kernels.ops.diffusion.gemm.linear_lora_triton import linear_lora_bf16
from sglang.kernels.ops.diffusion.modulate.add_product_triton import residual_gate_add_bf16


def timed(fn, iters=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000


torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
for inner in (3072, 12288):
    x = torch.randn(1, 4096, inner, device=dev, dtype=bf)
    w = torch.randn(3072, inner, device=dev, dtype=bf) / inner**0.5
    b = torch.randn(3072, device=dev, dtype=bf)
    down = torch.randn(1, 4096, 64, device=dev, dtype=bf)
    lb = torch.randn(3072, 64, device=dev, dtype=bf) / 8
    res = torch.randn(1, 4096, 3072, device=dev, dtype=bf)
    gate = torch.randn(1, 6 * 3072, device=dev, dtype=bf)[:, 3072:6144]
    plain = lambda: linear_lora_bf16(x, w, b, down, lb, 2.0)
    chain = lambda: residual_gate_add_bf16(res, linear_lora_bf16(x, w, b, down, lb, 2.0), gate)
    fused = lambda: linear_lora_bf16(x, w, b, down, lb, 2.0, residual=res, gate=gate)
    one_part = lambda: linear_lora_bf16(x, w, b, down, lb, 2.0, (128, 256, 64, 8, 3, 8, 1, True), residual=res, gate=gate)
    add = lambda: residual_gate_add_bf16(res, res, gate)
    assert torch.equal(chain(), fused()) and torch.equal(chain(), one_part())
    for rnd in range(3):
        print(f"K={inner} round {rnd}: " + ", ".join(
            f"{name} {timed(fn):.1f} us" for name, fn in
            (("plain", plain), ("gated residual alone", add), ("plain + gated residual", chain),
             ("fused", fused), ("fused, one epilogue part", one_part))), flush=True)
