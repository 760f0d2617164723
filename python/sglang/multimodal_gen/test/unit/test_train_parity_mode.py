# SPDX-License-Identifier: Apache-2.0
"""--numerics: the switch, construction-scoped dispatch, and which models accept train_parity."""

from unittest.mock import patch

import pytest
import torch

from sglang.multimodal_gen.configs.pipeline_configs.base import PipelineConfig
from sglang.multimodal_gen.registry import get_registered_pipeline_config_classes
from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
from sglang.multimodal_gen.runtime.models.registry import ModelRegistry
from sglang.multimodal_gen.runtime.utils import train_parity
from sglang.multimodal_gen.runtime.utils.train_parity import (
    TrainParityContract,
    TrainParityError,
)


def test_cli_takes_the_numerics_modes(parse_server_args):
    assert parse_server_args([]).numerics == "default"
    assert parse_server_args(["--numerics", "train_parity"]).numerics == "train_parity"
    with pytest.raises(SystemExit):
        parse_server_args(["--numerics", "bitwise"])


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="numerics must be one of"):
        train_parity.check_numerics_mode("bitwise")
    with pytest.raises(ValueError, match="numerics must be one of"):
        with train_parity.numerics_mode_context("fast"):
            pass


def _registered_families() -> list[type]:
    return get_registered_pipeline_config_classes()


def test_registry_lists_the_families():
    families = _registered_families()
    assert len(families) > 20
    assert all(issubclass(cls, PipelineConfig) for cls in families)


@pytest.mark.parametrize("config_cls", _registered_families(), ids=lambda c: c.__name__)
def test_every_family_opts_in_or_is_refused_at_startup(config_cls, server_args_for):
    contract = train_parity.train_parity_contract(config_cls())
    if contract is not None:
        assert server_args_for(config_cls(), numerics="train_parity").numerics == (
            "train_parity"
        )
        return
    with pytest.raises(TrainParityError) as refused:
        server_args_for(config_cls(), numerics="train_parity")
    message = str(refused.value)
    assert message.startswith("--numerics train_parity does not support the model")
    assert config_cls.__name__ in message and "serve a supported family" in message


def test_the_default_mode_is_unchanged(server_args_for):
    from sglang.multimodal_gen.configs.pipeline_configs.flux import FluxPipelineConfig

    assert server_args_for(FluxPipelineConfig()).numerics == "default"


def test_an_opted_in_family_is_served_and_named(server_args_for):
    class Family(PipelineConfig):
        train_parity_contract = TrainParityContract(
            "F", "the F trainer", "FDiT", (), pixels_per_patch=1
        )

    with patch.object(train_parity.logger, "info") as info:
        assert server_args_for(Family(), numerics="train_parity").numerics == (
            "train_parity"
        )
    info.assert_any_call(
        "--numerics train_parity: %s, bitwise equal to %s", "F", "the F trainer"
    )


def test_contracts_are_not_inherited():
    class Family(PipelineConfig):
        train_parity_contract = TrainParityContract(
            "F", "ref", "FDiT", (), pixels_per_patch=1
        )

    class Variant(Family):
        pass

    assert train_parity.train_parity_contract(Family()) is not None
    assert train_parity.train_parity_contract(Family) is not None
    assert train_parity.train_parity_contract(Variant()) is None
    assert train_parity.train_parity_contract(Variant) is None


def _dit_classes() -> dict[str, type]:
    return {
        name: ModelRegistry.resolve_model_cls(name)[0]
        for name, entry in ModelRegistry.registered_models.items()
        if ".models.dits." in entry.module_name
    }


def test_every_dit_class_opts_in_or_is_refused_by_the_loader():
    """The loader's check: a DiT class that no contract names is refused before it is built."""
    contracts = [
        contract
        for cls in _registered_families()
        if (contract := train_parity.train_parity_contract(cls())) is not None
    ]
    contracts.append(
        TrainParityContract("Other", "ref", "AnUnregisteredDiT", (), pixels_per_patch=1)
    )
    dits = _dit_classes()
    assert "QwenImageTransformer2DModel" in dits and len(dits) > 40
    for dit_cls in dits.values():
        for contract in contracts:
            if contract.dit == dit_cls.__name__:
                train_parity.check_dit_class(contract, dit_cls)
            else:
                with pytest.raises(TrainParityError, match=dit_cls.__name__):
                    train_parity.check_dit_class(contract, dit_cls)


class _WithTrainParity(CustomOp):
    def forward_native(self):
        return "native"

    def forward_train_parity(self):
        return "train_parity"


class _WithoutTrainParity(CustomOp):
    def forward_native(self):
        return "native"


def test_custom_op_dispatch_is_chosen_at_construction():
    assert _WithTrainParity()() == "native"
    with train_parity.numerics_mode_context("train_parity"):
        assert train_parity.get_numerics_mode() == "train_parity"
        built_in_mode = _WithTrainParity()
        without = _WithoutTrainParity()
    assert train_parity.get_numerics_mode() == "default"
    assert built_in_mode() == "train_parity"
    with pytest.raises(TrainParityError, match="calling _WithoutTrainParity"):
        without()  # never another forward
    assert _WithoutTrainParity()() == "native"


def test_loader_refuses_ops_the_contract_does_not_cover():
    contract = TrainParityContract(
        "Toy",
        "ref",
        "Toy",
        ("_WithTrainParity", "_WithoutTrainParity"),
        pixels_per_patch=1,
    )
    dit = torch.nn.Sequential(_WithTrainParity())
    train_parity.check_dit_ops(contract, dit)

    dit.append(_WithoutTrainParity())  # listed, but has no train_parity forward
    with pytest.raises(TrainParityError, match="ops _WithoutTrainParity"):
        train_parity.check_dit_ops(contract, dit)

    unlisted = TrainParityContract("Toy", "ref", "Toy", (), pixels_per_patch=1)
    with pytest.raises(TrainParityError, match="ops _WithTrainParity"):
        train_parity.check_dit_ops(unlisted, torch.nn.Sequential(_WithTrainParity()))

    # held for its parameters only: accepted, and calling it raises
    holder = TrainParityContract(
        "Toy", "ref", "Toy", (), ("_WithoutTrainParity",), pixels_per_patch=1
    )
    train_parity.check_dit_ops(holder, torch.nn.Sequential(_WithoutTrainParity()))
