"""H100/H200 probe: Qwen-Image's MLP up-projection (3072 -> 12288, LoRA r64, tanh GELU) in
``linear_lora_gelu_bf16`` (patch 0022: a warp-specialized Gluon GEMM whose epilogue runs on
warps of its own) against the path it replaces, cuBLAS's GEMM and the LoRA-B + GELU kernel,
and the base GEMM kernel without the GELU. Each output is checked bitwise against aten's
chain and timed by CUDA-graph replay. (Runs 50-53 timed tile and partition variants of the
kernel with this probe's earlier forms, commits e4fd62e to 701b467.)

    python3 benchmark/probe_gluon_mlp_up.py --out /tmp/gluon_mlp_up.json
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4096,8192,1024,4001")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gpu_common.setup("cuda", "off")
    import torch
    import torch.nn.functional as F
    import triton

    from sglang.kernels.ops import diffusion as kernels
    from sglang.kernels.ops.diffusion.gemm import linear_lora_triton as ll
    from sglang.kernels.ops.diffusion.gemm import lora_b_scale_add_triton as lb
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager

    result = {
        "script": "benchmark/probe_gluon_mlp_up.py",
        "argv": sys.argv[1:],
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(),
        "cases": [],
    }
    print(result, flush=True)
    torch.manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, DIM, device="cuda").bfloat16()
        weight = (torch.randn(MLP, DIM, device="cuda") * DIM**-0.5).bfloat16()
        bias = (torch.randn(MLP, device="cuda") * 0.02).bfloat16()
        down = (torch.randn(rows, RANK, device="cuda") * 4).bfloat16()
        lora_B = (torch.randn(MLP, RANK, device="cuda") * 0.02).bfloat16()
        summed = eager.add_lora_up(F.linear(x, weight, bias), down, lora_B, 2.0)
        gelu = F.gelu(summed, approximate="tanh")
        timed = {
            "cuBLAS GEMM": (lambda: F.linear(x, weight, bias), None),
            "cuBLAS GEMM + LoRA-B + GELU kernel (the path replaced)": (
                lambda: lb.lora_b_scale_add_bf16(
                    F.linear(x, weight, bias), down, lora_B, 2.0, gelu_tanh=True
                ),
                gelu,
            ),
            "base GEMM kernel, no GELU": (
                lambda: ll.linear_lora_bf16(x, weight, bias, down, lora_B, 2.0),
                summed,
            ),
            "the Gluon kernel": (
                lambda: kernels.linear_lora_gelu_bf16(
                    x, weight, bias, down, lora_B, 2.0
                ),
                gelu,
            ),
        }
        case = {"rows": rows, "us": {}}
        for name, (fn, expected) in timed.items():
            entry = checked_timing(fn, expected)
            case["us"][name] = entry
            print(f"rows {rows} {name}: {entry}", flush=True)
        result["cases"].append(case)
    result["versions"] = gpu_common.versions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
