# SPDX-License-Identifier: Apache-2.0
"""A tiny random Qwen-Image 2.1 pipeline in diffusers layout, built locally (nothing is downloaded).

`build_tiny_qwen_image21`: the check's tiny DiT (sglang_train_parity.qwen_image21.TINY_CONFIG: 64
latent channels, text width 48), a 2-layer Qwen3-VL text encoder of width 48 with a 2-block vision
tower, a Qwen3VLProcessor around tiny_model's offline byte-level BPE tokenizer and a Qwen chat
template, a tiny RGBA Qwen-Image 2.1 VAE (z_dim 64, 16x spatial) and a flow-matching scheduler.
A few MB, seconds; fp32 on disk (sglang casts at load). Start the server with
``--model-id Qwen-Image-2.1`` (or give the folder a name containing "qwen-image-2.1").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sglang_train_parity import qwen_image21
from sglang_train_parity.tiny_model import SEED, SPECIAL_TOKENS, build_tokenizer

# text encoder width == DiT context_in_dim; VAE latent channels == DiT in_channels
TEXT_DIM = qwen_image21.TINY_CONFIG["context_in_dim"]
Z_DIM = qwen_image21.TINY_CONFIG["in_channels"]
# Qwen3-VL's: one merged 2x2 vision token covers 32 px, two 16x latent tokens a side
VISION_PATCH = 16

# Qwen3-VL's chat template, reduced to what the pipelines render: string or list content (text,
# image, video items), and the generation prompt. The sglang and diffusers encoders compare its
# system turn with their hand-written "<|im_start|>system\n...<|im_end|>\n" prefix.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

VAE_CONFIG = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=Z_DIM,
    # five stages: four spatial downsamples, the 16x the pipeline assumes
    dim_mult=[1, 2, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True, True],
    dropout=0.0,
    is_residual=True,
    in_channels=4,  # RGBA, as the real VAE
    out_channels=4,
    # latents_mean / latents_std: the class defaults, the real model's 64-channel statistics
)

# FlowMatchEulerDiscreteScheduler with the keys both pipelines read for the resolution-dependent
# shift (mu, exponential time shift); the values are the pipelines' own fallbacks.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
    invert_sigmas=False,
    shift_terminal=None,
    stochastic_sampling=False,
    use_karras_sigmas=False,
    use_exponential_sigmas=False,
    use_beta_sigmas=False,
)

MODEL_INDEX = dict(
    processor=["transformers", "Qwen3VLProcessor"],
    scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"],
    text_encoder=["transformers", "Qwen3VLForConditionalGeneration"],
    vae=["diffusers", "AutoencoderKLQwenImage21"],
)


def build_processor(out: Path):
    """tiny_model's tokenizer (every Qwen special token the prompts use) wrapped as Qwen3-VL's
    processor, with the image/video processors at the vision tower's patching."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    tokenizer = build_tokenizer(out)
    # build_tokenizer writes vocab.json in hash order; by id, so that every build is byte-identical
    vocab = json.loads((out / "vocab.json").read_text())
    vocab = dict(sorted(vocab.items(), key=lambda item: item[1]))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tokenizer.chat_template = CHAT_TEMPLATE
    patching = dict(patch_size=VISION_PATCH, merge_size=2, temporal_patch_size=2)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            **patching, min_pixels=32 * 32, max_pixels=512 * 512
        ),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**patching),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    return processor


def build_text_encoder(out: Path, tokenizer):
    """Qwen3-VL at width TEXT_DIM: 2 text layers (heads of 24, interleaved MRoPE 4/4/4) and a
    2-block vision tower whose deepstack feeds text layer 0."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=5000000.0,
            mrope_section=[4, 4, 4],  # head_dim 24 -> 12 frequency pairs
            mrope_interleaved=True,
        ),
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision_config = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=TEXT_DIM,
        patch_size=VISION_PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,  # an 8x8 grid, interpolated to the image's
        deepstack_visual_indexes=[0],  # the default (8, 16, 24) needs 25+ blocks
        in_channels=3,
    )
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED + 21)
    Qwen3VLForConditionalGeneration(config).float().eval().save_pretrained(out)


def build_tiny_qwen_image21(root: Path) -> Path:
    """The whole Qwen-Image 2.1 pipeline under `root`; reused if already complete. A folder holding
    only the check's tiny DiT (qwen_image21.build_tiny_dit) is completed around it."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler

    index_file = root / "model_index.json"
    if index_file.is_file() and "vae" in json.loads(index_file.read_text()):
        return root
    if not index_file.is_file():
        qwen_image21.build_tiny_dit(root, seed=SEED)
    index = json.loads(index_file.read_text())
    processor = build_processor(root / "processor")
    build_text_encoder(root / "text_encoder", processor.tokenizer)
    torch.manual_seed(SEED + 22)
    AutoencoderKLQwenImage21(**VAE_CONFIG).float().save_pretrained(root / "vae")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(
        root / "scheduler"
    )
    index.update(MODEL_INDEX)
    # rewritten last: its vae entry marks a complete pipeline
    index_file.write_text(json.dumps(dict(sorted(index.items())), indent=2))
    return root
