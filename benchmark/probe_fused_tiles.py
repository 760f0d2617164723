"""H200 probe: tile choices for the train_parity LoRA-B (+ GELU) and Q/K kernels at Qwen-Image's
per-block shapes, each checked bitwise against its eager chain and timed by CUDA-graph replay
(kernel time without the host's launch cost), next to the eager chains and cuBLAS.

    python3 benchmark/probe_fused_tiles.py --out /tmp/tiles.json

Prints one line per case and writes a JSON summary. The chosen tiles are the defaults of
lora_b_scale_add_triton._TILES and qknorm_complex_rope_joint_triton._ROWS;
the unit tests check the defaults over many shapes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))  # the fork's tools (torch only)

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


def checked_timing(fn, expected) -> dict:
    """``fn``'s output (a tensor, or a sequence of them compared as one flat
    tensor) checked bitwise against ``expected`` (None: not checked), with the
    ULP distance where not equal, and its CUDA-graph time; an exception becomes
    the entry's error."""
    import torch
    from sglang_train_parity.compare import ulp_distance

    from sglang.multimodal_gen.runtime.layers.train_parity_kernels import bitwise_equal

    try:
        got = fn()
        torch.cuda.synchronize()
        entry = {}
        if expected is not None:
            entry["equal"] = bitwise_equal(got, expected)
            if not entry["equal"]:
                got_bits, expected_bits = (
                    torch.cat([t.reshape(-1) for t in v]) if isinstance(v, (list, tuple)) else v
                    for v in (got, expected)
                )
                differ = got_bits.view(torch.int16) != expected_bits.view(torch.int16)
                entry["differing"] = int(differ.sum())
                entry["first"] = differ.nonzero()[:4].tolist()
                entry["max_ulp"] = ulp_distance(got_bits, expected_bits)
        entry["us"] = round(graph_us(fn), 1)
    except Exception as e:
        entry = {"error": f"{type(e).__name__}: {e}"[:600]}
    return entry


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
                    "cublas_lora_b_us": round(
                        graph_us(lambda: F.linear(down, lora_B)), 1
                    ),
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


GELU_LOOPED = [  # (BLOCK_M, BLOCK_N, column tiles per program, num_warps, num_stages)
    (32, 64, 8, 4, 1),
    (32, 64, 8, 4, 2),
    (64, 64, 8, 4, 2),
    (32, 128, 4, 4, 2),
    (64, 128, 4, 8, 2),
    (64, 64, 16, 4, 3),
    (128, 64, 8, 8, 2),
]


def _lora_b_gelu_looped_kernel():
    """The LoRA-B + GELU kernel's arithmetic with another schedule: a program loads its rows'
    ``down`` once and walks several column tiles, the base tile loaded before the rank-64 dot.
    """
    import triton
    import triton.language as tl

    from benchmark.probe_base_gemm import _gelu_tanh

    @triton.jit
    def kernel(
        out_ptr,
        base_ptr,
        down_ptr,
        lora_b_ptr,
        scale,
        n_rows,
        n_cols,
        RANK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        COL_TILES: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        ks = tl.arange(0, RANK)
        down = tl.load(
            down_ptr + rows[:, None] * RANK + ks[None, :], row_mask[:, None], 0.0
        )
        for tile in tl.range(0, COL_TILES, num_stages=STAGES):
            cols = (tl.program_id(1) * COL_TILES + tile) * BLOCK_N + tl.arange(
                0, BLOCK_N
            )
            col_mask = cols < n_cols
            offsets = rows[:, None] * n_cols + cols[None, :]
            mask = row_mask[:, None] & col_mask[None, :]
            base = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            lora_b = tl.load(
                lora_b_ptr + cols[None, :] * RANK + ks[:, None], col_mask[None, :], 0.0
            )
            update = tl.dot(
                down, lora_b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            )
            update = update.to(tl.bfloat16).to(tl.float32)
            scaled = (update * scale).to(tl.bfloat16).to(tl.float32)
            out = (base + scaled).to(tl.bfloat16)
            out = _gelu_tanh(out.to(tl.float32)).to(tl.bfloat16)
            tl.store(out_ptr + offsets, out, mask=mask)

    return kernel


def gelu_looped_cases(rows_list, out):
    import torch
    import triton

    from sglang.kernels.ops.diffusion.gemm import lora_b_scale_add_triton as lb
    from sglang.multimodal_gen.runtime.layers.train_parity_kernels import bitwise_equal

    kernel = _lora_b_gelu_looped_kernel()
    for rows in rows_list:
        base = torch.randn(rows, MLP, device="cuda").bfloat16()
        down = (torch.randn(rows, 64, device="cuda") * 4).bfloat16()
        lora_B = (torch.randn(MLP, 64, device="cuda") * 0.02).bfloat16()
        expected = lb.lora_b_scale_add_bf16(base, down, lora_B, 2.0, gelu_tanh=True)
        row = {
            "rows": rows,
            "fork_us": round(
                graph_us(
                    lambda: lb.lora_b_scale_add_bf16(
                        base, down, lora_B, 2.0, gelu_tanh=True
                    )
                ),
                1,
            ),
            "looped": {},
        }
        result = torch.empty_like(base)
        for block_m, block_n, col_tiles, warps, stages in GELU_LOOPED:
            grid = (triton.cdiv(rows, block_m), triton.cdiv(MLP, block_n * col_tiles))

            def fused(
                block_m=block_m,
                block_n=block_n,
                col_tiles=col_tiles,
                warps=warps,
                stages=stages,
                grid=grid,
            ):
                kernel[grid](
                    result,
                    base,
                    down,
                    lora_B,
                    2.0,
                    rows,
                    MLP,
                    RANK=64,
                    BLOCK_M=block_m,
                    BLOCK_N=block_n,
                    COL_TILES=col_tiles,
                    STAGES=stages,
                    num_warps=warps,
                    enable_fp_fusion=False,
                )

            name = f"{block_m}x{block_n}x{col_tiles}w{warps}s{stages}"
            try:
                fused()
                row["looped"][name] = {
                    "equal": bitwise_equal(result, expected),
                    "us": round(graph_us(fused), 1),
                }
            except (
                Exception
            ) as error:  # a schedule the compiler refuses: record it, go on
                row["looped"][name] = {
                    "error": f"{type(error).__name__}: {error}"[:200]
                }
        print(
            f"lora-b + gelu rows {rows:5d} fork {row['fork_us']} us  "
            + " ".join(
                f"{k}:{v.get('us', 'ERR')}{'' if v.get('equal', True) else '(DIFFERS)'}"
                for k, v in row["looped"].items()
            ),
            flush=True,
        )
        out.append(row)


def qk_cases(batch, out):
    import torch

    from sglang.kernels.ops.diffusion.rope import qknorm_complex_rope_joint_triton as qk
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager
    from sglang.multimodal_gen.runtime.layers.train_parity_kernels import bitwise_equal

    weights = [
        (torch.rand(128, device="cuda") * 0.4 + 0.8).bfloat16() for _ in range(2)
    ]
    for seq in (4096, 211):
        angles = torch.randn(seq, 64, device="cuda") * 100
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = (
            torch.randn(batch, seq, HEADS, 128, device="cuda").bfloat16()
            for _ in range(2)
        )
        # a joint buffer with 77 rows before this part, as the text + image sequence
        q_out = q.new_empty(batch, seq + 77, HEADS, 128)
        k_out = torch.empty_like(q_out)

        def chain():
            return (
                eager.rotary_emb(eager.rms_norm(q, weights[0], 1e-6), freqs),
                eager.rotary_emb(eager.rms_norm(k, weights[1], 1e-6), freqs),
            )

        expected = chain()
        row = {
            "batch": batch,
            "seq": seq,
            "eager_us": round(graph_us(chain), 1),
            "tiles": {},
        }
        for rows in QK_ROWS:

            def fused(rows=rows):
                qk.qknorm_complex_rope_joint_(
                    q, k, *weights, freqs, 1e-6, q_out, k_out, 77, rows=rows
                )

            fused()
            equal = bitwise_equal((q_out[:, 77:], k_out[:, 77:]), expected)
            row["tiles"][f"rows{rows}"] = {
                "equal": equal,
                "us": round(graph_us(fused), 1),
            }
        best = min(
            ((k, v) for k, v in row["tiles"].items() if v["equal"]),
            key=lambda kv: kv[1]["us"],
        )
        print(
            f"q/k b{batch} seq {seq:5d} eager {row['eager_us']:7.1f} us best {best[0]} "
            f"{best[1]['us']:.1f} us  "
            + " ".join(
                f"{k}:{v['us']}{'' if v['equal'] else '(DIFFERS)'}"
                for k, v in row["tiles"].items()
            ),
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
    parser.add_argument(
        "--qk-only", action="store_true", help="only the Q/K kernel's tiles"
    )
    parser.add_argument(
        "--gelu-looped",
        action="store_true",
        help="also the LoRA-B + GELU kernel's looped schedules",
    )
    args = parser.parse_args()
    gpu_common.setup("cuda", "off")
    import torch

    result = {
        "script": "benchmark/probe_fused_tiles.py",
        "lora_b": [],
        "qk": [],
        "gemm": [],
        "gelu_looped": [],
    }
    with torch.no_grad():
        if args.gelu_looped:
            gelu_looped_cases((4096, 1024, 8192), result["gelu_looped"])
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
