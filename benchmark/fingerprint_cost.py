"""What rollout fingerprints cost per denoising step, at real Qwen-Image sizes.

Per step a train_parity rollout copies the two CFG branch outputs and the combined output on the
device and reads the cached adapter checksum (a walk over the DiT's LoRA layers); at the end of
the rollout it hashes every copy on the host. Pushing an adapter hashes it once (the cache fill).
This times each part with the real code (sglang's rollout_fingerprints / policy_checksum) on
tensors of the real shapes, and divides by the measured train_parity step time.

    python benchmark/fingerprint_cost.py --device cuda --out fingerprint_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from sglang.multimodal_gen.runtime.layers.lora.linear import wrap_with_lora_layer
from sglang.multimodal_gen.runtime.post_training.policy_checksum import (
    cached_adapter_checksum,
)
from sglang.multimodal_gen.runtime.post_training.rollout_fingerprints import (
    RolloutFingerprints,
)

# docs/results.md (run 66): train_parity, 60 blocks, 1024², CFG as two forwards, LoRA r64, H200
STEP_MS_H200 = 303.1
HIDDEN, MLP, BLOCKS, RANK = 3072, 12288, 60, 64
# per block: 8 attention projections (hidden -> hidden), 2 MLPs (up, down) per stream
TARGETS = [(HIDDEN, HIDDEN)] * 8 + [(HIDDEN, MLP), (MLP, HIDDEN)] * 2


def lora_dit(device: str, blocks: int) -> nn.Module:
    """Linear layers of Qwen-Image's LoRA targets, wrapped and holding a rank-64 adapter.
    The base weights are meta tensors on the device side of what is timed (never read).
    """
    dit = nn.Module()
    for b in range(blocks):
        block = nn.Module()
        for t, (fan_in, fan_out) in enumerate(TARGETS):
            layer = wrap_with_lora_layer(nn.Linear(1, 1, dtype=torch.bfloat16))
            layer.lora_rank, layer.lora_alpha = RANK, 2 * RANK
            layer.set_lora_weights(
                torch.randn(RANK, fan_in, device=device).to(torch.bfloat16),
                torch.randn(fan_out, RANK, device=device).to(torch.bfloat16),
                merge_weights=False,
                clear_existing=True,
            )
            block.add_module(f"t{t}", layer)
        dit.add_module(f"b{b}", block)
    return dit


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", type=int, default=BLOCKS)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = args.device

    started = time.perf_counter()
    dit = lora_dit(device, args.blocks)
    build_s = time.perf_counter() - started
    adapter_params = sum(
        layer.lora_A.numel() + layer.lora_B.numel()
        for layer in dit.modules()
        if getattr(layer, "lora_A", None) is not None
    )
    fill_ms = timed(
        lambda: (
            dit.__dict__.pop("_adapter_checksum_cache", None),
            cached_adapter_checksum(dit),
        ),
        device,
        2,
    )
    hit_ms = timed(lambda: cached_adapter_checksum(dit), device, 10)

    results = {}
    for name, tokens in (("512x512", 1024), ("1024x1024", 4096)):
        cond = torch.randn(1, tokens, 64, device=device).to(torch.bfloat16)
        uncond = torch.randn(1, tokens, 64, device=device).to(torch.bfloat16)
        combined = torch.randn(1, tokens, 64, device=device)

        def rollout():
            fingerprints = RolloutFingerprints()
            for step in range(args.steps):
                fingerprints.record_step(
                    step, dit, {"conditional": cond, "unconditional": uncond}, combined
                )
            return fingerprints.per_output()

        per_rollout = timed(rollout, device, 5)
        per_step_ms = statistics.median(per_rollout) / args.steps
        results[name] = {
            "tokens": tokens,
            "rollout_ms": per_rollout,
            "per_step_ms": per_step_ms,
            "share_of_h200_step": per_step_ms / STEP_MS_H200,
        }
        print(
            f"{name}: {per_step_ms:.3f} ms per step "
            f"({100 * per_step_ms / STEP_MS_H200:.2f}% of a {STEP_MS_H200} ms step)"
        )
    print(
        f"adapter checksum: fill {statistics.median(fill_ms):.0f} ms "
        f"({adapter_params / 1e6:.0f} M adapter params), hit "
        f"{statistics.median(hit_ms):.2f} ms (inside per_step_ms)"
    )
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "blocks": args.blocks,
        "steps": args.steps,
        "lora_rank": RANK,
        "adapter_params": adapter_params,
        "model_build_s": build_s,
        "adapter_checksum_fill_ms": fill_ms,
        "adapter_checksum_hit_ms": hit_ms,
        "sizes": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
