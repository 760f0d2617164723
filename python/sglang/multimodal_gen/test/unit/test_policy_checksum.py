# SPDX-License-Identifier: Apache-2.0
"""The policy checksum sees every change to a LoRA'd module's forward, and a trainer can
compute the same value from its PEFT model."""

import pytest
import torch
from torch import nn

from sglang.multimodal_gen.runtime.layers.lora.linear import wrap_with_lora_layer
from sglang.multimodal_gen.runtime.loader.weight_utils import compute_weights_checksum
from sglang.multimodal_gen.runtime.post_training.policy_checksum import (
    POLICY_CHECKSUM_FORMAT,
    AdapterState,
    adapter_checksum,
    base_checksum,
    module_policy_checksum,
    policy_checksum,
)

peft = pytest.importorskip("peft")

BF16 = torch.bfloat16
RANK, ALPHA = 4, 8


def _masters(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "proj.weight": torch.randn(16, 8, generator=generator),
        "proj.bias": torch.randn(16, generator=generator),
        "out.weight": torch.randn(8, 16, generator=generator),
        "lora_A": torch.randn(RANK, 8, generator=generator),
        "lora_B": torch.randn(16, RANK, generator=generator),
    }


def _served(masters) -> nn.Module:
    """A module as the engine holds it: bf16 base, `proj` wrapped and holding the adapter."""
    module = nn.Sequential()
    module.add_module("proj", nn.Linear(8, 16, dtype=BF16))
    module.add_module("out", nn.Linear(16, 8, bias=False, dtype=BF16))
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(masters[name])
    module.proj = wrap_with_lora_layer(module.proj)
    module.proj.lora_rank, module.proj.lora_alpha = RANK, ALPHA
    module.proj.set_lora_weights(
        masters["lora_A"].to(BF16),
        masters["lora_B"].to(BF16),
        merge_weights=False,
        clear_existing=True,
    )
    return module


def _checksum(module: nn.Module) -> dict[str, str]:
    return module_policy_checksum(module, module.named_parameters())


def _trainer_checksum(masters) -> dict[str, str]:
    """What a trainer computes from its PEFT model, every tensor as its forward uses it
    (bf16 copies of fp32 masters)."""
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 16))
    model.add_module("out", nn.Linear(16, 8, bias=False))
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["proj"])
    peft.inject_adapter_in_model(config, model)
    with torch.no_grad():
        model.proj.base_layer.weight.copy_(masters["proj.weight"])
        model.proj.base_layer.bias.copy_(masters["proj.bias"])
        model.out.weight.copy_(masters["out.weight"])
        model.proj.lora_A["default"].weight.copy_(masters["lora_A"])
        model.proj.lora_B["default"].weight.copy_(masters["lora_B"])
    base = base_checksum(
        (name.replace(".base_layer.", "."), param.to(BF16))
        for name, param in model.named_parameters()
        if ".lora_" not in name
    )
    adapters = [
        AdapterState(
            name,
            layer.r["default"],
            layer.lora_alpha["default"],
            1.0,
            layer.merged,
            layer.lora_A["default"].weight.to(BF16),
            layer.lora_B["default"].weight.to(BF16),
        )
        for name, layer in model.named_modules()
        if isinstance(layer, peft.tuners.lora.LoraLayer)
    ]
    adapter = adapter_checksum(adapters)
    return {
        "format": POLICY_CHECKSUM_FORMAT,
        "adapter": adapter,
        "base": base,
        "policy": policy_checksum(base, adapter),
    }


def test_a_trainer_computes_the_same_checksum():
    masters = _masters()
    assert _checksum(_served(masters)) == _trainer_checksum(masters)
    assert _checksum(_served(masters)) != _trainer_checksum(_masters(seed=1))


def _set_strength(module):
    module.proj.strength = 0.5


def _disable(module):
    module.proj.disable_lora = True


def _alpha(module):
    module.proj.lora_alpha = ALPHA * 2


def _merge(module):
    module.proj.merge_lora_weights()


@pytest.mark.parametrize("change", [_set_strength, _disable, _alpha, _merge])
def test_every_adapter_change_moves_the_checksum(change):
    """What /v1/merge_lora_weights or /v1/unmerge_lora_weights leave behind in dynamic
    mode (strength, enabled) is invisible to the weights checksum."""
    module = _served(_masters())
    before, weights_before = _checksum(module), compute_weights_checksum(
        module.named_parameters()
    )
    change(module)
    after = _checksum(module)
    assert after["policy"] != before["policy"]
    assert after["base"] == before["base"] or change is _merge
    if change is not _merge:
        assert compute_weights_checksum(module.named_parameters()) == weights_before


def test_adapter_only_skips_the_base():
    module = _served(_masters())
    cheap = module_policy_checksum(module, module.named_parameters(), False)
    assert cheap == {
        "format": POLICY_CHECKSUM_FORMAT,
        "adapter": _checksum(module)["adapter"],
    }
