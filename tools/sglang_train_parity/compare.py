# SPDX-License-Identifier: Apache-2.0
"""Pairing sglang's module outputs with the training forward's, and how far apart they are."""

from __future__ import annotations

from collections.abc import Callable

import torch
from sglang_train_parity.reference import ModulePair, Pairing, sglang_to_diffusers


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between bf16 tensors in units in the last place (0 = bitwise equal)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)  # monotonic; -0.0 == +0.0

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def compare_modules(
    sgl: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    lora: bool,
    pair_of: Callable[..., ModulePair] = sglang_to_diffusers,
) -> list[dict]:
    """One record per paired module, in sglang's execution order: dtype, shape, bitwise equal,
    max |diff| and max ULP distance (bf16). `pair_of` is the family's module pairing."""
    records = []
    for name, ours in sgl.items():
        pair = pair_of(name, lora=lora)
        theirs = ref.get(pair.diffusers) if pair.diffusers is not None else None
        if theirs is None or pair.pairing in (Pairing.DIFFERENT, Pairing.SGLANG_ONLY):
            continue
        if pair.pairing is Pairing.RESHAPED:
            theirs = theirs.reshape(ours.shape)
        elif pair.pairing is Pairing.ROUNDED:
            theirs = theirs.to(ours.dtype)
        same_layout = ours.dtype == theirs.dtype and ours.shape == theirs.shape
        diff = (ours.float() - theirs.float()).abs() if same_layout else None
        records.append(
            {
                "sglang": name,
                "diffusers": pair.diffusers,
                "dtype": str(ours.dtype).removeprefix("torch."),
                "shape": list(ours.shape),
                "equal": same_layout and torch.equal(ours, theirs),
                "max_abs_diff": (
                    float(diff.max()) if diff is not None and diff.numel() else None
                ),
                "max_ulp": (
                    ulp_distance(ours, theirs)
                    if same_layout and ours.dtype == torch.bfloat16
                    else None
                ),
            }
        )
    return records


def first_divergence(records: list[dict]) -> str | None:
    return next((r["sglang"] for r in records if not r["equal"]), None)
