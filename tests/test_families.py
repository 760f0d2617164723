"""The tools know every family the server accepts under train_parity, and nothing else; the
parity check runs each of them."""

from __future__ import annotations

from sglang_train_parity.check import FAMILY_CHECKS
from sglang_train_parity.families import FAMILIES, family_of

from sglang.multimodal_gen.registry import get_registered_pipeline_config_classes
from sglang.multimodal_gen.runtime.utils.train_parity import train_parity_contract


def test_tools_and_server_agree_on_the_families():
    accepted = {
        cls
        for cls in get_registered_pipeline_config_classes()
        if train_parity_contract(cls) is not None
    }
    assert accepted == {c for family in FAMILIES for c in family.pipeline_configs}
    for family in FAMILIES:
        assert None not in family.contracts
        assert family_of(family.diffusers_class) is family
        assert family.lora_targets and family.pair_of
    assert set(FAMILY_CHECKS) == {family.name for family in FAMILIES}
