# SPDX-License-Identifier: Apache-2.0
"""The training-side forward of the Qwen-Image 2.1 DiT (text-to-image) that train_parity must
reproduce bitwise, and how sglang's modules pair with diffusers'.

Trainer regime (as for Qwen-Image, sglang_train_parity.reference):
* diffusers 0.42.1 `QwenImage21Transformer2DModel` with fp32 master weights, PEFT 0.21 LoRA on the
  seven projections of every block (`LORA_TARGETS`, the model's own `_tp_plan`), unmerged, scaling
  alpha / r.
* FSDP2 `MixedPrecisionPolicy(param_dtype=bf16)`: every parameter is used as the bf16 rounding of
  its fp32 master. The timestep frequencies stay the fp32 buffer diffusers builds on the CPU in
  `__init__`; the RoPE tables (complex64, a plain attribute, never cast) are rebuilt on the GPU
  after loading, as miles does (`rope_tables="device"`), or left as built on the CPU in
  `__init__` (`rope_tables="cpu"`, stock diffusers).
* Forward inside `torch.autocast("cuda", bf16)`, called as miles' trainer calls it: latents
  [B, N, C] (the rollout's, bf16 values), timestep `t / 1000` in fp32 for the scheduler's t (the
  model rounds it to bf16), text embeds bf16 [B, L, D] right-padded with
  `encoder_hidden_states_mask` (None when nothing is padded), `img_mask` / `img_shapes` of the
  target, no KV cache (the whole joint sequence every step), diffusers' `native` attention
  backend (SDPA with torch's kernel choice: the text segment carries a causal mask, which
  `_native_flash` refuses). The model returns the joint sequence; the trainer keeps the last N
  tokens.

On CPU, `autocast_emulation.cuda_autocast("cpu")` stands in for CUDA autocast's op policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang_train_parity.reference import (
    ModulePair,
    Pairing,
    bf16_trainer_model,
    paired_name,
    random_masters,
    recorded_forward,
)
from torch import nn

# PEFT module-name suffixes: the seven projections of every block. PEFT matches a suffix after a
# ".", so "proj" and "out" wrap img_mlp.proj / img_mlp.out, not proj_out.
LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "img_mlp.proj",
    "img_mlp.gate_layer",
    "img_mlp.out",
)
# the registered short name sglang resolves `--model-id` by
MODEL_ID = "Qwen-Image-2.1"
# A tiny Qwen-Image 2.1 DiT: 2 blocks, 2 heads of 32 (RoPE axes 8/12/12), text width 48.
TINY_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    out_channels=64,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    context_in_dim=48,
    mlp_ratio=3,
    axes_dims_rope=(8, 12, 12),
    eps=1e-6,
    causal_condition=True,
)


def build_reference(
    model: nn.Module,
    lora_state: dict[str, torch.Tensor] | None = None,
    rank: int | None = None,
    alpha: float | None = None,
    device: str | torch.device = "cpu",
    rope_tables: str = "device",
) -> nn.Module:
    """The trainer's model from the fp32 masters `model` (modified in place): PEFT LoRA injected
    and loaded from the fp32 `lora_state` when given, every parameter rounded to bf16 (the
    timestep-frequency buffer stays fp32), moved to `device`; with `rope_tables="device"` the
    RoPE tables are rebuilt there (else they stay the CPU-built ones)."""
    model = bf16_trainer_model(model, lora_state, rank, alpha, LORA_TARGETS, device)
    if rope_tables == "device":
        _rebuild_rope_tables(model.pos_embed, torch.device(device))
    elif rope_tables != "cpu":
        raise ValueError(f"rope_tables must be 'cpu' or 'device', got {rope_tables!r}")
    return model


def _rebuild_rope_tables(rope: nn.Module, device: torch.device) -> None:
    """diffusers' `__init__` expressions for the RoPE tables, run on `device` (CPU- and
    CUDA-built tables differ by ULPs)."""
    positive = torch.arange(8192, device=device)
    negative = torch.arange(1024, device=device).flip(0) * -1 - 1

    def table(index: torch.Tensor, dim: int) -> torch.Tensor:
        exponent = torch.arange(0, dim, 2, device=device).to(torch.float32).div(dim)
        angles = torch.outer(index, 1.0 / torch.pow(rope.theta, exponent))
        return torch.polar(torch.ones_like(angles), angles)

    rope.freqs = [
        torch.cat([table(positive, dim), table(negative, dim)]) for dim in rope.axes_dim
    ]


@dataclass
class QwenImage21DiTInputs:
    """One DiT call in the form both sides take: latents [B, H*W, C] fp32 (raster order of the
    latent grid), text [B, L, D] bf16 right-padded with zeros, the valid text length of each
    sample, timestep [B] fp32 on the scheduler's 0..1000 scale, the latent grid (H, W)."""

    latents: torch.Tensor
    text: torch.Tensor
    text_lengths: tuple[int, ...]
    timestep: torch.Tensor
    grid: tuple[int, int]

    @classmethod
    def random(
        cls,
        text_lengths: tuple[int, ...],
        height: int,
        width: int,
        config: dict,
        timestep: float,
        seed: int = 0,
    ) -> QwenImage21DiTInputs:
        generator = torch.Generator().manual_seed(seed)
        batch, text_len = len(text_lengths), max(text_lengths)
        latents = torch.randn(
            batch, height * width, config["in_channels"], generator=generator
        )
        text = torch.randn(batch, text_len, config["context_in_dim"], generator=generator)
        for sample, length in enumerate(text_lengths):
            text[sample, length:] = 0
        steps = torch.full((batch,), timestep)
        return cls(latents, text.to(torch.bfloat16), tuple(text_lengths), steps, (height, width))

    @property
    def text_mask(self) -> torch.Tensor | None:
        """The pipeline's `encoder_hidden_states_mask`: None when no prompt is padded."""
        lengths = torch.tensor(self.text_lengths)
        if bool((lengths == self.text.shape[1]).all()):
            return None
        return torch.arange(self.text.shape[1])[None] < lengths[:, None]


def reference_forward(
    model: nn.Module, inputs: QwenImage21DiTInputs, device_type: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's forward: the target tokens of the output and every module's output by
    diffusers name (the root is the target tokens)."""
    model.set_attention_backend("native")
    batch, text_len = inputs.text.shape[:2]
    height, width = inputs.grid
    latents = inputs.latents.to(device_type)
    image_slots = torch.ones(batch, height * width // 4, dtype=torch.bool)
    img_mask = torch.cat([torch.zeros(batch, text_len, dtype=torch.bool), image_slots], 1)
    mask = inputs.text_mask
    output, outputs = recorded_forward(
        model,
        device_type,
        hidden_states=latents,
        encoder_hidden_states=inputs.text.to(device_type),
        encoder_hidden_states_mask=None if mask is None else mask.to(device_type),
        timestep=inputs.timestep.to(device_type, torch.float32) / 1000,
        img_shapes=[[(1, height, width)]] * batch,
        img_mask=img_mask.to(device_type),
        attention_kwargs=None,
        return_dict=False,
    )
    output = output[:, -latents.shape[1] :]
    outputs[""] = output
    return output, outputs


def sglang_layouts(inputs: QwenImage21DiTInputs, axes_dims, device) -> list[dict]:
    """The per-sample layouts sglang's encoding stage builds for these prompts."""
    from sglang.multimodal_gen.runtime.models.dits.qwen_image21 import build_layout

    shape = (1, *inputs.grid)
    return [
        build_layout([False] * length, [shape], axes_dims, device)
        for length in inputs.text_lengths
    ]


def sglang_forward(
    model: nn.Module, inputs: QwenImage21DiTInputs, device: str = "cpu", record=None
) -> dict[str, torch.Tensor]:
    """sglang's Qwen-Image 2.1 DiT called as its denoising stage calls it (bf16 latents, no
    prefix cache), every module's output (or those named in `record`) recorded by name ("" =
    the output)."""
    from sglang_train_parity.sglang_dit import recorded_call

    layouts = sglang_layouts(inputs, model.config.axes_dims_rope, torch.device(device))
    return recorded_call(
        model,
        record,
        hidden_states=inputs.latents.to(device, torch.bfloat16),
        encoder_hidden_states=inputs.text.to(device),
        timestep=inputs.timestep.to(device),
        layouts=layouts,
    )


_S = Pairing.SAME
_DEFAULT_ONLY = "default path only: train_parity reads its parameters"
# sglang Qwen-Image 2.1 module name -> diffusers name ("*" = block index); without `.base_layer`.
SGLANG_TO_DIFFUSERS: dict[str, ModulePair] = {
    "": ModulePair("", _S, "the target tokens; diffusers returns the joint sequence"),
    "img_in": ModulePair("img_in", _S),
    "txt_in": ModulePair("txt_in", _S, "default path only: train_parity calls its layers"),
    "txt_in.text_norm": ModulePair("txt_in.text_norm", _S, _DEFAULT_ONLY),
    "txt_in.in_layer": ModulePair("txt_in.in_layer", _S),
    "txt_in.out_layer": ModulePair("txt_in.out_layer", _S),
    "time_text_embed": ModulePair("time_text_embed", _S, "temb of the B timesteps and t=0"),
    "time_text_embed.timestep_embedder": ModulePair(None, Pairing.SGLANG_ONLY, "container"),
    **{
        f"time_text_embed.timestep_embedder.{linear}": ModulePair(
            f"time_text_embed.timestep_embedder.{linear}", _S
        )
        for linear in ("linear_1", "linear_2")
    },
    "modulation": ModulePair("modulation", _S, "[B + 1, 4D], shared by every block"),
    "modulation.0": ModulePair("modulation.0", _S),
    "modulation.1": ModulePair("modulation.1", _S),
    "transformer_blocks": ModulePair("transformer_blocks", _S, "container"),
    "transformer_blocks.*": ModulePair(
        "transformer_blocks.*", _S, "default path only: train_parity calls its step"
    ),
    **{
        f"transformer_blocks.*.{norm}": ModulePair(
            f"transformer_blocks.*.{norm}",
            Pairing.DIFFERENT,
            "default path: LN in bf16; diffusers' autocast LN is fp32",
        )
        for norm in ("img_norm1", "img_norm2")
    },
    "transformer_blocks.*.attn": ModulePair(
        "transformer_blocks.*.attn", _S, "default path only: train_parity calls its step"
    ),
    **{
        f"transformer_blocks.*.attn.{proj}": ModulePair(
            f"transformer_blocks.*.attn.{proj}", _S
        )
        for proj in ("to_q", "to_k", "to_v", "to_out.0", "norm_q", "norm_k")
    },
    "transformer_blocks.*.attn.to_out": ModulePair(None, Pairing.SGLANG_ONLY, "container"),
    **{
        f"transformer_blocks.*.attn.{attn}": ModulePair(
            None, Pairing.SGLANG_ONLY, "default path's attention layers"
        )
        for attn in ("local_attn", "target_attn")
    },
    **{
        f"transformer_blocks.*.img_mlp{layer}": ModulePair(
            f"transformer_blocks.*.img_mlp{layer}", _S
        )
        for layer in ("", ".proj", ".gate_layer", ".out")
    },
    "norm_out": ModulePair(
        "norm_out", _S, "default path only: train_parity reads its norm and calls its linear"
    ),
    "norm_out.linear": ModulePair("norm_out.linear", _S, "the scale of the B + 1 rows"),
    "norm_out.norm": ModulePair("norm_out.norm", Pairing.DIFFERENT, "bf16 vs fp32 LN"),
    "proj_out": ModulePair("proj_out", _S, "the whole joint sequence"),
}


def sglang_to_diffusers(name: str, lora: bool = True) -> ModulePair:
    """The diffusers counterpart of the sglang Qwen-Image 2.1 module `name` (KeyError for one the
    table does not know); `.base_layer` pairs as in reference.sglang_to_diffusers."""
    return paired_name(name, lora, SGLANG_TO_DIFFUSERS, "transformer_blocks", LORA_TARGETS)


def build_tiny_dit(root: Path, seed: int = 0) -> Path:
    """A tiny random Qwen-Image 2.1 DiT as fp32 masters in a diffusers-layout folder (a
    model_index.json and transformer/), for sglang's transformer loader. Seconds."""
    root.mkdir(parents=True, exist_ok=True)
    model = random_masters("QwenImage21Transformer2DModel", seed, **TINY_CONFIG)
    model.save_pretrained(root / "transformer")
    index = {
        "_class_name": "QwenImage21Pipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    }
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root
