"""H100/H200 probe: Qwen-Image's MLP up-projection (3072 -> 12288, LoRA r64, tanh GELU) in
``gluon_linear_lora.linear_lora_gelu_bf16`` (a warp-specialized Gluon GEMM whose epilogue
runs on warps of its own) against the path it would replace, cuBLAS's GEMM and the LoRA-B +
GELU kernel, and the base GEMM kernel without the GELU. Each output is checked bitwise
against aten's chain and timed by CUDA-graph replay.

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
from benchmark.probe_fused_tiles import DIM, MLP, graph_us  # noqa: E402

RANK = 64
# ((BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, SLICE_N, EPILOGUE_REGS), producer): the
# tiles, and whether a 1-warp partition issues the loads; the first is the default
GLUON_TILES = [
    ((128, 256, 64, 8, 3, 64, 128), False),
    ((128, 128, 64, 8, 5, 64, 128), True),
    ((128, 128, 64, 8, 4, 64, 128), True),
    ((128, 128, 64, 16, 5, 64, 128), True),
    ((64, 256, 64, 8, 4, 64, 128), True),
    ((128, 128, 64, 8, 5, 64, 128), False),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4096,8192,1024,4001")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gpu_common.setup("cuda", "off")
    import torch
    import torch.nn.functional as F
    import triton

    from benchmark import gluon_linear_lora as gll
    from sglang.kernels.ops.diffusion.gemm import linear_lora_triton as ll
    from sglang.kernels.ops.diffusion.gemm import lora_b_scale_add_triton as lb
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager
    from sglang.multimodal_gen.runtime.layers.train_parity_kernels import bitwise_equal

    result = {
        "script": "benchmark/probe_gluon_mlp_up.py",
        "argv": sys.argv[1:],
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(),
        "cases": [],
    }
    print(result, flush=True)
    table = lb.gelu_tanh_table(torch.device("cuda"))
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
        }
        for tiles, producer in GLUON_TILES:
            first = (tiles, producer) == GLUON_TILES[0]
            for gelu_tanh in (True, False) if first else (True,):
                name = "gluon " + "x".join(map(str, tiles))
                name += (" producer" if producer else "") + (
                    "" if gelu_tanh else " no GELU"
                )
                timed[name] = (
                    lambda tiles=tiles, g=gelu_tanh, p=producer: gll.linear_lora_gelu_bf16(
                        x,
                        weight,
                        bias,
                        down,
                        lora_B,
                        2.0,
                        table,
                        tiles=tiles,
                        gelu_tanh=g,
                        producer=p,
                    ),
                    gelu if gelu_tanh else summed,
                )
        case = {"rows": rows, "us": {}}
        for name, (fn, expected) in timed.items():
            try:
                got = fn()
                torch.cuda.synchronize()
                entry = {}
                if expected is not None:
                    entry["equal"] = bitwise_equal(got, expected)
                    if not entry["equal"]:
                        differ = got.view(torch.int16) != expected.view(torch.int16)
                        entry["differing"] = int(differ.sum())
                        entry["first"] = differ.nonzero()[:4].tolist()
                entry["us"] = round(graph_us(fn), 1)
            except Exception as e:
                entry = {"error": f"{type(e).__name__}: {e}"[:600]}
            case["us"][name] = entry
            print(f"rows {rows} {name}: {entry}", flush=True)
        result["cases"].append(case)
    result["versions"] = gpu_common.versions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
