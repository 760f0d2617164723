# SPDX-License-Identifier: Apache-2.0
"""LoRA under --numerics train_parity: PEFT's unmerged forward, and one set of rules for the
adapter at every entry point (layer, pipeline, server args), with tensor parallelism too."""

from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from torch import nn

from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
    QwenImagePipelineConfig,
)
from sglang.multimodal_gen.runtime.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.runtime.layers.lora import linear as lora_linear
from sglang.multimodal_gen.runtime.layers.lora.linear import wrap_with_lora_layer
from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import LoRAPipeline
from sglang.multimodal_gen.runtime.utils import train_parity_lora
from sglang.multimodal_gen.runtime.utils.train_parity import (
    TrainParityError,
    numerics_mode_context,
)

peft = pytest.importorskip("peft")

BF16 = torch.bfloat16
IN, OUT, RANK = 64, 48, 4
# alpha / rank = 0.75: not a power of two, so where the scaling rounds matters
ALPHA = 3

pytestmark = pytest.mark.usefixtures("single_process_model_parallel")


@pytest.fixture
def masters():
    generator = torch.Generator().manual_seed(0)
    return SimpleNamespace(
        weight=torch.randn(OUT, IN, generator=generator) / 8,
        bias=torch.randn(OUT, generator=generator),
        lora_A=torch.randn(RANK, IN, generator=generator) / 8,
        lora_B=torch.randn(OUT, RANK, generator=generator),
    )


def _lora_layer(kind: type, masters, numerics: str = "train_parity") -> nn.Module:
    with numerics_mode_context(numerics):
        base = kind(IN, OUT, bias=True, params_dtype=BF16)
        base.weight.data.copy_(masters.weight)
        base.bias.data.copy_(masters.bias)
        layer = wrap_with_lora_layer(base)
    layer.lora_rank, layer.lora_alpha = RANK, ALPHA
    return layer


def _peft_reference(masters) -> nn.Module:
    """PEFT's lora.Linear over fp32 masters, every parameter then rounded to bf16 (what
    FSDP2 with param_dtype=bf16 hands the trainer's forward)."""
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(IN, OUT))
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["proj"])
    peft.inject_adapter_in_model(config, model)
    with torch.no_grad():
        model.proj.base_layer.weight.copy_(masters.weight)
        model.proj.base_layer.bias.copy_(masters.bias)
        model.proj.lora_A["default"].weight.copy_(masters.lora_A)
        model.proj.lora_B["default"].weight.copy_(masters.lora_B)
    return model.to(BF16).eval()


@pytest.mark.parametrize(
    "kind", [ColumnParallelLinear, RowParallelLinear, ReplicatedLinear]
)
def test_forward_is_pefts_unmerged_forward(kind, masters):
    layer = _lora_layer(kind, masters)
    layer.set_lora_weights(masters.lora_A, masters.lora_B, merge_weights=False)
    assert layer.peft_forward and layer.lora_A.dtype == layer.lora_B.dtype == BF16
    x = torch.randn(2, 13, IN).to(BF16)
    with torch.no_grad():
        out, bias = layer(x)
        expected = _peft_reference(masters)(x)
    assert bias is None and torch.equal(out, expected)
    # control: the update from the fp32 adapter, added in fp32 and rounded once
    base = nn.functional.linear(x, masters.weight.to(BF16), masters.bias.to(BF16))
    delta = (x.float() @ masters.lora_A.T @ masters.lora_B.T) * (ALPHA / RANK)
    assert not torch.equal((base.float() + delta).to(BF16), expected)


def test_the_factors_are_held_where_the_base_weight_is(masters):
    """An update arrives as host tensors; the layer keeps bf16 copies on the
    base weight's device (here meta, standing in for the GPU), so that no
    forward copies them there."""
    layer = _lora_layer(ReplicatedLinear, masters)
    layer.base_layer.to("meta")
    layer.set_lora_weights(masters.lora_A, masters.lora_B, merge_weights=False)
    for factor in (layer.lora_A, layer.lora_B):
        assert factor.is_meta and factor.dtype == BF16


def test_forward_gelu_tanh_is_the_gelu_of_the_forward(masters):
    layer = _lora_layer(ReplicatedLinear, masters)
    layer.set_lora_weights(masters.lora_A, masters.lora_B, merge_weights=False)
    x = torch.randn(2, 13, IN).to(BF16)
    with torch.no_grad():
        outs = []
        for disable_lora in (False, True):
            layer.disable_lora = disable_lora
            expected = nn.functional.gelu(layer(x)[0], approximate="tanh")
            outs.append(layer.forward_gelu_tanh(x))
            assert torch.equal(outs[-1], expected)
    assert not torch.equal(*outs)


REFUSED = {
    "merged LoRA weights": dict(merge_weights=True),
    "LoRA strength 0.5": dict(strength=0.5),
    "a LoRA output offset": dict(output_offset=torch.zeros(OUT)),
    "stacked (3-D) LoRA A/B": dict(
        A=torch.zeros(2, RANK, IN), B=torch.zeros(2, OUT, RANK)
    ),
    "several LoRA adapters at once": dict(clear_existing=False),
}


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("option", sorted(REFUSED))
def test_layer_refuses_what_peft_does_not_run(option, tp_size, masters):
    """With tensor parallelism the forward is not bitwise; the adapter rules stay."""
    with patch.object(lora_linear, "get_tp_world_size", return_value=tp_size):
        layer = _lora_layer(ColumnParallelLinear, masters)
    assert layer.train_parity and layer.peft_forward == (tp_size == 1)
    kwargs = dict(
        A=masters.lora_A, B=masters.lora_B, merge_weights=False, clear_existing=True
    )
    layer.set_lora_weights(**kwargs)
    with pytest.raises(TrainParityError) as refused:
        layer.set_lora_weights(**{**kwargs, **REFUSED[option]})
    assert f"does not support {option}: " in str(refused.value)
    # the default mode takes them
    default = _lora_layer(ColumnParallelLinear, masters, numerics="default")
    default.set_lora_weights(**{**kwargs, "strength": 0.5})


def test_runtime_lora_scale_is_refused(masters):
    layer = _lora_layer(ColumnParallelLinear, masters)
    layer.set_lora_weights(masters.lora_A, masters.lora_B, merge_weights=False)
    request = SimpleNamespace(runtime_lora_scale=0.5)
    with set_forward_context(
        current_timestep=0, attn_metadata=None, forward_batch=request
    ):
        with pytest.raises(TrainParityError, match="runtime LoRA scale 0.5"):
            layer(torch.randn(1, 7, IN).to(BF16))


class _TestLoRAPipeline(LoRAPipeline):
    def create_pipeline_stages(self, server_args):
        pass


def _pipeline(numerics: str) -> LoRAPipeline:
    pipeline = object.__new__(_TestLoRAPipeline)
    dit = nn.Module()
    dit.numerics = numerics
    pipeline.modules = {"transformer": dit}
    pipeline.server_args = SimpleNamespace(lora_merge_mode="dynamic")
    pipeline._invalidate_lora_conditioning = lambda: None
    return pipeline


@pytest.mark.parametrize(
    "request_kwargs, option",
    [
        (dict(strength=0.5), "LoRA strength 0.5"),
        (dict(merge_mode="merge"), "merged LoRA weights"),
        (dict(merge_mode="auto"), "merged LoRA weights"),
        (
            dict(lora_nickname=["a", "b"], lora_path=["/a", "/b"]),
            "several LoRA adapters at once",
        ),
    ],
)
def test_set_lora_refuses_before_loading(request_kwargs, option):
    pipeline = _pipeline("train_parity")
    kwargs = {"lora_nickname": "a", "lora_path": "/a", **request_kwargs}
    with pytest.raises(TrainParityError, match=f"does not support {option}: "):
        pipeline.set_lora(**kwargs)
    assert not hasattr(pipeline, "lora_adapters")  # nothing was loaded


@pytest.mark.parametrize("endpoint", ["merge_lora_weights", "unmerge_lora_weights"])
def test_merge_and_unmerge_are_refused(endpoint):
    with pytest.raises(TrainParityError, match=f"does not support /{endpoint}: "):
        getattr(_pipeline("train_parity"), endpoint)()
    pipeline = _pipeline("default")
    pipeline._get_target_lora_layers = lambda target: ([], None)
    getattr(pipeline, endpoint)()  # the default mode: nothing to do, no error


@pytest.mark.parametrize(
    "setting, problem",
    [
        ({"use_rslora": True}, "use_rslora"),
        ({"use_dora": True}, "use_dora"),
        ({"lora_dropout": 0.05}, "lora_dropout=0.05"),
    ],
)
def test_peft_configs_beyond_plain_lora_are_refused(setting, problem):
    with pytest.raises(TrainParityError, match=problem):
        train_parity_lora.check_peft_config({"r": 4, "lora_alpha": 8, **setting})
    train_parity_lora.check_peft_config({"r": 4, "lora_alpha": 8, "lora_dropout": 0.0})


def test_startup_lora_scale_is_refused(server_args_for):
    with pytest.raises(TrainParityError, match="does not support --lora-scale 0.5: "):
        server_args_for(
            QwenImagePipelineConfig(), numerics="train_parity", lora_scale=0.5
        )
    server_args_for(QwenImagePipelineConfig(), lora_scale=0.5)
