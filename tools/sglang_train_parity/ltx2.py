# SPDX-License-Identifier: Apache-2.0
"""The training-side forward of the LTX-2 DiT that train_parity must reproduce bitwise, and how
sglang's LTX-2 modules pair with it.

Trainer regime (miles' LTX trainer, `LTXTrainPipelineConfig.forward_velocity`; docs/ltx2-research.md):
* Lightricks' ltx-core `LTXModel` (not diffusers), built from the served checkpoint's config and
  weights, PEFT LoRA on `LORA_TARGETS` (r64, alpha 128 in miles' recipe), unmerged.
* bf16 parameters (miles' `--fsdp-master-dtype bf16`), forward inside
  `torch.autocast("cuda", bf16)`, SDPA pinned to the math kernel (`sdpa_math`).
* The video stream alone: `model(video=Modality(...), audio=None, perturbations=None)` with
  `sigma` = the rollout's timestep in bf16 / 1000 (bf16), `timesteps` = sigma [B, 1], positions
  built in fp32 (latent grid x (8, 32, 32), causal first frame, time / fps) and cast to bf16, the
  rollout's prompt embeddings in bf16, `context_mask=None`. No CFG.
* sglang's DiT also runs the audio stream; under train_parity that is ltx-core's audio stream
  alone (`video=None`), with ltx-core's fp32 audio positions.

On CPU, `autocast_emulation.cuda_autocast("cpu")` stands in for CUDA autocast's op policy.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang_train_parity.reference import (
    ModulePair,
    Pairing,
    bf16_trainer_model,
    paired_name,
)
from sglang_train_parity.tiny_ltx2 import (  # noqa: F401 (MODEL_ID, TINY_DIT_CONFIG: the family's)
    MODEL_ID,
    MODEL_INDEX,
    TINY_DIT_CONFIG,
    random_transformer,
)
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# miles' PEFT targets (module-name suffixes): every attention projection, both FFN Linears.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2")
# The VAE's downscaling (time, height, width) and the video rate the positions assume.
SCALE_FACTORS = (8, 32, 32)
FPS = 24.0


def ltx_core_model(config: dict) -> nn.Module:
    """ltx-core's audio-video `LTXModel` for a diffusers `LTX2VideoTransformer3DModel` config (the
    served checkpoint's transformer/config.json), with LTX-2.0's caption projections when the
    DiT projects the prompt (`use_prompt_embeddings`)."""
    from ltx_core.model.transformer.model import LTXModel, LTXModelType
    from ltx_core.model.transformer.rope import LTXRopeType
    from ltx_core.model.transformer.text_projection import PixArtAlphaTextProjection

    inner = config["num_attention_heads"] * config["attention_head_dim"]
    audio_inner = config["audio_num_attention_heads"] * config["audio_attention_head_dim"]
    projections = {}
    if config.get("use_prompt_embeddings", True):
        projections = dict(
            caption_projection=PixArtAlphaTextProjection(config["caption_channels"], inner),
            audio_caption_projection=PixArtAlphaTextProjection(
                config["caption_channels"], audio_inner
            ),
        )
    return LTXModel(
        model_type=LTXModelType.AudioVideo,
        num_attention_heads=config["num_attention_heads"],
        attention_head_dim=config["attention_head_dim"],
        in_channels=config["in_channels"],
        out_channels=config["out_channels"],
        num_layers=config["num_layers"],
        cross_attention_dim=config["cross_attention_dim"],
        norm_eps=config["norm_eps"],
        positional_embedding_theta=config["rope_theta"],
        positional_embedding_max_pos=[
            config["pos_embed_max_pos"],
            config["base_height"],
            config["base_width"],
        ],
        timestep_scale_multiplier=config["timestep_scale_multiplier"],
        audio_num_attention_heads=config["audio_num_attention_heads"],
        audio_attention_head_dim=config["audio_attention_head_dim"],
        audio_in_channels=config["audio_in_channels"],
        audio_out_channels=config["audio_out_channels"],
        audio_cross_attention_dim=config["audio_cross_attention_dim"],
        audio_positional_embedding_max_pos=[config["audio_pos_embed_max_pos"]],
        av_ca_timestep_scale_multiplier=config["cross_attn_timestep_scale_multiplier"],
        rope_type=LTXRopeType(config["rope_type"]),
        double_precision_rope=config["rope_double_precision"],
        apply_gated_attention=config.get("gated_attn", False),
        cross_attention_adaln=config.get("cross_attn_mod", False),
        **projections,
    )


def ltx_core_name(diffusers_name: str) -> str:
    """The ltx-core name of a diffusers LTX-2 parameter: sglang's loader mapping (diffusers ->
    sglang, which follows ltx-core) without its FFN and a2v-table renames, where diffusers and
    ltx-core agree."""
    from sglang.multimodal_gen.configs.models.dits.ltx_2 import (
        LTX2_PARAM_NAMES_MAPPING,
        LTX2_REVERSE_PARAM_NAMES_MAPPING,
    )

    name = diffusers_name
    for pattern, target in LTX2_PARAM_NAMES_MAPPING.items():
        name = re.sub(pattern, target, name) if re.match(pattern, name) else name
    for pattern, target in LTX2_REVERSE_PARAM_NAMES_MAPPING.items():
        if "ff\\." in pattern or "scale_shift_table" in pattern:
            name = re.sub(pattern, target, name) if re.match(pattern, name) else name
    return name


def to_ltx_core(masters: nn.Module) -> nn.Module:
    """ltx-core's model holding the fp32 masters of the diffusers LTX-2 DiT `masters`."""
    model = ltx_core_model(dict(masters.config))
    state = {ltx_core_name(k): v for k, v in masters.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model.float()


def build_reference(
    masters: nn.Module,
    lora_state: dict[str, torch.Tensor] | None = None,
    rank: int | None = None,
    alpha: float | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The trainer's model from the diffusers fp32 masters: ltx-core's `LTXModel` holding them,
    PEFT LoRA from the fp32 `lora_state` when given (PEFT names are the same on both: the targets
    sit inside the blocks), every parameter rounded to bf16, on `device`."""
    return bf16_trainer_model(
        to_ltx_core(masters), lora_state, rank, alpha, LORA_TARGETS, device
    )


def latent_grid(frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The video latents of a clip (frames 8k + 1, sides in multiples of 32 pixels)."""
    return (frames - 1) // SCALE_FACTORS[0] + 1, height // SCALE_FACTORS[1], width // SCALE_FACTORS[2]


def audio_tokens(frames: int) -> int:
    """The audio latents the pipeline pairs with `frames` video frames: 25 per second."""
    return round(frames / FPS * 25)


def input_dims(model: nn.Module) -> dict[str, int]:
    """The input widths of ltx-core's `model`, as LTX2DiTInputs.random takes them."""
    return dict(
        in_channels=model.patchify_proj.in_features,
        audio_in_channels=model.audio_patchify_proj.in_features,
        caption_channels=model.caption_projection.linear_1.in_features,
    )


@dataclass
class LTX2DiTInputs:
    """One DiT call in the form both sides take: video latents [B, F * H * W, C] and audio latents
    [B, A, Ca] fp32 (tokens, patch size 1; None: the video stream alone, as the trainer has it),
    text [B, L, caption_channels] bf16 (the connectors' output), timestep [B] fp32 on the 0..1000
    scale; (F, H, W) the latent grid."""

    latents: torch.Tensor
    audio_latents: torch.Tensor | None
    text: torch.Tensor
    timestep: torch.Tensor
    grid: tuple[int, int, int]

    @classmethod
    def random(
        cls,
        batch: int,
        grid: tuple[int, int, int],
        audio_frames: int,
        text_len: int,
        config: dict,
        timestep: float,
        seed: int = 0,
    ) -> LTX2DiTInputs:
        generator = torch.Generator().manual_seed(seed)
        frames, height, width = grid
        latents = torch.randn(
            batch, frames * height * width, config["in_channels"], generator=generator
        )
        audio = torch.randn(
            batch, audio_frames, config["audio_in_channels"], generator=generator
        )
        text = torch.randn(batch, text_len, config["caption_channels"], generator=generator)
        steps = torch.full((batch,), timestep)
        return cls(latents, audio, text.to(torch.bfloat16), steps, grid)


def trainer_modalities(inputs: LTX2DiTInputs, device: str | torch.device):
    """The video and the audio `Modality` as the trainer builds them from a rollout step: ltx-core's
    patchifier bounds and pixel coordinates (video positions in bf16, audio in fp32 seconds), the
    bf16 sigma, no text mask."""
    from ltx_core.components.patchifiers import (
        AudioPatchifier,
        VideoLatentPatchifier,
        get_pixel_coords,
    )
    from ltx_core.model.transformer.modality import Modality
    from ltx_core.types import AudioLatentShape, VideoLatentShape

    batch = inputs.latents.shape[0]
    frames, height, width = inputs.grid
    bounds = VideoLatentPatchifier(patch_size=1).get_patch_grid_bounds(
        VideoLatentShape(batch, inputs.latents.shape[-1], frames, height, width), device
    )
    positions = get_pixel_coords(bounds, SCALE_FACTORS, causal_fix=True).float()
    positions[:, 0, ...] = positions[:, 0, ...] / FPS
    sigma = inputs.timestep.to(device, torch.bfloat16) / 1000
    text = inputs.text.to(device)

    def modality(latents: torch.Tensor, positions: torch.Tensor) -> Modality:
        return Modality(
            latent=latents.to(device, torch.bfloat16),
            sigma=sigma,
            timesteps=sigma[:, None],
            positions=positions,
            context=text,
        )

    video = modality(inputs.latents, positions.to(torch.bfloat16))
    if inputs.audio_latents is None:
        return video, None
    audio_positions = AudioPatchifier(patch_size=1).get_patch_grid_bounds(
        AudioLatentShape(batch, 1, inputs.audio_latents.shape[1], 1), device
    )
    return video, modality(inputs.audio_latents, audio_positions)


def trainer_forward(
    model: nn.Module, inputs: LTX2DiTInputs, device_type: str
) -> torch.Tensor:
    """The trainer's forward: the video stream alone under CUDA autocast's policy (emulated off
    CUDA), SDPA's math kernel; the video output."""
    from sglang_train_parity.autocast_emulation import cuda_autocast

    video, _ = trainer_modalities(inputs, device_type)
    with torch.no_grad(), cuda_autocast(device_type), sdpa_kernel(SDPBackend.MATH):
        return model(video=video, audio=None, perturbations=None)[0]


def reference_forward(
    model: nn.Module, inputs: LTX2DiTInputs, device_type: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`trainer_forward`, then ltx-core's audio stream alone the same way: the video output and
    every module's output by ltx-core name (the audio modules' from the audio call)."""
    from sglang_train_parity.autocast_emulation import cuda_autocast
    from sglang_train_parity.sglang_dit import record_outputs

    outputs: dict[str, torch.Tensor] = {}
    handles = record_outputs(model, outputs)
    try:
        output = trainer_forward(model, inputs, device_type)
        _, audio = trainer_modalities(inputs, device_type)
        with torch.no_grad(), cuda_autocast(device_type), sdpa_kernel(SDPBackend.MATH):
            _, outputs["audio"] = model(video=None, audio=audio, perturbations=None)
    finally:
        for handle in handles:
            handle.remove()
    outputs[""] = output
    return output, outputs


def sglang_forward(
    model: nn.Module, inputs: LTX2DiTInputs, device: str = "cpu", record=None
) -> dict[str, torch.Tensor]:
    """sglang's LTX-2 DiT called as the denoising stage calls it under train_parity (bf16 latents,
    no audio-video cross-attention), every module's output (or those named in `record`) recorded
    by name ("" = the video output, "audio" = the audio output)."""
    from sglang_train_parity.sglang_dit import recorded_call

    frames, height, width = inputs.grid
    outputs = recorded_call(
        model,
        record,
        hidden_states=inputs.latents.to(device, torch.bfloat16),
        audio_hidden_states=inputs.audio_latents.to(device, torch.bfloat16),
        encoder_hidden_states=inputs.text.to(device),
        audio_encoder_hidden_states=inputs.text.to(device),
        timestep=inputs.timestep.to(device),
        num_frames=frames,
        height=height,
        width=width,
        fps=FPS,
        audio_num_frames=inputs.audio_latents.shape[1],
        disable_a2v_cross_attn=True,
        disable_v2a_cross_attn=True,
        return_latents=False,
    )
    outputs[""], outputs["audio"] = outputs[""]
    return outputs


_S = Pairing.SAME
_ATTENTIONS = (
    "attn1",
    "attn2",
    "audio_attn1",
    "audio_attn2",
    "audio_to_video_attn",
    "video_to_audio_attn",
)
_EMBEDDINGS = (
    "adaln_single",
    "audio_adaln_single",
    "av_ca_video_scale_shift_adaln_single",
    "av_ca_audio_scale_shift_adaln_single",
    "av_ca_a2v_gate_adaln_single",
    "av_ca_v2a_gate_adaln_single",
)
# sglang LTX-2 DiT module name -> ltx-core name ("*" = block index); names without `.base_layer`.
# sglang follows ltx-core's names except in the FFN.
SGLANG_TO_LTX_CORE: dict[str, ModulePair] = {
    "": ModulePair("", _S, "the video output"),
    "audio": ModulePair("audio", _S, "the audio output (ltx-core's audio call)"),
    **{
        f"{prefix}{name}": ModulePair(f"{prefix}{name}", _S)
        for prefix in ("", "audio_")
        for name in (
            "patchify_proj",
            "caption_projection",
            "caption_projection.linear_1",
            "caption_projection.act_1",
            "caption_projection.linear_2",
            "proj_out",
        )
    },
    **{
        f"{prefix}norm_out": ModulePair(
            f"{prefix}norm_out",
            Pairing.ROUNDED,
            "default path only; ltx-core's autocast LayerNorm is fp32",
        )
        for prefix in ("", "audio_")
    },
    **{
        f"{embedding}{name}": ModulePair(f"{embedding}{name}", _S)
        for embedding in _EMBEDDINGS
        for name in (
            "",
            ".emb",
            ".emb.timestep_embedder",
            ".emb.timestep_embedder.linear_1",
            ".emb.timestep_embedder.linear_2",
            ".silu",
            ".linear",
        )
    },
    **{
        rope: ModulePair(None, Pairing.SGLANG_ONLY, "RoPE tables; ltx-core's preprocessor")
        for rope in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")
    },
    "transformer_blocks": ModulePair("transformer_blocks", _S, "container"),
    "transformer_blocks.*": ModulePair(
        "transformer_blocks.*",
        Pairing.DIFFERENT,
        "default path only; ltx-core's block returns its TransformerArgs",
    ),
    "transformer_blocks.*.rms_norm": ModulePair(
        None, Pairing.SGLANG_ONLY, "default path only; ltx-core calls F.rms_norm"
    ),
    **{
        f"transformer_blocks.*.{attn}{name}": ModulePair(
            f"transformer_blocks.*.{attn}{name}", _S
        )
        for attn in _ATTENTIONS
        for name in (
            "",
            ".to_q",
            ".to_k",
            ".to_v",
            ".q_norm",
            ".k_norm",
            ".to_out",
            ".to_out.0",
            ".to_out.1",
        )
    },
    **{
        f"transformer_blocks.*.{attn}.attn": ModulePair(
            None, Pairing.SGLANG_ONLY, "SDPA [B, S, H, D]; ltx-core calls SDPA directly"
        )
        for attn in _ATTENTIONS
    },
    **{
        f"transformer_blocks.*.{ff}{ours}": ModulePair(
            f"transformer_blocks.*.{ff}{theirs}", _S, note
        )
        for ff in ("ff", "audio_ff")
        for ours, theirs, note in (
            ("", "", ""),
            (".proj_in", ".net.0.proj", "before the GELU"),
            (".act", ".net.0", "after the GELU"),
            (".proj_out", ".net.2", ""),
        )
    },
}


def sglang_to_ltx_core(name: str, lora: bool = True) -> ModulePair:
    """The ltx-core counterpart of the sglang LTX-2 module `name` (KeyError for one the table does
    not know); `.base_layer` pairs as in reference.sglang_to_diffusers."""
    return paired_name(
        name, lora, SGLANG_TO_LTX_CORE, "transformer_blocks", LORA_TARGETS
    )


def build_tiny_dit(root: Path, seed: int = 0) -> Path:
    """The tiny LTX-2 DiT (tiny_ltx2's, fp32 masters) alone in a diffusers-layout folder (a
    model_index.json and transformer/), for sglang's transformer loader. Seconds."""
    root.mkdir(parents=True, exist_ok=True)
    random_transformer(seed).save_pretrained(root / "transformer")
    write_dit_model_index(root)
    return root


def write_dit_model_index(root: Path) -> None:
    """The model_index.json of a folder that holds LTX-2's DiT alone (sglang resolves the
    pipeline from it and the folder name, which must contain "ltx-2")."""
    index = {k: v for k, v in MODEL_INDEX.items() if k.startswith("_")}
    index["transformer"] = MODEL_INDEX["transformer"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
