# SPDX-License-Identifier: Apache-2.0
"""A tiny random LTX-2 (audio + video) pipeline in diffusers layout, built locally (nothing is
downloaded).

`build_tiny_ltx2`: what ``Lightricks/LTX-2`` ships, at tiny widths, every component random
(seeded): `TINY_DIT_CONFIG`'s 2-block DiT (diffusers `LTX2VideoTransformer3DModel` names, which
sglang's LTX2_PARAM_NAMES_MAPPING maps to its ltx-core names), a 2-layer Gemma 3 text encoder of
width 64 (`Gemma3ForConditionalGeneration` with a 1-layer SigLIP tower, as the real Gemma 3 12B:
sglang's encoder holds one and loads it), a Gemma-style tokenizer (BPE with byte fallback over
"▁"-joined words, trained on tiny_model's prompt words), the LTX-2.0 text connectors (caption
channels 64 = the encoder's width, 3 = 2 layers + the embeddings stacked), the LTX-2 video VAE
(the real block layout, 32x spatial / 8x temporal, 128 latent channels), the audio VAE (16 mel
bins, 4 latent channels over 4 latent bins), the HiFi-GAN vocoder (24 kHz, the real upsampling)
and LTX-2's scheduler. About 14 MB (half of it the video VAE, whose first encoder stage is as
wide as its 128 latent channels), seconds, byte-identical on every build; fp32 on disk (sglang
casts at load). The folder name should contain "ltx-2" (sglang detects the family from it) or the
server be started with ``--model-id LTX-2``. The smallest frame the VAE decodes is 64x64 (2x2
latents: its reflect padding needs 2 a side).

Shapes the pipeline derives (sglang's LTX2PipelineConfig): video latents [B, 128, (F - 1) / 8 + 1,
H / 32, W / 32] packed to tokens of 128 channels (patch size 1); audio latents [B, 4, round(F / fps
* 25), 4] packed to tokens of 4 * 4 = 16 channels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sglang_train_parity.tiny_model import PROMPT_WORDS, SEED

# the registered short name sglang resolves `--model-id` by (hf path Lightricks/LTX-2)
MODEL_ID = "LTX-2"

# Gemma 3 text encoder width == connector width == the DiT's caption_channels (LTX-2.0 projects
# the stacked layers back to the encoder's width, and its connectors have no input projection)
TEXT_DIM = 64
TEXT_LAYERS = 2
# video VAE latent channels == DiT in/out channels (patch size 1). 128, the real count: sglang's
# LTX2PipelineConfig draws the video noise with its own `in_channels` (128), not the DiT's or the
# VAE's config.
VIDEO_LATENT_CHANNELS = 128
# audio VAE: 16 mel bins, 4x mel compression (ch_mult of length 3), 4 latent channels. The
# pipeline packs [B, C, L, M] latents to [B, L, C * M] tokens; the VAE's latents_mean / std have
# base_channels entries and are applied per packed channel, so base_channels == C * M.
AUDIO_MEL_BINS = 16
AUDIO_LATENT_CHANNELS = 4
AUDIO_LATENT_MEL_BINS = AUDIO_MEL_BINS // 4
AUDIO_TOKEN_CHANNELS = AUDIO_LATENT_CHANNELS * AUDIO_LATENT_MEL_BINS

# The DiT: LTX-2 (19B)'s transformer/config.json at 2 blocks, video 2 heads of 32, audio 2 heads
# of 16. Every flag as the real model: split RoPE in float64, prompt embeddings projected in the DiT
# (use_prompt_embeddings, LTX-2.0), no gated attention / cross-attention adaLN (LTX-2.3's).
TINY_DIT_CONFIG = dict(
    in_channels=VIDEO_LATENT_CHANNELS,
    out_channels=VIDEO_LATENT_CHANNELS,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=2,
    attention_head_dim=32,
    cross_attention_dim=64,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    gated_attn=False,
    cross_attn_mod=False,
    audio_in_channels=AUDIO_TOKEN_CHANNELS,
    audio_out_channels=AUDIO_TOKEN_CHANNELS,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=2,
    audio_attention_head_dim=16,
    audio_cross_attention_dim=32,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    audio_gated_attn=False,
    audio_cross_attn_mod=False,
    num_layers=2,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=TEXT_DIM,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_offset=1,
    timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000,
    rope_type="split",
    use_prompt_embeddings=True,
    perturbed_attn=False,
)

# LTX-2.0's connectors at width TEXT_DIM: 2 heads of 32, 2 layers, 128 learnable registers (the
# real count: the prompt, padded to 1024 tokens, is tiled with them).
CONNECTORS_CONFIG = dict(
    caption_channels=TEXT_DIM,
    text_proj_in_factor=TEXT_LAYERS + 1,
    video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=TEXT_DIM // 2,
    video_connector_num_layers=2,
    video_connector_num_learnable_registers=128,
    video_gated_attn=False,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=TEXT_DIM // 2,
    audio_connector_num_layers=2,
    audio_connector_num_learnable_registers=128,
    audio_gated_attn=False,
    connector_rope_base_seq_len=4096,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_temporal_positioning=False,
    rope_type="split",
    per_modality_projections=False,
    proj_bias=False,
)

# LTX-2's video VAE block layout (4 down blocks: spatial, temporal, 2x spatiotemporal, after a
# 4x4 patchify: 32x spatial, 8x temporal; 3 spatiotemporal up blocks) at widths 8..64.
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=VIDEO_LATENT_CHANNELS,
    block_out_channels=(8, 16, 32, 64),
    down_block_types=("LTX2VideoDownBlock3D",) * 4,
    decoder_block_out_channels=(8, 16, 32),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    encoder_causal=True,
    decoder_causal=False,
    encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect",
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)

# LTX-2's audio VAE (causal over time, 4x time and mel compression) at base width 16.
AUDIO_VAE_CONFIG = dict(
    base_channels=AUDIO_TOKEN_CHANNELS,
    output_channels=2,
    ch_mult=(1, 2, 4),
    num_res_blocks=1,
    attn_resolutions=None,
    in_channels=2,
    resolution=256,
    latent_channels=AUDIO_LATENT_CHANNELS,
    norm_type="pixel",
    causality_axis="height",
    dropout=0.0,
    mid_block_add_attention=False,
    sample_rate=16000,
    mel_hop_length=160,
    is_causal=True,
    mel_bins=AUDIO_MEL_BINS,
    double_z=True,
)

# LTX-2's vocoder (stereo mel -> 24 kHz, 240x upsampling: 10 ms a mel frame) at width 64.
VOCODER_CONFIG = dict(
    in_channels=AUDIO_VAE_CONFIG["output_channels"] * AUDIO_MEL_BINS,
    hidden_channels=64,
    out_channels=2,
    upsample_kernel_sizes=[16, 15, 8, 4, 4],
    upsample_factors=[6, 5, 2, 2, 2],
    resnet_kernel_sizes=[3, 7, 11],
    resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    act_fn="leaky_relu",
    leaky_relu_negative_slope=0.1,
    antialias=False,
    final_act_fn="tanh",
    final_bias=True,
    output_sampling_rate=24000,
)

# LTX-2's scheduler/scheduler_config.json
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
    time_shift_type="exponential",
    invert_sigmas=False,
    stochastic_sampling=False,
    use_karras_sigmas=False,
    use_exponential_sigmas=False,
    use_beta_sigmas=False,
)

# connectors and vocoder are pipeline-local diffusers modules, recorded under "ltx2"
MODEL_INDEX = {
    "_class_name": "LTX2Pipeline",
    "_diffusers_version": "0.42.1",
    "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
    "connectors": ["ltx2", "LTX2TextConnectors"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
    "tokenizer": ["transformers", "GemmaTokenizerFast"],
    "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLLTX2Video"],
    "vocoder": ["ltx2", "LTX2Vocoder"],
}

# Gemma's: pad 0, eos 1, bos 2, unk 3, mask 4, then the 256 byte-fallback pieces; the turn and
# image tokens the real vocabulary holds are added after the learned pieces.
GEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
GEMMA_ADDED_TOKENS = [
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
# SigLIP at 32 px, 8 px patches: a 4x4 grid pooled to 2x2 = 4 tokens an image
VISION_IMAGE_SIZE = 32
VISION_PATCH = 8
MM_TOKENS_PER_IMAGE = 4


def build_tokenizer(out: Path):
    """Gemma's tokenizer kind (transformers' GemmaTokenizer: BPE with byte fallback over text whose
    spaces are "▁", <bos> prepended) with pieces learned from tiny_model's prompt words.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    byte_pieces = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # pieces within words only, each word starting with its "▁", as sentencepiece learns them
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        min_frequency=1,
        special_tokens=GEMMA_SPECIAL_TOKENS + byte_pieces,
        show_progress=False,
    )
    words = " ".join(
        [PROMPT_WORDS, "a photo of a red cat on a tree", "blurry low quality"]
    )
    tok.train_from_iterator([words, " " + words] * 50, trainer)
    vocab = dict(sorted(tok.get_vocab().items(), key=lambda item: item[1]))
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]
    hf = GemmaTokenizer(
        vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False
    )
    hf.add_special_tokens({"additional_special_tokens": GEMMA_ADDED_TOKENS})
    hf.model_max_length = 1024 * 1024
    hf.save_pretrained(out)
    return hf


def build_text_encoder(out: Path, tokenizer):
    """Gemma 3 (12B's layout) at width TEXT_DIM: 2 text layers (one sliding-window, one global
    with linear RoPE scaling, as its 5:1 pattern), 2 query heads of 32 over 1 KV head, and a
    1-layer SigLIP tower with its projector (mm tokens pooled 4x4 -> 2x2)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_ADDED_TOKENS}
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=128,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        sliding_window=512,  # < the 1024-token prompt: the window masks
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {
                "rope_type": "linear",
                "factor": 8.0,
                "rope_theta": 1000000.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        attention_bias=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    vision_config = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_channels=3,
        image_size=VISION_IMAGE_SIZE,
        patch_size=VISION_PATCH,
        layer_norm_eps=1e-6,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text_config,
        vision_config=vision_config,
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED + 31)
    Gemma3ForConditionalGeneration(config).float().eval().save_pretrained(out)
    _nest_vision_model_keys(out / "model.safetensors")


def _nest_vision_model_keys(weights: Path) -> None:
    """Rewrite the SigLIP tower's keys as checkpoints saved by transformers < 5.6 (Gemma 3's, so
    LTX-2's) hold them: ``vision_tower.vision_model.*``. 5.6+ saves the flattened ``vision_tower.*``,
    which sglang's Gemma 3 loader (load_weights) does not fuse into its qkv_proj / proj: the tower's
    attention would be left unloaded. transformers reads either."""
    from safetensors.torch import load_file, save_file

    state = load_file(weights)
    prefix = "vision_tower."
    nested = {
        (
            prefix + "vision_model." + key[len(prefix) :]
            if key.startswith(prefix) and not key.startswith(prefix + "vision_model.")
            else key
        ): value
        for key, value in state.items()
    }
    save_file(nested, weights, metadata={"format": "pt"})


def random_transformer(seed: int = SEED):
    """The diffusers LTX-2 DiT of TINY_DIT_CONFIG with every parameter random (norm weights near 1):
    zero-initialized ones would hide their paths."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTX2VideoTransformer3DModel(**TINY_DIT_CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05)
    return model.float().eval()


def build_tiny_ltx2(path: str | Path) -> Path:
    """The whole LTX-2 pipeline under `path`; reused if already complete."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    root = Path(path)
    index_file = root / "model_index.json"
    if index_file.is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(root / "tokenizer")
    build_text_encoder(root / "text_encoder", tokenizer)
    torch.manual_seed(SEED + 32)
    LTX2TextConnectors(**CONNECTORS_CONFIG).float().save_pretrained(root / "connectors")
    random_transformer(SEED + 33).save_pretrained(root / "transformer")
    torch.manual_seed(SEED + 34)
    AutoencoderKLLTX2Video(**VAE_CONFIG).float().save_pretrained(root / "vae")
    torch.manual_seed(SEED + 35)
    AutoencoderKLLTX2Audio(**AUDIO_VAE_CONFIG).float().save_pretrained(
        root / "audio_vae"
    )
    torch.manual_seed(SEED + 36)
    LTX2Vocoder(**VOCODER_CONFIG).float().save_pretrained(root / "vocoder")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(
        root / "scheduler"
    )
    # written last: its presence marks a complete model
    index_file.write_text(json.dumps(MODEL_INDEX, indent=2))
    return root
