"""A tiny random Qwen-Image model directory, made locally (nothing is downloaded).

The transformer is a real diffusers `QwenImageTransformer2DModel` (head_dim 128, as the RoPE axes
require) saved with `save_pretrained`; the other components are the empty folders sglang's model
detection asks for (`model_index.json` names them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_DIT_CONFIG = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=128,
    num_attention_heads=2,
    joint_attention_dim=64,
    axes_dims_rope=(16, 56, 56),
)
MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "_diffusers_version": "0.42.1",
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
}


def random_tiny_dit(seed: int = 0):
    """The diffusers model with every parameter random (default init zeroes some of them)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**TINY_DIT_CONFIG)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0, 0.05)
    return model.to(torch.bfloat16).eval()


def write_tiny_qwen_image(root: Path, seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    random_tiny_dit(seed).save_pretrained(root / "transformer")
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=1))
    for component in ("scheduler", "vae", "text_encoder", "tokenizer"):
        (root / component).mkdir(exist_ok=True)
    return root
