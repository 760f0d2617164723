# SPDX-License-Identifier: Apache-2.0
"""Qwen-Image under --numerics train_parity: the family's contract, the DiT built for it, and
its attention against diffusers' QwenDoubleStreamAttnProcessor2_0."""

from unittest.mock import patch

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenImageTransformerBlock,
)

from sglang.multimodal_gen.configs.models.dits.qwenimage import QwenImageDitConfig
from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
    QwenImageEditPipelineConfig,
    QwenImageLayeredPipelineConfig,
    QwenImagePipelineConfig,
)
from sglang.multimodal_gen.runtime.layers import train_parity_ops
from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
from sglang.multimodal_gen.runtime.layers.rotary_embedding.utils import (
    _apply_rotary_emb,
)
from sglang.multimodal_gen.runtime.models.dits import qwen_image
from sglang.multimodal_gen.runtime.models.dits.qwen_image import (
    QwenImageCrossAttention,
    QwenImageTransformer2DModel,
)
from sglang.multimodal_gen.runtime.platforms.interface import DeviceCapability
from sglang.multimodal_gen.runtime.utils import train_parity

BF16 = torch.bfloat16
HEADS, HEAD_DIM = 2, 128
DIM = HEADS * HEAD_DIM
CONTRACT = QwenImagePipelineConfig.train_parity_contract

pytestmark = pytest.mark.usefixtures("single_process_model_parallel")


def _tiny_dit(
    numerics: str, rope_tables: str = "device"
) -> QwenImageTransformer2DModel:
    config = QwenImageDitConfig()
    hf_config = dict(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        joint_attention_dim=64,
        axes_dims_rope=(16, 56, 56),
    )
    config.update_model_arch(hf_config)
    with train_parity.numerics_mode_context(numerics, rope_tables):
        return QwenImageTransformer2DModel(config, hf_config)


def test_only_text_to_image_qwen_opts_in():
    assert CONTRACT.dit == "QwenImageTransformer2DModel"
    for variant in (QwenImageEditPipelineConfig, QwenImageLayeredPipelineConfig):
        assert train_parity.train_parity_contract(variant()) is None
    families = train_parity.supported_families().split(", ")
    assert "Qwen-Image (QwenImagePipelineConfig)" in families
    assert not [f for f in families if "QwenImageEdit" in f or "Layered" in f]


def test_the_contract_lists_every_op_the_dit_builds():
    dit = _tiny_dit("train_parity")
    train_parity.check_dit_ops(CONTRACT, dit)
    built = {type(m).__name__ for m in dit.modules() if isinstance(m, CustomOp)}
    assert built == set(CONTRACT.ops) | set(CONTRACT.parameter_only_ops)


def test_train_parity_unpacks_the_text_projections():
    attn = _tiny_dit("train_parity").transformer_blocks[0].attn
    assert {"add_q_proj", "add_k_proj", "add_v_proj"} <= set(
        dict(attn.named_children())
    )
    assert not hasattr(attn, "to_added_qkv")
    assert hasattr(_tiny_dit("default").transformer_blocks[0].attn, "to_added_qkv")


@pytest.mark.parametrize("rope_tables", train_parity.ROPE_TABLE_DEVICES)
def test_rope_tables_are_built_where_the_loader_says(rope_tables):
    assert _tiny_dit("train_parity", rope_tables).rotary_emb.table_device == rope_tables
    assert _tiny_dit("default", rope_tables).rotary_emb.table_device is None


@pytest.mark.parametrize(
    "numerics, expected", [("train_parity", False), ("default", True)]
)
def test_fused_qkv_epilogue_stays_off_under_train_parity_on_sm90(
    numerics, expected, monkeypatch
):
    platform = qwen_image.current_platform
    monkeypatch.setattr(qwen_image.envs, "SGLANG_ENABLE_FUSED_QKNORM_ROPE", True)
    with (
        patch.object(platform, "is_cuda", return_value=True),
        patch.object(
            platform, "get_device_capability", return_value=DeviceCapability(9, 0)
        ),
        train_parity.numerics_mode_context(numerics),
    ):
        attn = QwenImageCrossAttention(
            dim=DIM, num_heads=HEADS, head_dim=HEAD_DIM, added_kv_proj_dim=DIM
        )
    assert attn.use_fused_qkv_epilogue is expected


def _random_freqs(seq: int) -> torch.Tensor:
    angles = torch.randn(seq, HEAD_DIM // 2) * 10
    return torch.polar(torch.ones_like(angles), angles)


def _real_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The cos/sin formula of the default path, on the same table."""
    batch = x.shape[0]
    cos, sin = freqs.real.repeat(batch, 1), freqs.imag.repeat(batch, 1)
    out = _apply_rotary_emb(x.flatten(0, 1), cos, sin, False, interleaved=True)
    return out.unflatten(0, x.shape[:2])


@pytest.mark.parametrize("rope", ["complex", "real (control)"])
def test_attention_matches_diffusers_processor(rope, monkeypatch):
    """All-bf16 inputs and parameters: no op of the processor depends on autocast, so
    diffusers run as is is the training forward here."""
    torch.manual_seed(0)
    reference = QwenImageTransformerBlock(DIM, HEADS, HEAD_DIM).attn.to(BF16)
    for param in reference.parameters():
        param.data.normal_(0, 0.05)
    with train_parity.numerics_mode_context("train_parity"):
        attn = QwenImageCrossAttention(
            dim=DIM, num_heads=HEADS, head_dim=HEAD_DIM, added_kv_proj_dim=DIM
        ).to(BF16)
    missing, unexpected = attn.load_state_dict(reference.state_dict(), strict=False)
    assert not [name for name in missing if "norm" in name or "proj" in name]
    assert not unexpected
    if rope != "complex":
        monkeypatch.setattr(train_parity_ops, "rotary_emb", _real_rope)

    batch, img_len, txt_len = 2, 12, 7
    image = torch.randn(batch, img_len, DIM).to(BF16)
    text = torch.randn(batch, txt_len, DIM).to(BF16)
    freqs = (_random_freqs(img_len), _random_freqs(txt_len))
    with torch.no_grad():
        img_out, txt_out = reference(
            hidden_states=image, encoder_hidden_states=text, image_rotary_emb=freqs
        )
        img_attn, txt_attn, img_bias, txt_bias = attn(
            image, text, None, freqs_complex=freqs
        )
    assert img_bias is None and txt_bias is None
    equal = torch.equal(img_attn, img_out) and torch.equal(txt_attn, txt_out)
    assert equal == (rope == "complex")
