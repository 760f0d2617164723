"""The train_parity fused kernels against their eager chains at Qwen-Image's per-block shapes
(1024x1024: 4096 image tokens, 211 / 77 text tokens, width 3072, 24 heads x 128, MLP 12288):
bitwise equal or not, and the time of each (CUDA events, median of triton.testing.do_bench).

    python benchmark/gpu_kernels.py [--out PATH]

The kernels' bitwise tests over many shapes are the fork's unit tests
(test_train_parity_kernels*.py, run by run_h200.sh kernels); this script times them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark import gpu_common, gpu_standins  # noqa: E402

DIM, HEADS, MLP = 3072, 24, 12288
TOKENS = {"image": 4096, "text 211": 211}


def cases(batch: int):
    import torch

    from sglang.multimodal_gen.runtime.layers import train_parity_kernels as fused
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager
    from sglang.multimodal_gen.runtime.layers.layernorm import RMSNorm
    from sglang.multimodal_gen.runtime.utils import train_parity

    bf16, dev = torch.bfloat16, "cuda"
    with train_parity.numerics_mode_context("train_parity"):
        norms = [RMSNorm(128, eps=1e-6).to(dev, bf16) for _ in range(4)]
    for norm in norms:
        norm.weight.data.uniform_(0.8, 1.2)
    for stream, seq in TOKENS.items():
        x = torch.randn(batch, seq, DIM, device=dev).to(bf16)
        mod = torch.randn(batch, 6 * DIM, device=dev).to(bf16)
        shift, scale, gate = mod[:, :DIM], mod[:, DIM : 2 * DIM], mod[:, 2 * DIM : 3 * DIM]
        y = torch.randn(batch, seq, DIM, device=dev).to(bf16)
        yield (
            f"LayerNorm + modulation, {stream}",
            lambda x=x, shift=shift, scale=scale: fused.layer_norm_scale_shift(
                x, shift.unsqueeze(1), scale.unsqueeze(1), 1e-6
            ),
            lambda x=x, shift=shift, scale=scale: eager.layer_norm_scale_shift(
                x, shift.unsqueeze(1), scale.unsqueeze(1), 1e-6
            ),
        )
        yield (
            f"gated residual, {stream}",
            lambda x=x, y=y, gate=gate: fused.gated_residual(x, gate.unsqueeze(1), y),
            lambda x=x, y=y, gate=gate: eager.gated_residual(x, gate.unsqueeze(1), y),
        )
        for width in (DIM, MLP):
            base = torch.randn(batch, seq, width, device=dev).to(bf16)
            down = torch.randn(batch, seq, 64, device=dev).to(bf16)
            lora_B = (torch.randn(width, 64, device=dev) * 0.02).to(bf16)
            yield (
                f"LoRA-B GEMM + scale-and-add (r64), {stream}, width {width}",
                lambda b=base, d=down, w=lora_B: fused.add_lora_up(b, d, w, 2.0),
                lambda b=base, d=down, w=lora_B: eager.add_lora_up(b, d, w, 2.0),
            )
    parts = []
    for seq, (q_norm, k_norm) in zip(TOKENS.values(), (norms[:2], norms[2:])):
        angles = torch.randn(seq, 64, device=dev) * 100
        freqs = torch.polar(torch.ones_like(angles), angles)
        q, k = (torch.randn(batch, seq, HEADS, 128, device=dev).to(bf16) for _ in range(2))
        parts.append((q, k, q_norm, k_norm, freqs))
    parts = parts[::-1]  # text first, as the joint sequence
    yield (
        "Q/K RMSNorm + RoPE into the joint Q/K (text 211 + image 4096)",
        lambda: fused.joint_qk_norm_rope(parts),
        lambda: tuple(
            torch.cat(
                [eager.rotary_emb(p[n](p[i]), p[4]) for p in parts], dim=1
            )
            for i, n in ((0, 2), (1, 3))
        ),
    )


ADVERSARIAL_ROWS = {
    "zeros": lambda r: r * 0,
    "negative zeros": lambda r: r * 0 - 0.0,
    "x 2^60": lambda r: r * 2.0**60,
    "x 2^-70 (subnormal squares)": lambda r: r * 2.0**-70,
    "bf16 ties": lambda r: r * 0 + (1 + 2.0**-8),
}


def qk_adversarial_rows() -> dict:
    """The Q/K kernel against its eager chain with one kind of adversarial row at a time among
    random rows: which kinds differ, and the first differing element's bits."""
    import torch

    from sglang.kernels.ops import diffusion as kernels
    from sglang.multimodal_gen.runtime.layers import train_parity_ops as eager

    out = {}
    weight = (torch.rand(128, device="cuda") * 0.4 + 0.8).to(torch.bfloat16)
    angles = torch.randn(64, 64, device="cuda") * 100
    freqs = torch.polar(torch.ones_like(angles), angles)
    for kind, make in ADVERSARIAL_ROWS.items():
        x = torch.randn(1, 64, HEADS, 128, device="cuda")
        x[0, 5, 3] = make(x[0, 5, 3])
        x = x.to(torch.bfloat16)
        ref = eager.rotary_emb(eager.rms_norm(x, weight, 1e-6), freqs)
        q_out, k_out = torch.empty_like(x), torch.empty_like(x)
        kernels.qknorm_complex_rope_joint_(x, x, weight, weight, freqs, 1e-6, q_out, k_out, 0)
        bits_f, bits_e = q_out.view(torch.int16), ref.view(torch.int16)
        differ = (bits_f != bits_e).nonzero()
        out[kind] = {
            "equal": not len(differ),
            "differing_elements": len(differ),
            "first": None
            if not len(differ)
            else {
                "index": differ[0].tolist(),
                "fused": float(q_out[tuple(differ[0])]),
                "eager": float(ref[tuple(differ[0])]),
            },
        }
        print(f"Q/K adversarial row {kind:30s} {out[kind]}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmark/results/kernels_h200.json")
    args = parser.parse_args()
    gpu_common.setup("cuda", "off")
    import torch
    from triton.testing import do_bench

    from sglang.multimodal_gen.runtime.layers import train_parity_kernels

    rows = []
    with torch.no_grad():
        for batch in (1, 2):
            for name, fused, eager in cases(batch):
                out_f, out_e = fused(), eager()
                equal = train_parity_kernels.bitwise_equal(out_f, out_e)
                t_f = do_bench(fused, warmup=25, rep=100, return_mode="median")
                t_e = do_bench(eager, warmup=25, rep=100, return_mode="median")
                rows.append(
                    {
                        "kernel": name,
                        "batch": batch,
                        "bitwise_equal": equal,
                        "fused_us": round(t_f * 1e3, 1),
                        "eager_us": round(t_e * 1e3, 1),
                        "speedup": round(t_e / t_f, 2),
                    }
                )
                print(
                    f"b{batch} {name:62s} equal={equal} fused {t_f * 1e3:8.1f} us "
                    f"eager {t_e * 1e3:8.1f} us  x{t_e / t_f:5.2f}",
                    flush=True,
                )
        adversarial = qk_adversarial_rows()
    result = {
        "script": "benchmark/gpu_kernels.py",
        "rows": rows,
        "qk_adversarial_rows": adversarial,
        "gates": train_parity_kernels.gate_states(),
        "versions": gpu_common.versions(),
        "standin_calls": gpu_standins.calls(),
    }
    gpu_common.write_json(args.out, result)
    ok = all(r["bitwise_equal"] for r in rows) and not any(
        g["disabled"] for g in result["gates"].values()
    )
    print("gates:", result["gates"])
    print("passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
