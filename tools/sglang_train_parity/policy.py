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
"""

from __future__ import annotations

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


def trainer_adapters(
    model: nn.Module, adapter: str = "default", dtype: torch.dtype = torch.bfloat16
) -> list[AdapterState]:
    """The PEFT adapter ``adapter`` of every LoRA layer of ``model``, strength 1."""
    from peft.tuners.lora import LoraLayer

    return [
        AdapterState(
            name,
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
) -> dict[str, str]:
    """What ``/get_policy_checksum`` reports for a DiT serving ``model``'s policy."""
    result = {
        "format": POLICY_CHECKSUM_FORMAT,
        "adapter": adapter_checksum(trainer_adapters(model, adapter, dtype)),
    }
    if include_base:
        result["base"] = base_checksum(
            (name, _as_used(param, dtype))
            for name, param in module_base_params(model.named_parameters())
            if ".lora_" not in name
        )
        result["policy"] = policy_checksum(result["base"], result["adapter"])
    return result
