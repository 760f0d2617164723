# SPDX-License-Identifier: Apache-2.0
"""What the tools need of each DiT family with a train_parity contract, in one record per
family: the contract itself (declared by the family's pipeline config in sglang), the
diffusers class of the trainer's model, the trainer's LoRA targets, how sglang's modules pair
with diffusers', and the tiny model the tools build to check on. A family the server accepts
and the tools do not know is a test failure (tests/test_families.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sglang_train_parity import reference, tiny_model

from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
    QwenImagePipelineConfig,
)
from sglang.multimodal_gen.runtime.utils.train_parity import (
    TrainParityContract,
    train_parity_contract,
)


@dataclass(frozen=True)
class Family:
    pipeline_config: type
    diffusers_class: str
    lora_targets: tuple[str, ...]
    pairing: dict[str, reference.ModulePair]
    build_tiny: Callable[[Path], Path]

    @property
    def contract(self) -> TrainParityContract:
        return train_parity_contract(self.pipeline_config())


FAMILIES = (
    Family(
        pipeline_config=QwenImagePipelineConfig,
        diffusers_class="QwenImageTransformer2DModel",
        lora_targets=reference.LORA_TARGETS,
        pairing=reference.SGLANG_TO_DIFFUSERS,
        build_tiny=tiny_model.build_tiny_qwen_image,
    ),
)


def family_of(transformer_class: str) -> Family | None:
    """The family whose trainer model is diffusers' `transformer_class` (the `_class_name`
    of a diffusers-layout model's transformer/config.json)."""
    return next((f for f in FAMILIES if f.diffusers_class == transformer_class), None)
