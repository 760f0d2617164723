"""H200 probe: tile choices for the train_parity LoRA-B (+ GELU) and Q/K kernels at Qwen-Image's
per-block shapes, each checked bitwise against its eager chain and timed by CUDA-graph replay
(kernel time without the host's launch cost), next to the eager chains and cuBLAS.

    python3 benchmark/probe_fused_tiles.py --out /tmp/tiles.json

Prints one line per case and writes a JSON summary. The chosen tiles are the defaults of
lora_b_scale_add_triton._tiles and qknorm_complex_rope_joint_triton (_ROWS, _GROUPS, _WARPS);
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
QK_TILES = [  # (rows per group, groups per program, num_warps)
    (4, 1, 4),
    (4, 2, 4),
    (4, 4, 4),
    (4, 8, 4),
    (8, 1, 8),
    (8, 2, 8),
    (8, 4, 8),
    (8, 1, 4),
    (16, 1, 4),
]
QK_LANES_TILES = [(4, 4), (8, 4), (16, 4), (8, 8), (16, 8), (32, 8)]  # (rows, num_warps)


def _qk_lanes_kernel():
    """A variant of the Q/K kernel that loads rows as [ROWS, 32, 4] (lane l owns s[4l..4l+3]
    from the load on), so that no layout conversion should be needed; same arithmetic."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, rope_ptr, q_out_ptr, k_out_ptr,
        n_rows, seq_len, heads, out_batch_stride, out_offset, eps,
        ROWS: tl.constexpr, FUSE_REAL_SIN: tl.constexpr,
    ):
        if tl.program_id(1) == 0:
            x_ptr, weight_ptr, out_ptr = q_ptr, q_weight_ptr, q_out_ptr
        else:
            x_ptr, weight_ptr, out_ptr = k_ptr, k_weight_ptr, k_out_ptr
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        col = tl.arange(0, 32)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
        mask = (row < n_rows)[:, None, None]
        value = tl.load(x_ptr + row[:, None, None] * 128 + col, mask, 0.0).to(tl.float32)
        weight = tl.load(weight_ptr + col).to(tl.float32)
        token = row // heads % seq_len
        rotation = tl.load(rope_ptr + token[:, None, None] * 128 + col, mask, 0.0)
        even, odd = tl.split(tl.reshape(value * value, (ROWS, 32, 2, 2)))
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
        variance = tl.sum(((s0 + s1) + s2) + s3, 1) * 0.0078125
        inv = tl.rsqrt(variance + eps)
        value = (value * inv[:, None, None]).to(tl.bfloat16).to(tl.float32)
        value = (value * weight).to(tl.bfloat16).to(tl.float32)
        real, imag = tl.split(tl.reshape(value, (ROWS, 32, 2, 2)))
        cos, sin = tl.split(tl.reshape(rotation, (ROWS, 32, 2, 2)))
        out_real = tl.fma(real, cos, (imag * sin) * -1.0)
        if FUSE_REAL_SIN:
            out_imag = tl.fma(real, sin, imag * cos)
        else:
            out_imag = tl.fma(imag, cos, real * sin)
        out = tl.reshape(tl.join(out_real, out_imag), (ROWS, 32, 4))
        batch_rows = seq_len * heads
        target = (row // batch_rows) * out_batch_stride + out_offset + (row % batch_rows) * 128
        tl.store(out_ptr + target[:, None, None] + col, out.to(out_ptr.dtype.element_ty), mask)

    return kernel


def qk_lanes_launch(kernel, q, k, weights, freqs, q_out, k_out, offset, rows, warps):
    import torch
    import triton

    from sglang.kernels.ops.diffusion.rope.complex_rope_triton import _fuse_real_sin

    batch, seq_len, heads, _ = q.shape
    n_rows = batch * seq_len * heads
    kernel[(triton.cdiv(n_rows, rows), 2)](
        q, k, *weights, torch.view_as_real(freqs), q_out, k_out, n_rows, seq_len, heads,
        q_out.stride(0), offset * heads * 128, 1e-6, ROWS=rows,
        FUSE_REAL_SIN=_fuse_real_sin(q.device), num_warps=warps,
        enable_fp_fusion=False, enable_reflect_ftz=False,
    )


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
        for tiles in QK_TILES:
            def fused(tiles=tiles):
                qk.qknorm_complex_rope_joint_(
                    q, k, *weights, freqs, 1e-6, q_out, k_out, 77, tiles=tiles
                )

            fused()
            equal = bitwise_equal((q_out[:, 77:], k_out[:, 77:]), expected)
            row["tiles"]["x".join(map(str, tiles))] = {"equal": equal, "us": round(graph_us(fused), 1)}
        lanes = _qk_lanes_kernel()
        for rows, warps in QK_LANES_TILES:
            def fused(rows=rows, warps=warps):
                qk_lanes_launch(lanes, q, k, weights, freqs, q_out, k_out, 77, rows, warps)

            fused()
            equal = bitwise_equal((q_out[:, 77:], k_out[:, 77:]), expected)
            row["tiles"][f"lanes{rows}x{warps}"] = {"equal": equal, "us": round(graph_us(fused), 1)}
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
