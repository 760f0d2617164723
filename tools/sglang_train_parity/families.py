# SPDX-License-Identifier: Apache-2.0
"""What the tools need of each DiT family with a train_parity contract, in one record per
served transformer class: the pipeline configs whose contracts the server accepts (declared in
sglang), the diffusers class of the checkpoint's transformer (the trainer's model, or what the
trainer loads its model from: LTX-2's is ltx-core's), the trainer's LoRA targets, how sglang's
modules pair with the trainer's and how the served DiT names the trainer's parameters. A family the
server accepts and the tools do not know is a test failure (tests/test_families.py), and so is
one the parity check does not run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_train_parity import ltx2, qwen_image21, reference, wan

from sglang.multimodal_gen.configs.models.dits import WanVideoConfig
from sglang.multimodal_gen.configs.models.dits.ltx_2 import LTX2_PARAM_NAMES_MAPPING
from sglang.multimodal_gen.configs.pipeline_configs.ltx_2 import LTX2PipelineConfig
from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
    QwenImagePipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.qwen_image21 import (
    QwenImage21PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.wan import (
    Wan2_2_T2V_A14B_Config,
    Wan2_2_TI2V_5B_Config,
    WanT2V480PConfig,
    WanT2V720PConfig,
)
from sglang.multimodal_gen.runtime.utils.train_parity import (
    TrainParityContract,
    train_parity_contract,
)


@dataclass(frozen=True)
class Family:
    name: str
    pipeline_configs: tuple[type, ...]
    diffusers_class: str
    lora_targets: tuple[str, ...]
    # sglang module name -> its diffusers counterpart (how the outputs compare)
    pair_of: Callable[..., reference.ModulePair]
    # diffusers parameter name -> the served DiT's, as sglang's loader renames them (regex
    # rules of the DiT config's `param_names_mapping`); what trainer_policy_checksum takes
    param_names_mapping: dict = field(hash=False)

    @property
    def contracts(self) -> tuple[TrainParityContract, ...]:
        return tuple(train_parity_contract(c) for c in self.pipeline_configs)


FAMILIES = (
    Family(
        name="Qwen-Image",
        pipeline_configs=(QwenImagePipelineConfig,),
        diffusers_class="QwenImageTransformer2DModel",
        lora_targets=reference.LORA_TARGETS,
        pair_of=reference.sglang_to_diffusers,
        # diffusers' names: the loader's text Q/K/V packing applies only where the packed
        # module exists, and the train_parity DiT has none
        param_names_mapping={},
    ),
    Family(
        name="Qwen-Image 2.1 (text-to-image)",
        pipeline_configs=(QwenImage21PipelineConfig,),
        diffusers_class="QwenImage21Transformer2DModel",
        lora_targets=qwen_image21.LORA_TARGETS,
        pair_of=qwen_image21.sglang_to_diffusers,
        # the DiT loads diffusers' names as they are
        param_names_mapping={},
    ),
    Family(
        name="Wan (text-to-video)",
        pipeline_configs=(
            WanT2V480PConfig,
            WanT2V720PConfig,
            Wan2_2_T2V_A14B_Config,
            Wan2_2_TI2V_5B_Config,
        ),
        diffusers_class="WanTransformer3DModel",
        lora_targets=wan.LORA_TARGETS,
        pair_of=wan.sglang_to_diffusers,
        param_names_mapping=WanVideoConfig().arch_config.param_names_mapping,
    ),
    Family(
        name="LTX-2 (text-to-video)",
        pipeline_configs=(LTX2PipelineConfig,),
        diffusers_class="LTX2VideoTransformer3DModel",
        lora_targets=ltx2.LORA_TARGETS,
        pair_of=ltx2.sglang_to_ltx_core,
        param_names_mapping=LTX2_PARAM_NAMES_MAPPING,
    ),
)


def family_of(transformer_class: str) -> Family | None:
    """The family whose trainer model is diffusers' `transformer_class` (the `_class_name`
    of a diffusers-layout model's transformer/config.json)."""
    return next((f for f in FAMILIES if f.diffusers_class == transformer_class), None)
