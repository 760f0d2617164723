"""The training-side forward of the Qwen-Image DiT that train_parity must reproduce bitwise.

Trainer regime (miles' current "regime B"; docs/numerics-contract.md of sglang-train-parity):
* diffusers 0.42.1 `QwenImageTransformer2DModel` with fp32 master weights, PEFT 0.21 LoRA on the twelve
  projections of every block (`LORA_TARGETS`), unmerged, lora_dropout 0, scaling alpha / r.
* FSDP2 `MixedPrecisionPolicy(param_dtype=bf16, cast_forward_inputs=False)`: every parameter, base and
  LoRA A/B alike, is used as the round-to-nearest-even bf16 copy of its fp32 master. Here that is one
  `model.to(bf16)` (FSDP2 with one rank was measured bitwise equal to it; the model has no buffers).
* Forward inside `torch.autocast("cuda", bf16)`, latents fp32, timestep t / 1000 in fp32, text embeds
  bf16, `encoder_hidden_states_mask=None` (equal-length unpadded prompts), attention through SDPA's
  flash kernel (diffusers backend `_native_flash`).
* RoPE tables rebuilt on the device the model runs on before the first forward (`rope_tables="device"`,
  as miles does; diffusers 0.42.1 lru-caches them and the cache cannot be cleared), or left as stock
  diffusers builds them on the CPU in `__init__` (`rope_tables="cpu"`). The rollout builds them where
  `--train-parity-rope-tables` says (default device).

On CPU, `autocast_emulation.cuda_autocast("cpu")` stands in for CUDA autocast's op policy.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

# PEFT module-name suffixes (PEFT matches `name == t or name.endswith("." + t)`); miles' Qwen-Image list.
LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
ADAPTER = "default"
# diffusers attention backend per device: the trainer pins SDPA's flash kernel; CPU has only `native`.
ATTENTION_BACKEND = {"cuda": "_native_flash", "cpu": "native"}
# Magnitude of the random LoRA delta relative to the layer input (before alpha / r): large enough to
# move bf16 outputs, small enough to keep activations tame through the blocks.
_LORA_DELTA_GAIN = 0.1


def is_lora_target(name: str, targets: tuple[str, ...] = LORA_TARGETS) -> bool:
    """True for a diffusers module name that PEFT wraps given `targets`."""
    return any(name == t or name.endswith("." + t) for t in targets)


def random_masters(model_cls: str, seed: int, **config) -> nn.Module:
    """diffusers' DiT `model_cls` built from `config`, fp32, every parameter N(0, 0.1): the
    default init zeroes some (Qwen-Image 2.1's text norm), which would hide their paths, and
    0.1 keeps the blocks' outputs well away from zero."""
    import diffusers

    torch.manual_seed(seed)
    model = getattr(diffusers, model_cls)(**config)
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.data = torch.randn(param.shape, generator=generator) * 0.1
    return model


def random_lora_state(
    model: nn.Module,
    rank: int,
    alpha: float,
    seed: int,
    targets: tuple[str, ...] = LORA_TARGETS,
) -> dict[str, torch.Tensor]:
    """fp32 master LoRA weights for every target Linear of `model`, keyed as PEFT's
    `get_peft_model_state_dict` names them (`transformer_blocks.0.attn.to_q.lora_A.weight`).

    A ~ N(0, 1/in) and B ~ N(0, gain/(r·s)) with s = alpha/r, so s·B·A·x ≈ gain·|x| whatever rank and
    alpha are; both non-zero (PEFT's default init zeroes B, which would hide the LoRA path).
    """
    generator = torch.Generator().manual_seed(seed)
    scaling = alpha / rank
    state = {}
    for name, module in model.named_modules():
        if not (is_lora_target(name, targets) and isinstance(module, nn.Linear)):
            continue
        a = torch.randn(rank, module.in_features, generator=generator)
        b = torch.randn(module.out_features, rank, generator=generator)
        state[f"{name}.lora_A.weight"] = a / math.sqrt(module.in_features)
        state[f"{name}.lora_B.weight"] = b * (_LORA_DELTA_GAIN / (rank * scaling))
    return state


def build_reference(
    model: str | Path | nn.Module,
    lora_state: dict[str, torch.Tensor] | None = None,
    rank: int | None = None,
    alpha: float | None = None,
    device: str | torch.device = "cpu",
    rope_tables: str = "device",
) -> nn.Module:
    """The trainer's model: `model` (a diffusers transformer folder, or a diffusers model, which is
    modified in place) as fp32 masters, PEFT LoRA injected and loaded from the fp32 `lora_state` when
    given, then every parameter rounded to bf16, moved to `device`; with `rope_tables="device"` the
    RoPE tables are rebuilt there (else they stay diffusers' CPU-built ones)."""
    from diffusers import QwenImageTransformer2DModel

    if not isinstance(model, nn.Module):
        model = QwenImageTransformer2DModel.from_pretrained(
            model, torch_dtype=torch.float32
        )
    model = model.float()
    if lora_state is not None:
        inject_lora(model, lora_state, rank, alpha, LORA_TARGETS)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    if rope_tables == "device":
        _rebuild_rope_tables(model.pos_embed, torch.device(device))
    elif rope_tables != "cpu":
        raise ValueError(f"rope_tables must be 'cpu' or 'device', got {rope_tables!r}")
    return model


def inject_lora(
    model: nn.Module,
    lora_state: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    targets: tuple[str, ...],
) -> None:
    """PEFT LoRA on `targets` of `model`, loaded from the fp32 `lora_state` (all of it)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        init_lora_weights="gaussian",  # miles' choice; overwritten by lora_state
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    result = set_peft_model_state_dict(model, lora_state, adapter_name=ADAPTER)
    lora_params = [n for n, _ in model.named_parameters() if ".lora_" in n]
    if result.unexpected_keys or len(lora_params) != len(lora_state):
        raise ValueError(
            f"LoRA state does not fit the model: {len(lora_state)} tensors for "
            f"{len(lora_params)} LoRA parameters, unexpected {result.unexpected_keys[:4]}"
        )


def bf16_trainer_model(
    model: nn.Module,
    lora_state: dict[str, torch.Tensor] | None,
    rank: int | None,
    alpha: float | None,
    targets: tuple[str, ...],
    device: str | torch.device,
) -> nn.Module:
    """The trainer's model from the fp32 masters `model` (modified in place): PEFT LoRA on
    `targets` injected and loaded from the fp32 `lora_state` when given, every parameter rounded
    to bf16 as FSDP2's param_dtype does (buffers keep their dtype), moved to `device`."""
    model = model.float()
    if lora_state is not None:
        inject_lora(model, lora_state, rank, alpha, targets)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model.to(device).eval()


def _rebuild_rope_tables(rope: nn.Module, device: torch.device) -> None:
    """Recompute `pos_freqs`/`neg_freqs` on `device` with sglang's `QwenEmbedRope._init_freqs` ops
    (CPU- and CUDA-built tables differ by ULPs; diffusers builds on CPU in __init__)."""

    def table(index: torch.Tensor) -> torch.Tensor:
        parts = []
        for dim in rope.axes_dim:
            exponent = torch.arange(0, dim, 2, device=device).to(torch.float32).div(dim)
            angles = torch.outer(index, 1.0 / torch.pow(rope.theta, exponent))
            parts.append(torch.polar(torch.ones_like(angles), angles))
        return torch.cat(parts, dim=1)

    index = torch.arange(4096, device=device)
    rope.pos_freqs = table(index)
    rope.neg_freqs = table(index.flip(0) * -1 - 1)


@dataclass
class QwenDiTInputs:
    """One DiT call, in the form both sides can take.

    latents: [B, S_img, 64] fp32 packed latents (the trainer feeds fp32; bf16 gives the same result).
    text: [B, S_txt, joint_attention_dim] bf16 prompt embeds, unpadded, equal length per row.
    timestep: [B] fp32 scheduler timestep on sglang's 0..1000 scale (sglang's DiT divides by 1000).
    img_shapes: per sample [(frames, height, width)] of the latent patch grid.
    """

    latents: torch.Tensor
    text: torch.Tensor
    timestep: torch.Tensor
    img_shapes: list[list[tuple[int, int, int]]]

    @classmethod
    def random(
        cls,
        batch: int,
        height: int,
        width: int,
        txt_len: int,
        joint_dim: int,
        timestep: float = 500.0,
        seed: int = 0,
    ) -> QwenDiTInputs:
        generator = torch.Generator().manual_seed(seed)
        return cls(
            latents=torch.randn(batch, height * width, 64, generator=generator),
            text=torch.randn(batch, txt_len, joint_dim, generator=generator).bfloat16(),
            timestep=torch.full((batch,), timestep),
            img_shapes=[[(1, height, width)]] * batch,
        )


def reference_forward(
    model: nn.Module, inputs: QwenDiTInputs, device_type: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the trainer's forward; return the model output ([B, S_img, 64] bf16) and every module's
    output by diffusers module name (first tensor of tuple outputs; the root is "")."""
    model.set_attention_backend(ATTENTION_BACKEND[device_type])
    # The trainer divides by 1000 in fp32 before the model; the model rounds it to bf16 itself.
    timestep = inputs.timestep.to(device_type, torch.float32) / 1000.0
    return recorded_forward(
        model,
        device_type,
        hidden_states=inputs.latents.to(device_type),
        encoder_hidden_states=inputs.text.to(device_type),
        encoder_hidden_states_mask=None,
        timestep=timestep,
        img_shapes=inputs.img_shapes,
        attention_kwargs=None,
        return_dict=False,
    )


def recorded_forward(
    model: nn.Module, device_type: str, **call_kwargs
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`model(**call_kwargs)` under CUDA autocast's policy (emulated off CUDA): its output (a
    1-tuple unpacked) and every module's first output tensor by name (the root is "")."""
    from sglang_train_parity.autocast_emulation import cuda_autocast

    outputs: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module, args, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, torch.Tensor):
                outputs[name] = out.detach().clone()

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules()]
    try:
        # no_grad only saves memory: the trainer's forward under grad runs the same kernels.
        with torch.no_grad(), cuda_autocast(device_type):
            (output,) = model(**call_kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return output, outputs


class Pairing(enum.Enum):
    """How an sglang module's output relates to its diffusers counterpart's (first tensors)."""

    SAME = "same"  # same tensor, shape and dtype: the bitwise target
    RESHAPED = (
        "reshaped"  # same values; sglang flattens leading dims: compare after reshape
    )
    ROUNDED = (
        "rounded"  # reference is fp32 (autocast LayerNorm): compare its bf16 rounding
    )
    DIFFERENT = "different"  # same name, different tensor: not comparable
    SGLANG_ONLY = "sglang_only"  # no diffusers module computes this


class ModulePair(NamedTuple):
    diffusers: str | None
    pairing: Pairing
    note: str = ""


# sglang Qwen-Image DiT module name -> diffusers name; "*" stands for the block index. Names without
# a LoRA wrapper's `.base_layer`. Several modules are in the table although sglang never calls them
# (no hook output): the map covers the module tree, not just what fires.
_S, _R = Pairing.SAME, Pairing.RESHAPED
SGLANG_TO_DIFFUSERS: dict[str, ModulePair] = {
    "": ModulePair("", _S, "model output; diffusers returns it in a 1-tuple"),
    "rotary_emb": ModulePair(
        "pos_embed",
        _S,
        "first = image freqs, complex64; sglang calls it from the pipeline config",
    ),
    "time_text_embed": ModulePair("time_text_embed", _S, "temb"),
    "time_text_embed.time_proj": ModulePair("time_text_embed.time_proj", _S),
    "time_text_embed.timestep_embedder": ModulePair(
        "time_text_embed.timestep_embedder", _S
    ),
    "time_text_embed.timestep_embedder.linear_1": ModulePair(
        "time_text_embed.timestep_embedder.linear_1", _S
    ),
    "time_text_embed.timestep_embedder.act": ModulePair(
        "time_text_embed.timestep_embedder.act", _S
    ),
    "time_text_embed.timestep_embedder.linear_2": ModulePair(
        "time_text_embed.timestep_embedder.linear_2", _S
    ),
    "img_in": ModulePair("img_in", _S),
    "txt_norm": ModulePair("txt_norm", _S),
    "txt_in": ModulePair("txt_in", _S),
    "transformer_blocks": ModulePair("transformer_blocks", _S, "container"),
    "transformer_blocks.*": ModulePair(
        "transformer_blocks.*", _S, "first = text stream; both return (txt, img)"
    ),
    "transformer_blocks.*.img_mod": ModulePair(
        "transformer_blocks.*.img_mod", _S, "sglang calls img_mod[1] on a shared silu"
    ),
    "transformer_blocks.*.img_mod.0": ModulePair("transformer_blocks.*.img_mod.0", _S),
    "transformer_blocks.*.img_mod.1": ModulePair("transformer_blocks.*.img_mod.1", _S),
    "transformer_blocks.*.txt_mod": ModulePair(
        "transformer_blocks.*.txt_mod", _S, "as img_mod"
    ),
    "transformer_blocks.*.txt_mod.0": ModulePair("transformer_blocks.*.txt_mod.0", _S),
    "transformer_blocks.*.txt_mod.1": ModulePair("transformer_blocks.*.txt_mod.1", _S),
    "transformer_blocks.*.img_norm1": ModulePair(
        "transformer_blocks.*.img_norm1",
        Pairing.DIFFERENT,
        "sglang LayerNormScaleShift gives LN(x)*(1+scale)+shift; diffusers gives LN(x)",
    ),
    "transformer_blocks.*.txt_norm1": ModulePair(
        "transformer_blocks.*.txt_norm1", Pairing.DIFFERENT, "as img_norm1"
    ),
    "transformer_blocks.*.img_norm2": ModulePair(
        "transformer_blocks.*.img_norm2",
        Pairing.DIFFERENT,
        "sglang gives (modulated LN(h + gate*attn), h + gate*attn); diffusers gives LN(h)",
    ),
    "transformer_blocks.*.txt_norm2": ModulePair(
        "transformer_blocks.*.txt_norm2", Pairing.DIFFERENT, "as img_norm2"
    ),
    **{
        f"transformer_blocks.*.{norm}.norm": ModulePair(
            f"transformer_blocks.*.{norm}",
            Pairing.ROUNDED,
            "bare LayerNorm; FP32LayerNorm rounds to bf16, CUDA autocast keeps fp32",
        )
        for norm in ("img_norm1", "txt_norm1", "img_norm2", "txt_norm2")
    },
    "transformer_blocks.*.attn": ModulePair(
        "transformer_blocks.*.attn", _S, "first = image stream after to_out"
    ),
    **{
        f"transformer_blocks.*.attn.{proj}": ModulePair(
            f"transformer_blocks.*.attn.{proj}", _S
        )
        for proj in (
            "to_q",
            "to_k",
            "to_v",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_out",
            "to_out.0",
            "to_add_out",
        )
    },
    **{
        f"transformer_blocks.*.attn.{norm}": ModulePair(
            f"transformer_blocks.*.attn.{norm}",
            _R,
            "pre-RoPE, called on [B*S*H, 128]; fused qk-norm/RoPE kernels skip the module",
        )
        for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
    },
    "transformer_blocks.*.attn.to_added_qkv": ModulePair(
        None,
        Pairing.SGLANG_ONLY,
        "upstream's packed text QKV = cat(add_q_proj, add_k_proj, add_v_proj) on the last dim",
    ),
    "transformer_blocks.*.attn.attn": ModulePair(
        None,
        Pairing.SGLANG_ONLY,
        "joint SDPA [B, S_txt+S_img, H, 128]; diffusers calls dispatch_attention_fn",
    ),
    "transformer_blocks.*.fuse_mul_add": ModulePair(
        None, Pairing.SGLANG_ONLY, "residual h + gate*mlp, inline in diffusers"
    ),
    "transformer_blocks.*.fused_ln_ss_gate_select01": ModulePair(
        None, Pairing.SGLANG_ONLY, "zero_cond_t models only"
    ),
    "transformer_blocks.*.fused_res_ln_ss_gate_select01": ModulePair(
        None, Pairing.SGLANG_ONLY, "zero_cond_t models only"
    ),
    **{
        f"transformer_blocks.*.{mlp}{part}": ModulePair(
            f"transformer_blocks.*.{mlp}{part}", _S
        )
        for mlp in ("img_mlp", "txt_mlp")
        for part in ("", ".net", ".net.0", ".net.0.proj", ".net.1", ".net.2")
    },
    "norm_out": ModulePair(
        "norm_out", _S, "sglang calls its children instead (except under compile)"
    ),
    "norm_out.silu": ModulePair("norm_out.silu", _S),
    "norm_out.linear": ModulePair("norm_out.linear", _S),
    "norm_out.norm": ModulePair(
        "norm_out.norm", Pairing.ROUNDED, "bare LayerNorm; fp32 under CUDA autocast"
    ),
    "proj_out": ModulePair("proj_out", _S),
}
def sglang_to_diffusers(name: str, lora: bool = True) -> ModulePair:
    """The diffusers counterpart of the sglang Qwen-Image module `name`: `paired_name`."""
    return paired_name(
        name, lora, SGLANG_TO_DIFFUSERS, "transformer_blocks", LORA_TARGETS
    )


def paired_name(
    name: str,
    lora: bool,
    table: dict[str, ModulePair],
    blocks: str,
    targets: tuple[str, ...],
) -> ModulePair:
    """The diffusers counterpart of the sglang module `name` in a family's `table` (KeyError for a
    module the table does not know); "*" in it stands for the index in the `blocks` container.
    sglang's `*WithLoRA` wrappers keep the wrapped layer as
    `.base_layer`, as PEFT does: a wrapper pairs with the PEFT layer, its `base_layer` with PEFT's
    `base_layer` when `lora` (the reference carries adapters) and the module is a LoRA target,
    otherwise with the plain Linear (sglang wraps every Linear, PEFT only the targets)."""
    is_base = name.endswith(".base_layer")
    stripped = name.replace(".base_layer", "")
    block_index = re.compile(rf"^{re.escape(blocks)}\.(\d+)")
    match = block_index.match(stripped)
    key = block_index.sub(f"{blocks}.*", stripped)
    pair = table[key]
    if pair.diffusers is None:
        return pair
    diffusers = pair.diffusers
    if match:
        diffusers = diffusers.replace("*", match.group(1), 1)
    if is_base and lora and is_lora_target(diffusers, targets):
        diffusers += ".base_layer"
    return pair._replace(diffusers=diffusers)
