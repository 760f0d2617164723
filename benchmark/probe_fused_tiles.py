"""H200 probe: tile choices for the train_parity LoRA-B (+ GELU) and Q/K kernels at Qwen-Image's
per-block shapes, each checked bitwise against its eager chain and timed by CUDA-graph replay
(kernel time without the host's launch cost), next to the eager chains and cuBLAS.

    python3 benchmark/probe_fused_tiles.py --out /tmp/tiles.json

Prints one line per case and writes a JSON summary. The chosen tiles are the defaults of
lora_b_scale_add_triton._tiles and qknorm_complex_rope_joint_triton._ROWS;
the unit tests check the defaults over many shapes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark import gpu_common  # noqa: E402

DIM, HEADS, MLP = 3072, 24, 12288
LORA_TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)
    (128, 128, 16, 8),
    (128, 128, 64, 8),
    (64, 128, 64, 4),
    (128, 64, 64, 4),
    (64, 64, 64, 4),
    (64, 256, 64, 8),
    (128, 256, 64, 8),
    (256, 128, 64, 8),
    (32, 128, 64, 4),
    (64, 128, 16, 4),
    (32, 64, 64, 4),
    (16, 128, 64, 4),
    (32, 128, 64, 2),
    (32, 256, 64, 8),
    (64, 128, 64, 8),
]
QK_ROWS = [4, 8]  # heads per group, one per warp


def graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph

    fn()
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def lora_cases(rows_list, out):
    import torch
    import torch.nn.functional as F

    from sglang.kernels.ops.diffusion.gemm import lora_b_scale_add_triton as lb
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager
    from sglang.multimodal_gen.runtime.layers.train_parity_kernels import bitwise_equal

    for rows in rows_list:
        for width in (DIM, MLP):
            for gelu in (False, True) if width == MLP else (False,):
                base = torch.randn(rows, width, device="cuda").bfloat16()
                down = (torch.randn(rows, 64, device="cuda") * 4).bfloat16()
                lora_B = (torch.randn(width, 64, device="cuda") * 0.02).bfloat16()

                def chain():
                    up = eager.add_lora_up(base, down, lora_B, 2.0)
                    return F.gelu(up, approximate="tanh") if gelu else up

                expected = chain()
                row = {
                    "rows": rows,
                    "width": width,
                    "gelu_tanh": gelu,
                    "eager_us": round(graph_us(chain), 1),
                    "cublas_lora_b_us": round(graph_us(lambda: F.linear(down, lora_B)), 1),
                    "tiles": {},
                }
                for tiles in LORA_TILES:
                    def fused(tiles=tiles):
                        return lb.lora_b_scale_add_bf16(
                            base, down, lora_B, 2.0, gelu_tanh=gelu, tiles=tiles
                        )

                    equal = bitwise_equal(fused(), expected)
                    row["tiles"]["x".join(map(str, tiles))] = {
                        "equal": equal,
                        "us": round(graph_us(fused), 1),
                    }
                best = min(row["tiles"].items(), key=lambda kv: kv[1]["us"])
                print(
                    f"lora-b rows {rows:5d} width {width:5d} gelu {gelu!s:5} eager "
                    f"{row['eager_us']:7.1f} us cuBLAS B {row['cublas_lora_b_us']:6.1f} us "
                    f"best {best[0]} {best[1]['us']:.1f} us  all equal "
                    f"{all(t['equal'] for t in row['tiles'].values())}  "
                    + " ".join(f"{k}:{v['us']}" for k, v in row["tiles"].items()),
                    flush=True,
                )
                out.append(row)


def qk_cases(batch, out):
    import torch

    from sglang.kernels.ops.diffusion.rope import qknorm_complex_rope_joint_triton as qk
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager
    from sglang.multimodal_gen.runtime.layers.train_parity_kernels import bitwise_equal

    weights = [(torch.rand(128, device="cuda") * 0.4 + 0.8).bfloat16() for _ in range(2)]
    for seq in (4096, 211):
        angles = torch.randn(seq, 64, device="cuda") * 100
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = (torch.randn(batch, seq, HEADS, 128, device="cuda").bfloat16() for _ in range(2))
        # a joint buffer with 77 rows before this part, as the text + image sequence
        q_out = q.new_empty(batch, seq + 77, HEADS, 128)
        k_out = torch.empty_like(q_out)

        def chain():
            return (
                eager.rotary_emb(eager.rms_norm(q, weights[0], 1e-6), freqs),
                eager.rotary_emb(eager.rms_norm(k, weights[1], 1e-6), freqs),
            )

        expected = chain()
        row = {"batch": batch, "seq": seq, "eager_us": round(graph_us(chain), 1), "tiles": {}}
        for rows in QK_ROWS:
            def fused(rows=rows):
                qk.qknorm_complex_rope_joint_(
                    q, k, *weights, freqs, 1e-6, q_out, k_out, 77, rows=rows
                )

            fused()
            equal = bitwise_equal((q_out[:, 77:], k_out[:, 77:]), expected)
            row["tiles"][f"rows{rows}"] = {"equal": equal, "us": round(graph_us(fused), 1)}
        best = min(
            ((k, v) for k, v in row["tiles"].items() if v["equal"]), key=lambda kv: kv[1]["us"]
        )
        print(
            f"q/k b{batch} seq {seq:5d} eager {row['eager_us']:7.1f} us best {best[0]} "
            f"{best[1]['us']:.1f} us  "
            + " ".join(f"{k}:{v['us']}{'' if v['equal'] else '(DIFFERS)'}" for k, v in row["tiles"].items()),
            flush=True,
        )
        out.append(row)


def sustained_gemm(out):
    """cuBLAS's image-stream GEMM back to back (graph replay) against the same GEMM with host gaps:
    whether sustained load alone slows the GEMMs of a replayed step."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    x = torch.randn(4096, DIM, device="cuda").bfloat16()
    for width in (DIM, MLP):
        w = (torch.randn(width, DIM, device="cuda") * 0.02).bfloat16()
        b = torch.randn(width, device="cuda").bfloat16()

        def gemm():
            return F.linear(x, w, b)

        replay = graph_us(gemm)
        gapped = []
        for _ in range(20):
            torch.cuda.synchronize()
            time.sleep(0.002)
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            gemm()
            end.record()
            torch.cuda.synchronize()
            gapped.append(start.elapsed_time(end) * 1e3)
        row = {
            "width": width,
            "replay_us": round(replay, 1),
            "isolated_us_median": round(sorted(gapped)[len(gapped) // 2], 1),
            "do_bench_us": round(do_bench(gemm, return_mode="median") * 1e3, 1),
        }
        print(f"gemm 4096x{DIM} -> {width}: {row}", flush=True)
        out.append(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--qk-only", action="store_true", help="only the Q/K kernel's tiles")
    args = parser.parse_args()
    gpu_common.setup("cuda", "off")
    import torch

    result = {"script": "benchmark/probe_fused_tiles.py", "lora_b": [], "qk": [], "gemm": []}
    with torch.no_grad():
        if not args.qk_only:
            lora_cases((4096, 211, 8192), result["lora_b"])
        for batch in (1, 2):
            qk_cases(batch, result["qk"])
        if not args.qk_only:
            sustained_gemm(result["gemm"])
    result["versions"] = gpu_common.versions()
    gpu_common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
