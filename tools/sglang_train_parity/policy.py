# SPDX-License-Identifier: Apache-2.0
"""The trainer's side of ``/get_policy_checksum``: the same checksums, computed from the
trainer's diffusers model with its PEFT adapter.

After each sync a trainer compares them with the engine's::

    from sglang_train_parity.policy import trainer_policy_checksum

    ours = trainer_policy_checksum(transformer, include_base=False)  # each sync
    theirs = requests.post(url + "/get_policy_checksum",
                           json={"module_names": ["transformer"], "include_base": False})
    assert theirs.json()["transformer"] == ours, "the engine serves another adapter"

``include_base=True`` (once, or after base weights change) also compares every base
parameter. Tensors are hashed as the forward uses them: the bf16 copies of fp32 masters
(FSDP2 ``param_dtype=bf16``). Under FSDP2, gather first: the engine hashes whole tensors.

The checksums cover module and parameter names as the served DiT names them. Where sglang's
loader renames diffusers' (Wan: ``blocks.0.attn1.to_q`` is sglang's ``blocks.0.to_q``), pass
its rules, the DiT config's ``arch_config.param_names_mapping``
(``sglang_train_parity.families``: each family's ``param_names_mapping``)::

    from sglang.multimodal_gen.configs.models.dits import WanVideoConfig

    ours = trainer_policy_checksum(
        transformer, param_names_mapping=WanVideoConfig().arch_config.param_names_mapping
    )
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sglang.multimodal_gen.runtime.post_training.policy_checksum import (
    POLICY_CHECKSUM_FORMAT,
    AdapterState,
    adapter_checksum,
    base_checksum,
    module_base_params,
    policy_checksum,
)


def _as_used(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.to(dtype)


def served_names(
    param_names_mapping: Mapping[str, str | tuple] | None,
) -> Callable[[str], str]:
    """diffusers parameter name -> the served DiT's, by sglang's loader rules (None: the
    same). A rule that packs parameters into one (a fused Q/K/V) is refused: the engine
    then hashes the packed tensor, which the trainer does not hold."""
    if not param_names_mapping:
        return lambda name: name
    from sglang.multimodal_gen.runtime.loader.utils import get_param_names_mapping

    mapping = get_param_names_mapping(dict(param_names_mapping))

    def rename(name: str) -> str:
        served, merge_index, _ = mapping(name)
        if merge_index is not None:
            raise ValueError(
                f"{name}: sglang packs it into {served}; the checksum of a packed "
                "parameter cannot be computed from the trainer's"
            )
        return served

    return rename


def trainer_adapters(
    model: nn.Module,
    adapter: str = "default",
    dtype: torch.dtype = torch.bfloat16,
    param_names_mapping: Mapping[str, str | tuple] | None = None,
) -> list[AdapterState]:
    """The PEFT adapter ``adapter`` of every LoRA layer of ``model``, strength 1, by the
    served DiT's module names (`served_names`)."""
    from peft.tuners.lora import LoraLayer

    rename = served_names(param_names_mapping)
    return [
        AdapterState(
            # the rules rename parameters: a module is renamed as its weight is
            rename(f"{name}.weight").removesuffix(".weight"),
            layer.r[adapter],
            layer.lora_alpha[adapter],
            1.0,
            adapter in layer.merged_adapters,
            _as_used(layer.lora_A[adapter].weight, dtype),
            _as_used(layer.lora_B[adapter].weight, dtype),
        )
        for name, layer in model.named_modules()
        if isinstance(layer, LoraLayer) and adapter in layer.lora_A
    ]


def trainer_policy_checksum(
    model: nn.Module,
    adapter: str = "default",
    dtype: torch.dtype = torch.bfloat16,
    include_base: bool = True,
    param_names_mapping: Mapping[str, str | tuple] | None = None,
) -> dict[str, str]:
    """What ``/get_policy_checksum`` reports for a DiT serving ``model``'s policy;
    ``param_names_mapping``: how the served DiT renames ``model``'s parameters (module
    docstring)."""
    result = {
        "format": POLICY_CHECKSUM_FORMAT,
        "adapter": adapter_checksum(
            trainer_adapters(model, adapter, dtype, param_names_mapping)
        ),
    }
    if include_base:
        rename = served_names(param_names_mapping)
        result["base"] = base_checksum(
            (rename(name), _as_used(param, dtype))
            for name, param in module_base_params(model.named_parameters())
            if ".lora_" not in name
        )
        result["policy"] = policy_checksum(result["base"], result["adapter"])
    return result
