# SPDX-License-Identifier: Apache-2.0
"""Qwen-Image 2.1 under --numerics train_parity: the family's contract, the DiT
built for it, its attention against diffusers' QwenImage21AttnProcessor, and the
whole forward against diffusers under CUDA autocast (on a GPU)."""

from types import SimpleNamespace

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Attention as DiffusersQwenImage21Attention,
)
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Transformer2DModel as DiffusersQwenImage21Transformer2DModel,
)

from sglang.multimodal_gen.configs.models.dits.qwenimage21 import (
    QwenImage21ArchConfig,
    QwenImage21DitConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.qwen_image21 import (
    QwenImage21PipelineConfig,
)
from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
from sglang.multimodal_gen.runtime.models.dits.qwen_image21 import (
    QwenImage21Attention,
    QwenImage21Transformer2DModel,
    build_layout,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.qwen_image21 import (
    QwenImage21EncodingStage,
)
from sglang.multimodal_gen.runtime.utils import train_parity

BF16 = torch.bfloat16
CONTRACT = QwenImage21PipelineConfig.train_parity_contract
HF_CONFIG = dict(
    in_channels=16,
    out_channels=16,
    num_layers=2,
    num_attention_heads=2,
    attention_head_dim=32,
    context_in_dim=24,
    mlp_ratio=3,
    axes_dims_rope=(8, 12, 12),
)
HEIGHT, WIDTH = 4, 6

pytestmark = pytest.mark.usefixtures("single_process_model_parallel")


def _tiny_dit(numerics: str, rope_tables: str = "device"):
    config = QwenImage21DitConfig(arch_config=QwenImage21ArchConfig(**HF_CONFIG))
    with train_parity.numerics_mode_context(numerics, rope_tables):
        return QwenImage21Transformer2DModel(config, {})


def test_the_contract_covers_the_dit_and_asks_for_true_cfg_scale():
    assert CONTRACT.dit == "QwenImage21Transformer2DModel"
    assert CONTRACT.cfg_scale_fields == ("true_cfg_scale",)
    train_parity.check_dit_ops(CONTRACT, _tiny_dit("train_parity"))


@pytest.mark.parametrize("rope_tables", train_parity.ROPE_TABLE_DEVICES)
def test_frequency_tables_are_built_where_the_trainer_builds_them(rope_tables):
    dit = _tiny_dit("train_parity", rope_tables)
    # diffusers builds the timestep frequencies on the CPU in __init__
    assert dit.time_text_embed.table_device == "cpu"
    assert dit.rope_table_device == ("cpu" if rope_tables == "cpu" else None)
    default = _tiny_dit("default", rope_tables)
    assert default.time_text_embed.table_device is None
    assert default.rope_table_device is None


def test_rope_tables_are_diffusers_tables():
    reference = DiffusersQwenImage21Transformer2DModel(**HF_CONFIG).pos_embed
    tables = _tiny_dit("train_parity", "cpu").rope_tables(torch.device("cpu"))
    assert all(
        torch.equal(ours, theirs) for ours, theirs in zip(tables, reference.freqs)
    )


def _random_rope(seq: int) -> torch.Tensor:
    angles = torch.randn(seq, 16) * 10
    return torch.polar(torch.ones_like(angles), angles)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("text_mask", ["causal", "bidirectional (control)"])
def test_attention_matches_diffusers_processor(padded, text_mask):
    """All-bf16 inputs and parameters: no op of the processor depends on
    autocast, so diffusers run as is is the training forward here."""
    torch.manual_seed(0)
    reference = DiffusersQwenImage21Attention(dim=64, heads=2, dim_head=32).to(BF16)
    for param in reference.parameters():
        param.data.normal_(0, 0.05)
    config = QwenImage21ArchConfig(**HF_CONFIG)
    with train_parity.numerics_mode_context("train_parity"):
        attn = QwenImage21Attention(config, None, "attn").to(BF16)
    missing, unexpected = attn.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and not unexpected

    batch, text_len, image_len = 2, 5, 12
    x = torch.randn(batch, text_len + image_len, 64).to(BF16)
    rope = _random_rope(text_len + image_len)
    key_valid = None
    if padded:
        key_valid = torch.ones(batch, text_len + image_len, dtype=torch.bool)
        key_valid[1, 3:text_len] = False
    segments = [(0, text_len, True)]
    with torch.no_grad():
        theirs = reference(x, rotary_emb=rope, segments=segments, key_valid=key_valid)
        if text_mask != "causal":
            segments = [(0, text_len, False)]
        ours = attn.forward_train_parity(x, rope, segments, key_valid)
    assert torch.equal(ours, theirs) == (text_mask == "causal")


def _inputs(text_lengths=(5,)):
    generator = torch.Generator().manual_seed(0)
    batch, text_len = len(text_lengths), max(text_lengths)
    text = torch.randn(batch, text_len, 24, generator=generator)
    for sample, length in enumerate(text_lengths):
        text[sample, length:] = 0
    return dict(
        hidden_states=torch.randn(batch, HEIGHT * WIDTH, 16, generator=generator),
        encoder_hidden_states=text.to(BF16),
        timestep=torch.full((batch,), 700.0),
        layouts=[
            build_layout([False] * length, [(1, HEIGHT, WIDTH)], (8, 12, 12), "cpu")
            for length in text_lengths
        ],
    )


@pytest.mark.parametrize(
    "extra", ["condition_latents", "prefix_caches", "prefix_kv", "prefix_pad"]
)
def test_condition_latents_and_prefix_caches_are_refused(extra):
    dit = _tiny_dit("train_parity")
    with pytest.raises(train_parity.TrainParityError, match="cached prefix"):
        dit(**_inputs(), **{extra: object()})


def _encoding_stage():
    stage = QwenImage21EncodingStage.__new__(QwenImage21EncodingStage)
    stage.scheduler = SimpleNamespace(config={})
    stage.encode_prompt = lambda prompt, images, device: (
        torch.zeros(3, 24),
        torch.zeros(3, dtype=torch.bool),
    )
    return stage


def _request(**fields):
    request = dict(
        condition_image=None,
        height=64,
        width=96,
        prompt="a cat",
        negative_prompt=" ",
        num_outputs_per_prompt=1,
        do_classifier_free_guidance=True,
        extra={},
    )
    return SimpleNamespace(**{**request, **fields})


def _server_args(numerics):
    # ServerArgs hands its numerics to the pipeline config, which the stages read
    return SimpleNamespace(pipeline_config=QwenImage21PipelineConfig(numerics=numerics))


@pytest.mark.parametrize("numerics", train_parity.NUMERICS_MODES)
def test_encoding_builds_prefix_caches_only_outside_train_parity(numerics):
    server_args = _server_args(numerics)
    batch = _encoding_stage().forward(_request(), server_args)
    for branch in ("qwen21_positive", "qwen21_negative"):
        caches = batch.extra[branch]["prefix_caches"]
        assert (caches is None) == (numerics == train_parity.NUMERICS_TRAIN_PARITY)
        assert batch.extra[branch]["layouts"][0]["target_shape"] == (4, 6)


def test_encoding_refuses_condition_images_under_train_parity():
    server_args = _server_args(train_parity.NUMERICS_TRAIN_PARITY)
    request = _request(condition_image=["reference.png"])
    with pytest.raises(train_parity.TrainParityError, match="condition images"):
        _encoding_stage().forward(request, server_args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA autocast")
@pytest.mark.parametrize("text_lengths", [(5,), (5, 3)])
def test_forward_matches_diffusers_under_cuda_autocast(text_lengths):
    torch.manual_seed(0)
    reference = DiffusersQwenImage21Transformer2DModel(**HF_CONFIG)
    for param in reference.parameters():
        param.data.normal_(0, 0.1)
    dit = _tiny_dit("train_parity", "cpu")
    dit.load_state_dict(reference.state_dict())
    # the trainer's bf16 parameters; its timestep-frequency buffer stays fp32
    train_parity.hold_parameters_in_bf16(dit)
    train_parity.hold_parameters_in_bf16(reference)
    reference, dit = reference.cuda(), dit.cuda()
    inputs = {
        name: value.cuda() if isinstance(value, torch.Tensor) else value
        for name, value in _inputs(text_lengths).items()
    }
    inputs["layouts"] = _inputs(text_lengths)["layouts"]
    batch, text_len = inputs["encoder_hidden_states"].shape[:2]
    mask = None
    if min(text_lengths) < text_len:
        mask = torch.arange(text_len)[None] < torch.tensor(text_lengths)[:, None]
    img_mask = torch.cat(
        [
            torch.zeros(batch, text_len, dtype=torch.bool),
            torch.ones(batch, HEIGHT * WIDTH // 4, dtype=torch.bool),
        ],
        dim=1,
    )
    with torch.no_grad():
        with torch.autocast("cuda", dtype=BF16):
            theirs = reference(
                hidden_states=inputs["hidden_states"],
                encoder_hidden_states=inputs["encoder_hidden_states"],
                encoder_hidden_states_mask=None if mask is None else mask.cuda(),
                timestep=inputs["timestep"] / 1000,
                img_shapes=[[(1, HEIGHT, WIDTH)]] * batch,
                img_mask=img_mask.cuda(),
                return_dict=False,
            )[0][:, text_len:]
        with set_forward_context(current_timestep=0, attn_metadata=None):
            ours = dit(**inputs)
    assert torch.equal(ours, theirs)
