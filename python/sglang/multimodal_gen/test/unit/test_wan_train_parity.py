# SPDX-License-Identifier: Apache-2.0
"""Wan under --numerics train_parity: the variants' contracts, the DiT built for it,
and its forward against diffusers' WanTransformer3DModel in the trainer's dtypes."""

import re
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from diffusers.models.transformers.transformer_wan import (
    WanTransformer3DModel as DiffusersWanTransformer3DModel,
)

from sglang.multimodal_gen.configs.models.dits.wanvideo import WanVideoConfig
from sglang.multimodal_gen.configs.pipeline_configs.wan import (
    FastWan2_1_T2V_480P_Config,
    TurboWanT2V480PConfig,
    Wan2_2_I2V_A14B_Config,
    Wan2_2_T2V_A14B_Config,
    Wan2_2_TI2V_5B_Config,
    WanI2V480PConfig,
    WanT2V480PConfig,
    WanT2V720PConfig,
)
from sglang.multimodal_gen.runtime.layers import train_parity_ops
from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
from sglang.multimodal_gen.runtime.models.dits import wanvideo
from sglang.multimodal_gen.runtime.utils import train_parity

BF16 = torch.bfloat16
COVERED = (
    WanT2V480PConfig,
    WanT2V720PConfig,
    Wan2_2_T2V_A14B_Config,
    Wan2_2_TI2V_5B_Config,
)
HF_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=24,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=96,
    num_layers=2,
)

pytestmark = pytest.mark.usefixtures("single_process_model_parallel")


def test_text_to_video_variants_opt_in_and_the_rest_are_refused():
    for config_cls in COVERED:
        assert train_parity.train_parity_contract(config_cls).dit == (
            "WanTransformer3DModel"
        )
    # the A14B pipeline guides its low-noise expert with guidance_scale_2
    assert Wan2_2_T2V_A14B_Config.train_parity_contract.cfg_scale_fields == (
        "guidance_scale",
        "guidance_scale_2",
    )
    assert WanT2V480PConfig.train_parity_contract.cfg_scale_fields == (
        "guidance_scale",
    )
    refused = (
        WanI2V480PConfig,
        Wan2_2_I2V_A14B_Config,
        TurboWanT2V480PConfig,
        FastWan2_1_T2V_480P_Config,
    )
    for config_cls in refused:
        assert train_parity.train_parity_contract(config_cls) is None
    args = SimpleNamespace(
        model_path="FastVideo/FastWan2.1-T2V-1.3B-Diffusers",
        pipeline_config=FastWan2_1_T2V_480P_Config(),
    )
    with pytest.raises(train_parity.TrainParityError) as refusal:
        train_parity.require_contract(args)
    assert "FastWan2_1_T2V_480P_Config" in str(refusal.value)
    assert "Wan2.1 T2V 1.3B (WanT2V480PConfig), not this variant" in str(refusal.value)


def test_every_other_registered_wan_variant_is_refused_by_name():
    from sglang.multimodal_gen.registry import get_registered_pipeline_config_classes

    wan_configs = [
        cls
        for cls in get_registered_pipeline_config_classes()
        if cls.__module__ == WanT2V480PConfig.__module__
    ]
    refused = [cls for cls in wan_configs if cls not in COVERED]
    assert len(refused) >= 8  # image-to-video, distilled, animate
    for config_cls in refused:
        args = SimpleNamespace(model_path="a/wan", pipeline_config=config_cls())
        with pytest.raises(train_parity.TrainParityError) as refusal:
            train_parity.require_contract(args)
        message = str(refusal.value)
        assert f"(pipeline {config_cls.__name__})" in message
        assert "not this variant" in message
        for covered in COVERED:
            assert train_parity.train_parity_contract(covered).family in message


def _tiny_dits(numerics: str):
    """diffusers' DiT with bf16 random weights, and sglang's holding the same."""
    torch.manual_seed(0)
    reference = DiffusersWanTransformer3DModel(**HF_CONFIG)
    for param in reference.parameters():
        param.data = torch.randn_like(param).mul(0.1).to(BF16)
    config = WanVideoConfig()
    config.update_model_arch(dict(HF_CONFIG))
    server_args = SimpleNamespace(attention_backend="torch_sdpa")
    with (
        patch.object(wanvideo, "get_global_server_args", return_value=server_args),
        train_parity.numerics_mode_context(numerics),
    ):
        dit = wanvideo.WanTransformer3DModel(config, dict(HF_CONFIG)).to(BF16)
    mapping = config.arch_config.param_names_mapping
    params = dict(dit.named_parameters())
    for name, tensor in reference.state_dict().items():
        for pattern, target in mapping.items():
            if re.match(pattern, name):
                name = re.sub(pattern, target, name)
                break
        params.pop(name).data = tensor.clone()
    assert not params, f"parameters diffusers does not have: {sorted(params)}"
    return reference, dit.eval()


def test_the_contract_lists_every_op_the_dit_builds():
    _, dit = _tiny_dits("train_parity")
    contract = WanT2V480PConfig.train_parity_contract
    train_parity.check_dit_ops(contract, dit)
    built = {type(m).__name__ for m in dit.modules() if isinstance(m, CustomOp)}
    assert built == set(contract.ops) | set(contract.parameter_only_ops)


@pytest.mark.parametrize("timesteps", ["per sample", "per token"])
@pytest.mark.parametrize("rms_norm_in_fp32", [False, True])
def test_dit_matches_diffusers(timesteps, rms_norm_in_fp32, monkeypatch):
    """diffusers run in bf16 outside autocast computes what CUDA autocast does
    for this model in torch 2.11, where rms_norm keeps the input dtype; the
    fp32 rms_norm of later autocasts differs (the control)."""
    reference, dit = _tiny_dits("train_parity")
    monkeypatch.setattr(train_parity_ops, "AUTOCAST_RMS_NORM_IN_FP32", rms_norm_in_fp32)
    generator = torch.Generator().manual_seed(1)
    batch, frames, height, width = 2, 3, 6, 8
    latents = torch.randn(batch, 16, frames, height, width, generator=generator)
    text = torch.randn(batch, 12, 32, generator=generator).to(BF16)
    if timesteps == "per sample":
        timestep = torch.tensor([999.0, 437.5])
    else:
        tokens = frames * (height // 2) * (width // 2)
        timestep = torch.rand(batch, tokens, generator=generator) * 1000
    inputs = dict(
        hidden_states=latents.to(BF16),
        encoder_hidden_states=text,
        timestep=timestep,
    )
    with torch.no_grad():
        (expected,) = reference(**inputs, return_dict=False)
        with set_forward_context(0, None, forward_batch=None):
            actual = dit(**inputs)
    assert torch.equal(actual, expected) == (not rms_norm_in_fp32)


def test_fp32_text_is_taken_in_the_transformer_dtype(monkeypatch):
    """The T5 encoder runs in fp32 and the stage does not autocast the DiT under
    train_parity: the DiT takes the text in its own dtype, as diffusers'
    WanPipeline hands it to its transformer."""
    reference, dit = _tiny_dits("train_parity")
    monkeypatch.setattr(train_parity_ops, "AUTOCAST_RMS_NORM_IN_FP32", False)
    generator = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 16, 3, 6, 8, generator=generator).to(BF16)
    text = torch.randn(1, 12, 32, generator=generator)
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        (expected,) = reference(
            hidden_states=latents,
            encoder_hidden_states=text.to(BF16),
            timestep=timestep,
            return_dict=False,
        )
        with set_forward_context(0, None, forward_batch=None):
            actual = dit(
                hidden_states=latents, encoder_hidden_states=text, timestep=timestep
            )
    assert torch.equal(actual, expected)


def test_rms_norm_variant_follows_torch():
    fp32_from = torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)
    assert train_parity_ops.AUTOCAST_RMS_NORM_IN_FP32 == fp32_from
    x, weight = torch.randn(3, 64).to(BF16), torch.randn(64).to(BF16)
    normed = train_parity_ops.torch_rms_norm(x, weight, 1e-6)
    assert normed.dtype == (torch.float32 if fp32_from else BF16)


def test_gated_residual_rounds_by_the_gate_dtype():
    generator = torch.Generator().manual_seed(0)
    residual, x = (torch.randn(2, 8, 64, generator=generator).to(BF16) for _ in "rx")
    gate = torch.randn(2, 1, 64, generator=generator)
    bf16_gate = train_parity_ops.gated_residual(residual, gate.to(BF16), x)
    assert torch.equal(bf16_gate, residual + gate.to(BF16) * x)
    fp32_gate = train_parity_ops.gated_residual(residual, gate, x)
    assert fp32_gate.dtype == BF16
    assert torch.equal(fp32_gate, (residual.float() + x * gate).type_as(residual))
    assert not torch.equal(fp32_gate, residual + (gate * x).to(BF16))
