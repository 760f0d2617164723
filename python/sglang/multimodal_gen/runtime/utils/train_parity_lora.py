# SPDX-License-Identifier: Apache-2.0
"""What a LoRA adapter may be under ``--numerics train_parity``: one unmerged
PEFT adapter at strength 1, as the trainer runs it, whichever entry point sets
it (``check_lora``).

An adapter pushed as tensors states its rank and alpha (``check_lora_update``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sglang.multimodal_gen.runtime.utils.train_parity import TrainParityError


def check_lora_update(lora_rank: Any, lora_alpha: Any) -> None:
    """An adapter pushed as tensors states its rank and alpha."""
    missing = [
        name
        for name, value in (("lora_rank", lora_rank), ("lora_alpha", lora_alpha))
        if value is None
    ]
    if missing:
        raise TrainParityError(
            f"a LoRA update without {' and '.join(missing)}",
            "the adapter's scale alpha / rank is not in its tensors, and the "
            "default alpha = rank serves another policy than the trainer's",
            "send the trainer's lora_rank and lora_alpha",
        )


_UNMERGED = (
    "PEFT adds the update to the base layer's output; a weight with the update "
    "merged in rounds differently"
)


def lora_conflicts(
    strengths: tuple[float, ...] = (1.0,),
    strength_option: str = "LoRA strength",
    merge: bool = False,
    stacked_adapters: bool = False,
    output_offset: bool = False,
    stacked_ab: bool = False,
) -> Iterator[tuple[str, str, str]]:
    """(option, why, instead) for each way a LoRA setting departs from the one
    unmerged PEFT adapter at strength 1 the trainer runs."""
    for strength in strengths:
        if strength != 1.0:
            yield (
                f"{strength_option} {strength}",
                "the trainer applies its adapter at strength 1",
                "set strength 1.0 (scale the adapter's alpha in training instead)",
            )
    if merge:
        yield "merged LoRA weights", _UNMERGED, "keep --lora-merge-mode dynamic"
    if stacked_adapters:
        yield (
            "several LoRA adapters at once",
            "the trainer runs one PEFT adapter",
            "set one adapter",
        )
    if output_offset:
        yield "a LoRA output offset", "PEFT's adapter has none", "drop the offset"
    if stacked_ab:
        yield (
            "stacked (3-D) LoRA A/B",
            "PEFT's adapter is one A/B pair per Linear",
            "send one pair per projection",
        )


def check_lora(**settings: Any) -> None:
    """Refuse the first of ``lora_conflicts(**settings)``."""
    for option, why, instead in lora_conflicts(**settings):
        raise TrainParityError(option, why, instead)


def refuse_lora_endpoint(endpoint: str) -> None:
    """Merging, re-scaling or disabling the served adapter."""
    raise TrainParityError(
        endpoint,
        f"{_UNMERGED}, and disabling or re-scaling the adapter would serve a "
        "policy the trainer does not run",
        "push the trainer's adapter with /update_weights_from_tensor or "
        "/v1/set_lora (strength 1)",
    )


def check_peft_config(config: dict[str, Any]) -> None:
    """A PEFT adapter loaded from disk: plain LoRA without dropout."""
    problems = [name for name in ("use_rslora", "use_dora") if config.get(name)]
    if config.get("lora_dropout"):
        problems.append(f"lora_dropout={config['lora_dropout']}")
    if problems:
        raise TrainParityError(
            f"a PEFT adapter with {', '.join(problems)}",
            "train_parity reproduces plain PEFT LoRA without dropout",
            "train with use_rslora=False, use_dora=False, lora_dropout=0",
        )
