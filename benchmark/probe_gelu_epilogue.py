"""H200 probe: Qwen-Image's MLP up-projection (3072 -> 12288, LoRA r64) with its tanh GELU as the
LoRA-B kernel's epilogue (after cuBLAS's GEMM, as the runtime runs it) and as the base GEMM kernel's,
each checked bitwise against aten's chain and timed by CUDA-graph replay, next to cuBLAS's GEMM
alone and both kernels without the GELU. GELU inputs about N(0, 1) and N(0, 16): the wider one has
more inputs below -2, whose GELU the kernels read from aten's table. Also checks each kernel's GELU
against aten's on every finite BF16 input.

    python3 benchmark/probe_gelu_epilogue.py --out /tmp/gelu_epilogue.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark import gpu_common  # noqa: E402
from benchmark.probe_fused_tiles import DIM, MLP, graph_us  # noqa: E402

RANK = 64
LINEAR_TILES = [  # linear_lora_triton.Tiles; the first is the kernel's choice at 1024 rows and more
    (128, 128, 64, 8, 4, 8, 1, True),
]
LORA_TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps); the first is the kernel's choice
    (64, 128, 64, 4),
    (32, 64, 64, 4),
    (32, 128, 64, 4),
    (16, 128, 64, 4),
    (64, 64, 64, 4),
    (32, 64, 64, 2),
    (64, 128, 64, 8),
    (32, 256, 64, 8),
]


def every_bf16_check(gelu_of) -> int:
    """How many finite BF16 inputs ``gelu_of`` (a [n] BF16 -> [n] BF16 function through a kernel)
    gives other bits than aten's tanh GELU for."""
    import torch
    import torch.nn.functional as F

    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda")
    values = bits.to(torch.int16).view(torch.bfloat16)
    values = values[values.isfinite()]
    got = gelu_of(values)
    # the kernels add a zero update, which turns -0 into +0, as aten's chain does
    expected = F.gelu(values + 0, approximate="tanh")
    return int((got.view(torch.int16) != expected.view(torch.int16)).sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4096")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gpu_common.setup("cuda", "off")
    import torch
    import torch.nn.functional as F

    from sglang.kernels.ops.diffusion.gemm import linear_lora_triton as ll
    from sglang.kernels.ops.diffusion.gemm import lora_b_scale_add_triton as lb
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager
    from sglang.multimodal_gen.runtime.layers.train_parity_kernels import bitwise_equal

    def through_lora_b(values):
        base = values.view(-1, 128)
        zeros = base.new_zeros(base.shape[0], 16)
        return lb.lora_b_scale_add_bf16(base, zeros, base.new_zeros(128, 16), 1.0, True).view(-1)

    def through_linear(values):
        # a zero GEMM and update: the output is the bias (a -0 bias comes out +0, as in aten)
        x = values.new_zeros(128, 64)
        return ll.linear_lora_bf16(
            x, values.new_zeros(values.numel(), 64), values, x[:, :RANK],
            values.new_zeros(values.numel(), RANK), 1.0, gelu_tanh=True,
        )[0]

    result = {
        "script": "benchmark/probe_gelu_epilogue.py",
        "argv": sys.argv[1:],
        "every_bf16_differing": {
            "lora_b_kernel": every_bf16_check(through_lora_b),
            "base_gemm_kernel": every_bf16_check(lambda v: through_linear(v)),
        },
        "cases": [],
    }
    print(json.dumps(result["every_bf16_differing"]), flush=True)
    torch.manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        for spread in (1.0, 4.0):
            x = (torch.randn(rows, DIM, device="cuda") * spread).bfloat16()
            weight = (torch.randn(MLP, DIM, device="cuda") * DIM**-0.5).bfloat16()
            bias = (torch.randn(MLP, device="cuda") * 0.02).bfloat16()
            down = (torch.randn(rows, RANK, device="cuda") * 4).bfloat16()
            lora_B = (torch.randn(MLP, RANK, device="cuda") * 0.02).bfloat16()
            base = F.linear(x, weight, bias)
            summed = eager.add_lora_up(base, down, lora_B, 2.0)
            gelu = F.gelu(summed, approximate="tanh")
            below = float((summed.float() < -2).float().mean())
            timed = {
                "cuBLAS GEMM": (lambda: F.linear(x, weight, bias), base),
                "cuBLAS GEMM + LoRA-B + GELU kernel (runtime)": (
                    lambda: lb.lora_b_scale_add_bf16(
                        F.linear(x, weight, bias), down, lora_B, 2.0, gelu_tanh=True
                    ),
                    gelu,
                ),
                "LoRA-B kernel": (
                    lambda: lb.lora_b_scale_add_bf16(base, down, lora_B, 2.0),
                    summed,
                ),
            }
            for tiles in LORA_TILES:
                timed["LoRA-B + GELU kernel " + "x".join(map(str, tiles))] = (
                    lambda tiles=tiles: lb.lora_b_scale_add_bf16(
                        base, down, lora_B, 2.0, gelu_tanh=True, tiles=tiles
                    ),
                    gelu,
                )
            for tiles in LINEAR_TILES:
                name = "x".join(map(str, tiles))
                timed[f"base GEMM kernel {name}"] = (
                    lambda tiles=tiles: ll.linear_lora_bf16(
                        x, weight, bias, down, lora_B, 2.0, tiles=tiles
                    ),
                    summed,
                )
                timed[f"base GEMM + GELU kernel {name}"] = (
                    lambda tiles=tiles: ll.linear_lora_bf16(
                        x, weight, bias, down, lora_B, 2.0, gelu_tanh=True, tiles=tiles
                    ),
                    gelu,
                )
            case = {"rows": rows, "spread": spread, "gelu_inputs_below_-2": below, "us": {}}
            for name, (fn, expected) in timed.items():
                try:
                    equal = bitwise_equal(fn(), expected)
                    case["us"][name] = {"equal": equal, "us": round(graph_us(fn), 1)}
                except Exception as e:  # a tile choice that does not compile
                    case["us"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
                print(f"rows {rows} spread {spread} {name}: {case['us'][name]}", flush=True)
            result["cases"].append(case)
    result["versions"] = gpu_common.versions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
