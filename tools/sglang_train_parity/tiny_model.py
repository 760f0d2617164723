# SPDX-License-Identifier: Apache-2.0
"""Tiny random pipelines in diffusers layout, built locally (nothing is downloaded).

Qwen-Image (`build_tiny_qwen_image`): a 2-block DiT (head_dim 128, as the RoPE axes need), a tiny
VAE, a 2-layer Qwen2.5-VL text encoder, a byte-level BPE tokenizer trained on the prompt templates,
and Qwen-Image's scheduler. About 11 MB, a few seconds to build. The folder name should contain
"qwen-image" (sglang detects the model family from it) or the server be started with
``--model-id Qwen-Image``.

Wan text-to-video (`build_tiny_wan`): the variant's tiny DiT(s) (sglang_train_parity.wan), a
2-layer UMT5 encoder, a Unigram tokenizer (T5's kind, trained here: no sentencepiece model), a tiny
Wan VAE (Wan2.2's for TI2V-5B) and a UniPC scheduler. Start the server with the variant's
``--model-id``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

SEED = 0
TEXT_DIM = 64  # text encoder hidden size == transformer joint_attention_dim

DIT_CONFIG = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=128,
    num_attention_heads=2,
    joint_attention_dim=TEXT_DIM,
    axes_dims_rope=(16, 56, 56),
)

VAE_CONFIG = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    # Qwen-Image's real latent statistics (the pipeline de-normalizes with them)
    latents_mean=[
        -0.7571,
        -0.7089,
        -0.9113,
        0.1075,
        -0.1745,
        0.9653,
        -0.1517,
        1.5508,
        0.4134,
        -0.0715,
        0.5517,
        -0.3632,
        -0.1922,
        -0.9497,
        0.2503,
        -0.2921,
    ],
    latents_std=[
        2.8184,
        1.4541,
        2.3275,
        2.6558,
        1.2196,
        1.7708,
        2.6052,
        2.0743,
        3.2687,
        2.1526,
        2.8652,
        1.5579,
        1.6382,
        1.1253,
        2.8251,
        1.9160,
    ],
)

# Qwen-Image's scheduler/scheduler_config.json
SCHEDULER_CONFIG = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    invert_sigmas=False,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_dynamic_shifting=True,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)

MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "_diffusers_version": "0.42.1",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}

# Qwen2 special tokens used by the Qwen-Image prompt templates (ids follow the byte-level BPE vocab).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_TEMPLATE_WORDS = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate. Picture"
)
PROMPT_WORDS = (
    "a photo of cat dog red blue green car tree house sky sun with on in the blurry low quality "
    "bright dark small large mountain river painting"
)


def build_tokenizer(out: Path):
    """Byte-level BPE trained on the templates, so that every template word is one token and
    Qwen-Image's drop_idx=34 strips exactly the system prefix (as with the real tokenizer).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    # Qwen2's pre-tokenizer regex + byte level, as in the real tokenizer.json
    pat = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    from tokenizers import Regex

    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pat), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [TEMPLATE.format(PROMPT_WORDS), EDIT_TEMPLATE_WORDS, PROMPT_WORDS] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        min_frequency=1,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    vocab = tok.get_vocab()
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]
    hf = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        add_prefix_space=False,
    )
    hf.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    hf.add_tokens(["<|endoftext|>"], special_tokens=True)
    hf.model_max_length = 32768
    hf.save_pretrained(out)
    # the slow-tokenizer files too (vocab.json / merges.txt), as the real repo ships them
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n"
    )
    return hf


def build_text_encoder(out: Path, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = len(tokenizer)
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=TEXT_DIM,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "type": "mrope",
            "mrope_section": [4, 6, 6],
        },  # head_dim 32 -> 16 pairs
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision_config = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=TEXT_DIM,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[0],
        in_channels=3,
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED + 1)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(out)


def random_transformer(seed: int = SEED, **config):
    """A diffusers Qwen-Image DiT (DIT_CONFIG updated by `config`) with every parameter random:
    the default init zeroes some (proj_out, modulation), which would hide their paths.
    """
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**{**DIT_CONFIG, **config})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05)
    return model.to(torch.bfloat16).eval()


def build_transformer(out: Path):
    random_transformer().save_pretrained(out)


def build_vae(out: Path):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(SEED + 2)
    AutoencoderKLQwenImage(**VAE_CONFIG).to(torch.bfloat16).save_pretrained(out)


def build_scheduler(out: Path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(out)


def default_model_dir(model_id: str) -> Path:
    """Where the tools build the tiny model of `model_id` unless told otherwise (shared by the
    check and the demo)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "sglang-train-parity" / f"tiny-{model_id.lower()}"


def build_tiny_qwen_image(root: Path) -> Path:
    """The whole pipeline in diffusers layout under `root`; reused if already complete."""
    if (root / "model_index.json").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(root / "tokenizer")
    build_text_encoder(root / "text_encoder", tok)
    build_transformer(root / "transformer")
    build_vae(root / "vae")
    build_scheduler(root / "scheduler")
    # written last: its presence marks a complete model
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    return root


# The Wan VAEs at tiny widths: Wan2.1's (z 16, 8x spatial) and Wan2.2 TI2V-5B's (z 48, residual,
# 2x2 pixel patches: 16x spatial). Identity latent statistics: the demo checks the DiT, not images.
WAN_VAE_CONFIG = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
)
WAN22_VAE_CONFIG = dict(
    WAN_VAE_CONFIG,
    decoder_base_dim=8,
    z_dim=48,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)
# each variant's flow_shift, as in its sglang pipeline config
WAN_FLOW_SHIFT = {
    "Wan2.1-T2V-1.3B-Diffusers": 3.0,
    "Wan2.2-T2V-A14B-Diffusers": 12.0,
    "Wan2.2-TI2V-5B-Diffusers": 5.0,
}


def build_t5_tokenizer(out: Path):
    """A Unigram tokenizer (sentencepiece's model) trained on the prompt words, wrapped as
    T5TokenizerFast with T5's special tokens (pad 0, eos 1, unk 2), eos appended."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import T5TokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=120,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator([PROMPT_WORDS] * 50, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>",
        pair="$A </s> $B </s>",
        special_tokens=[("</s>", tok.token_to_id("</s>"))],
    )
    hf = T5TokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
    )
    hf.model_max_length = 512  # Wan pads every prompt to 512 tokens
    hf.save_pretrained(out)
    return hf


def build_umt5_encoder(out: Path, vocab_size: int, d_model: int):
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED + 11)
    UMT5EncoderModel(config).to(torch.bfloat16).eval().save_pretrained(out)


def build_tiny_wan(root: Path, model_id: str) -> Path:
    """The whole Wan pipeline of `model_id` (a key of wan.TINY_VARIANTS) under `root`; reused if
    already complete. A folder holding only the DiTs (sglang-train-parity check's tiny model) is
    completed around the same DiTs. About 2 MB, seconds."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from sglang_train_parity import wan

    index_file = root / "model_index.json"
    if index_file.is_file() and "vae" in json.loads(index_file.read_text()):
        return root
    wan.build_tiny_dits(root, model_id)  # the DiT(s) and their model_index.json entries
    index = json.loads(index_file.read_text())
    tok = build_t5_tokenizer(root / "tokenizer")
    build_umt5_encoder(root / "text_encoder", len(tok), wan.TINY_CONFIG["text_dim"])
    torch.manual_seed(SEED + 12)
    ti2v = index.get("expand_timesteps", False)
    AutoencoderKLWan(**(WAN22_VAE_CONFIG if ti2v else WAN_VAE_CONFIG)).save_pretrained(
        root / "vae"
    )
    UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=WAN_FLOW_SHIFT[model_id],
        num_train_timesteps=1000,
    ).save_pretrained(root / "scheduler")
    index.update(
        scheduler=["diffusers", "UniPCMultistepScheduler"],
        text_encoder=["transformers", "UMT5EncoderModel"],
        tokenizer=["transformers", "T5TokenizerFast"],
        vae=["diffusers", "AutoencoderKLWan"],
    )
    # a one-expert variant names the absent second expert, as its published folder does
    index.setdefault("transformer_2", [None, None])
    # rewritten last: its vae entry marks a complete pipeline
    index_file.write_text(json.dumps(index, indent=2))
    return root
