"""H100/H200 probe: the LoRA'd linears of a Qwen-Image block (3072 -> 12288 with the tanh
GELU, 3072 -> 3072 and 12288 -> 3072, LoRA r64) in ``benchmark/gluon_coop_gemm.py`` (the
K loop on two MMA warp groups of their own, released through barriers, CUTLASS's
cooperative split) against the runtime's kernels (patch 0022's Gluon kernel for the GELU,
patch 0019's base GEMM kernel for the others) and cuBLAS's GEMM alone. Each output is
checked bitwise against aten's chain and timed by CUDA-graph replay.

    python3 benchmark/probe_gluon_coop.py --out /tmp/gluon_coop.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark import gpu_common  # noqa: E402
from benchmark.probe_fused_tiles import DIM, MLP, checked_timing  # noqa: E402

RANK = 64
SHAPES = {
    "up+gelu": (DIM, MLP, True),
    "qkvo": (DIM, DIM, False),
    "down": (MLP, DIM, False),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4096,8192,1024,4001")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--mma-regs", default="192")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gpu_common.setup("cuda", "off")
    import torch
    import torch.nn.functional as F
    import triton

    from benchmark import gluon_coop_gemm as coop
    from sglang.kernels.ops import diffusion as kernels
    from sglang.kernels.ops.diffusion.gemm import linear_lora_triton as ll
    from sglang.kernels.ops.diffusion.gemm.lora_b_scale_add_triton import (
        gelu_tanh_table,
    )
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager

    result = {
        "script": "benchmark/probe_gluon_coop.py",
        "argv": sys.argv[1:],
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(),
        "cases": [],
    }
    print(result, flush=True)
    torch.manual_seed(0)
    table = gelu_tanh_table(torch.device("cuda"))
    for shape in args.shapes.split(","):
        n_inner, n_cols, gelu = SHAPES[shape]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, n_inner, device="cuda").bfloat16()
            weight = (
                torch.randn(n_cols, n_inner, device="cuda") * n_inner**-0.5
            ).bfloat16()
            bias = (torch.randn(n_cols, device="cuda") * 0.02).bfloat16()
            down = (torch.randn(rows, RANK, device="cuda") * 4).bfloat16()
            lora_B = (torch.randn(n_cols, RANK, device="cuda") * 0.02).bfloat16()
            expected = eager.add_lora_up(F.linear(x, weight, bias), down, lora_B, 2.0)
            if gelu:
                expected = F.gelu(expected, approximate="tanh")
                runtime = lambda: kernels.linear_lora_gelu_bf16(  # noqa: E731
                    x, weight, bias, down, lora_B, 2.0
                )
            else:
                runtime = lambda: ll.linear_lora_bf16(  # noqa: E731
                    x, weight, bias, down, lora_B, 2.0
                )
            timed = {
                "cuBLAS GEMM alone": (lambda: F.linear(x, weight, bias), False),
                "the runtime's kernel": (runtime, True),
            }
            for regs in map(int, args.mma_regs.split(",")):
                timed[f"coop, MMA regs {regs}"] = (
                    lambda regs=regs: coop.linear_lora_coop(
                        x,
                        weight,
                        bias,
                        down,
                        lora_B,
                        2.0,
                        table if gelu else None,
                        mma_regs=regs,
                    ),
                    True,
                )
            case = {"shape": shape, "rows": rows, "us": {}}
            for name, (fn, check) in timed.items():
                entry = checked_timing(fn, expected if check else None)
                case["us"][name] = entry
                print(f"{shape} rows {rows} {name}: {entry}", flush=True)
            result["cases"].append(case)
    result["versions"] = gpu_common.versions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
