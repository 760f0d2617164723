# SPDX-License-Identifier: Apache-2.0
"""The training-side forward of the Wan DiT (Wan2.1 / Wan2.2 text-to-video) that train_parity must
reproduce bitwise, and how sglang's Wan modules pair with diffusers'.

Trainer regime (as for Qwen-Image, sglang_train_parity.reference):
* diffusers 0.42.1 `WanTransformer3DModel` with fp32 master weights, PEFT 0.21 LoRA on the self- and
  cross-attention projections and the FFN of every block (`LORA_TARGETS`), unmerged, scaling
  alpha / r.
* FSDP2 `MixedPrecisionPolicy(param_dtype=bf16)`: every parameter is used as the bf16 rounding of
  its fp32 master; buffers are not parameters and stay fp32 (Wan's RoPE tables `rope.freqs_cos` /
  `freqs_sin`, built by diffusers on the CPU in float64 and rounded to fp32).
* Forward inside `torch.autocast("cuda", bf16)`, latents fp32 [B, C, F, H, W], timestep on the
  scheduler's 0..1000 scale in fp32, per sample [B] or per token [B, S] (Wan2.2 TI2V-5B), text
  embeds bf16 [B, 512, 4096] (T5 output, zero-padded), SDPA's flash kernel.
* Wan2.2 A14B has two such models; the trainer holds one LoRA per expert.

On CPU, `autocast_emulation.cuda_autocast("cpu")` stands in for CUDA autocast's op policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang_train_parity.reference import (
    ATTENTION_BACKEND,
    ModulePair,
    Pairing,
    bf16_trainer_model,
    paired_name,
    random_masters,
    recorded_forward,
)
from torch import nn

# PEFT module-name suffixes: every attention projection of both attentions, and the FFN.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
# The two experts of Wan2.2 A14B, as the pipeline names its components.
EXPERTS = ("transformer", "transformer_2")

# A tiny Wan DiT: 2 blocks, 2 heads of 24 (the three RoPE axes get 8/8/8), T5 width 32.
TINY_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=24,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=96,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
# Wan2.2 TI2V-5B's layout: 48 latent channels, per-token timesteps.
TINY_TI2V_CONFIG = {**TINY_CONFIG, "in_channels": 48, "out_channels": 48}


def build_reference(
    model: nn.Module,
    lora_state: dict[str, torch.Tensor] | None = None,
    rank: int | None = None,
    alpha: float | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The trainer's model from the fp32 masters `model` (modified in place): PEFT LoRA injected
    and loaded from the fp32 `lora_state` when given, every parameter rounded to bf16 (the RoPE
    buffers stay fp32), moved to `device`."""
    return bf16_trainer_model(model, lora_state, rank, alpha, LORA_TARGETS, device)


@dataclass
class WanDiTInputs:
    """One DiT call in the form both sides take: latents [B, C, F, H, W] fp32, text [B, L, D] bf16,
    timestep [B] or [B, S] fp32 on the 0..1000 scale."""

    latents: torch.Tensor
    text: torch.Tensor
    timestep: torch.Tensor

    @classmethod
    def random(
        cls,
        batch: int,
        frames: int,
        height: int,
        width: int,
        text_len: int,
        config: dict,
        timestep: float,
        per_token: bool = False,
        seed: int = 0,
    ) -> WanDiTInputs:
        generator = torch.Generator().manual_seed(seed)
        latents = torch.randn(
            batch, config["in_channels"], frames, height, width, generator=generator
        )
        text = torch.randn(batch, text_len, config["text_dim"], generator=generator)
        if per_token:
            # TI2V: the first latent frame (the conditioning image) at t = 0
            _, p_h, p_w = config["patch_size"]
            grid = torch.full((frames, height // p_h, width // p_w), timestep)
            grid[0] = 0.0
            steps = grid.flatten().expand(batch, -1).clone()
        else:
            steps = torch.full((batch,), timestep)
        return cls(latents, text.to(torch.bfloat16), steps)


def reference_forward(
    model: nn.Module, inputs: WanDiTInputs, device_type: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's forward: the model output and every module's output by diffusers name."""
    model.set_attention_backend(ATTENTION_BACKEND[device_type])
    return recorded_forward(
        model,
        device_type,
        hidden_states=inputs.latents.to(device_type),
        encoder_hidden_states=inputs.text.to(device_type),
        timestep=inputs.timestep.to(device_type),
        return_dict=False,
    )


def sglang_forward(
    model: nn.Module, inputs: WanDiTInputs, device: str = "cpu", record=None
) -> dict[str, torch.Tensor]:
    """sglang's Wan DiT called as the denoising stage calls it (bf16 latents), every module's
    output (or those named in `record`) recorded by name ("" = the output)."""
    from sglang_train_parity.sglang_dit import recorded_call

    return recorded_call(
        model,
        record,
        hidden_states=inputs.latents.to(device, torch.bfloat16),
        encoder_hidden_states=inputs.text.to(device),
        timestep=inputs.timestep.to(device),
    )


_S = Pairing.SAME
# sglang Wan DiT module name -> diffusers name ("*" = block index); names without `.base_layer`.
SGLANG_TO_DIFFUSERS: dict[str, ModulePair] = {
    "": ModulePair("", _S, "model output; diffusers returns it in a 1-tuple"),
    "rotary_emb": ModulePair(
        "rope", Pairing.DIFFERENT, "sglang builds [S, D/2] tables; never called as a module"
    ),
    "rotary_emb.rope_generators": ModulePair(None, Pairing.SGLANG_ONLY, "container"),
    "rotary_emb.rope_generators.0": ModulePair(
        None, Pairing.SGLANG_ONLY, "one axis' table"
    ),
    "patch_embedding": ModulePair(
        "patch_embedding",
        Pairing.DIFFERENT,
        "default path: tokens [B, S, C] from a GEMM; diffusers: the Conv3d's [B, C, F, H, W]",
    ),
    "patch_embedding.proj": ModulePair("patch_embedding", _S, "the Conv3d"),
    "patch_embedding.norm": ModulePair(None, Pairing.SGLANG_ONLY, "identity"),
    "condition_embedder": ModulePair(
        "condition_embedder", _S, "first = temb, bf16 [B, D] or [B, S, D]"
    ),
    **{
        f"condition_embedder.{ours}": ModulePair(f"condition_embedder.{theirs}", _S)
        for ours, theirs in (
            ("time_embedder.mlp.fc_in", "time_embedder.linear_1"),
            ("time_embedder.mlp.act", "time_embedder.act"),
            ("time_embedder.mlp.fc_out", "time_embedder.linear_2"),
            ("time_modulation.act", "act_fn"),
            ("time_modulation.linear", "time_proj"),
            ("text_embedder", "text_embedder"),
            ("text_embedder.fc_in", "text_embedder.linear_1"),
            ("text_embedder.act", "text_embedder.act_1"),
            ("text_embedder.fc_out", "text_embedder.linear_2"),
        )
    },
    "condition_embedder.time_embedder": ModulePair(
        None, Pairing.SGLANG_ONLY, "sinusoid + MLP; diffusers splits it in two modules"
    ),
    "condition_embedder.time_embedder.mlp": ModulePair(
        "condition_embedder.time_embedder", _S
    ),
    "condition_embedder.time_modulation": ModulePair(
        "condition_embedder.time_proj", _S, "silu + time_proj"
    ),
    "blocks": ModulePair("blocks", _S, "container"),
    "blocks.*": ModulePair("blocks.*", _S),
    "blocks.*.attn1": ModulePair(
        None, Pairing.SGLANG_ONLY, "SDPA [B, S, H, D]; diffusers calls dispatch_attention_fn"
    ),
    "blocks.*.attn2.attn": ModulePair(None, Pairing.SGLANG_ONLY, "as attn1"),
    **{
        f"blocks.*.{attn}norm_{qk}": ModulePair(
            f"blocks.*.{attn or 'attn1.'}norm_{qk}",
            _S,
            "default path only: train_parity reads the weight, calls torch's RMSNorm",
        )
        for attn in ("", "attn2.")
        for qk in "qk"
    },
    **{
        f"blocks.*.{norm}.norm": ModulePair(
            None, Pairing.SGLANG_ONLY, "the LayerNorm inside a fused norm op"
        )
        for norm in (
            "norm1",
            "self_attn_residual_norm",
            "cross_attn_residual_norm",
            "ffn_residual_norm1",
        )
    },
    "blocks.*.ffn_residual_norm1": ModulePair(
        None,
        Pairing.SGLANG_ONLY,
        "default path: the previous block's FFN residual fused into norm1",
    ),
    "blocks.*.norm1": ModulePair(
        "blocks.*.norm1",
        Pairing.DIFFERENT,
        "sglang gives LN(x)*(1+scale)+shift; diffusers gives LN(x) in fp32",
    ),
    **{
        f"blocks.*.{proj}": ModulePair(f"blocks.*.attn1.{proj}", _S)
        for proj in ("to_q", "to_k", "to_v")
    },
    "blocks.*.to_out": ModulePair("blocks.*.attn1.to_out.0", _S),
    "blocks.*.self_attn_residual_norm": ModulePair(
        "blocks.*.norm2",
        Pairing.ROUNDED,
        "first = norm2(h + gate*attn) rounded once; diffusers' FP32LayerNorm of an fp32 input "
        "is fp32",
    ),
    "blocks.*.attn2": ModulePair("blocks.*.attn2", _S, "after to_out"),
    **{
        f"blocks.*.attn2.{proj}": ModulePair(f"blocks.*.attn2.{proj}", _S)
        for proj in ("to_q", "to_k", "to_v")
    },
    "blocks.*.attn2.to_out": ModulePair("blocks.*.attn2.to_out.0", _S),
    "blocks.*.cross_attn_residual_norm": ModulePair(
        "blocks.*.norm3",
        Pairing.DIFFERENT,
        "sglang gives the modulated LN of h + attn2; diffusers gives LN(h) in fp32",
    ),
    "blocks.*.ffn": ModulePair("blocks.*.ffn", _S),
    "blocks.*.ffn.fc_in": ModulePair(
        "blocks.*.ffn.net.0.proj", _S, "before the GELU"
    ),
    "blocks.*.ffn.act": ModulePair("blocks.*.ffn.net.0", _S, "after the GELU"),
    "blocks.*.ffn.fc_out": ModulePair("blocks.*.ffn.net.2", _S),
    "blocks.*.mlp_residual": ModulePair(
        None, Pairing.SGLANG_ONLY, "h + gate*ffn rounded once, inline in diffusers"
    ),
    "norm_out": ModulePair(
        "norm_out",
        Pairing.DIFFERENT,
        "sglang gives LN(x)*(1+scale)+shift; diffusers gives LN(x) in fp32",
    ),
    "norm_out.norm": ModulePair(
        None, Pairing.SGLANG_ONLY, "the LayerNorm inside norm_out"
    ),
    "proj_out": ModulePair("proj_out", _S),
}
def sglang_to_diffusers(name: str, lora: bool = True) -> ModulePair:
    """The diffusers counterpart of the sglang Wan module `name` (KeyError for one the table does
    not know); `.base_layer` pairs as in reference.sglang_to_diffusers."""
    return paired_name(name, lora, SGLANG_TO_DIFFUSERS, "blocks", LORA_TARGETS)


# sglang model id (a registered short name) -> (DiT config, experts, the pipeline's own model_index.json entries)
TINY_VARIANTS = {
    "Wan2.1-T2V-1.3B-Diffusers": (TINY_CONFIG, EXPERTS[:1], {}),
    "Wan2.2-T2V-A14B-Diffusers": (TINY_CONFIG, EXPERTS, {"boundary_ratio": 0.875}),
    "Wan2.2-TI2V-5B-Diffusers": (
        TINY_TI2V_CONFIG,
        EXPERTS[:1],
        {"expand_timesteps": True},
    ),
}


@dataclass(frozen=True)
class WanLayout:
    """What a Wan diffusers-layout folder says of its variant, as its pipeline reads it."""

    model_id: str  # the sglang model id whose pipeline serves this layout
    experts: tuple[str, ...]  # the DiT components present
    per_token_timesteps: bool  # TI2V-5B: the pipeline expands the timestep per token
    boundary_ratio: float | None  # A14B: the expert switch, as a share of the timesteps

    @property
    def pixels_per_patch(self) -> int:
        """VAE downsampling (8; 16 for TI2V-5B's VAE) x the DiT's patch (2)."""
        return 32 if self.per_token_timesteps else 16

    @classmethod
    def of(cls, model_dir: Path) -> WanLayout:
        index_file = model_dir / "model_index.json"
        index = json.loads(index_file.read_text()) if index_file.is_file() else {}
        experts = tuple(e for e in EXPERTS if (model_dir / e).is_dir())
        per_token = bool(index.get("expand_timesteps"))
        if per_token:
            model_id = "Wan2.2-TI2V-5B-Diffusers"
        elif EXPERTS[1] in experts:
            model_id = "Wan2.2-T2V-A14B-Diffusers"
        else:
            model_id = "Wan2.1-T2V-1.3B-Diffusers"
        return cls(model_id, experts, per_token, index.get("boundary_ratio"))


def build_tiny_dits(root: Path, model_id: str) -> Path:
    """The DiT(s) of `model_id` as tiny random fp32 masters in a diffusers-layout folder (a
    model_index.json and one folder per expert), for sglang's transformer loader. Seconds."""
    config, experts, entries = TINY_VARIANTS[model_id]
    root.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": "WanPipeline", "_diffusers_version": "0.42.1", **entries}
    for seed, expert in enumerate(experts):
        random_masters("WanTransformer3DModel", seed, **config).save_pretrained(
            root / expert
        )
        index[expert] = ["diffusers", "WanTransformer3DModel"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root
