"""benchmark/speed.py's inputs and step functions for the video families: Wan (the fork's DiT and
diffusers + PEFT, CFG as two forwards) and LTX-2 (the fork's DiT and ltx-core + PEFT, the
trainer's forward, one unguided forward per step).
"""

from __future__ import annotations

from benchmark import gpu_common
from benchmark.speed_families import (
    CFG_SCALE,
    LORA_ALPHA,
    LORA_RANK,
    WAN_TEXT_LEN,
    gpu_lora_state,
    timesteps_for,
)


def wan_inputs(config: dict, clip: tuple[int, int, int], device):
    """Latents [1, C, F', H', W'] (VAE stride 4 in time, 8 in space) and per-branch T5 embeds
    [1, 512, text_dim] bf16, zero-padded after WAN_TEXT_LEN tokens."""
    import torch

    g = torch.Generator(device=device).manual_seed(7)
    frames, height, width = clip
    latents = torch.randn(
        1,
        config["in_channels"],
        (frames - 1) // 4 + 1,
        height // 8,
        width // 8,
        generator=g,
        device=device,
    )
    text = {}
    for branch, length in WAN_TEXT_LEN.items():
        t = torch.randn(1, 512, config["text_dim"], generator=g, device=device)
        t[:, length:] = 0
        text[branch] = t.bfloat16()
    return latents, text


def wan_fork_step_fn(model, config, clip, device):
    import torch

    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    latents, text = wan_inputs(config, clip, device)
    latents = latents.bfloat16()
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), set_forward_context(
            current_timestep=i, attn_metadata=None, forward_batch=None
        ):
            outs = {
                k: model(
                    hidden_states=latents, encoder_hidden_states=t, timestep=ts[i % 64]
                )
                for k, t in text.items()
            }
        return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def build_wan_diffusers(config: dict, device: str):
    """diffusers' Wan DiT + PEFT with the fork variants' weights and LoRA (same draws), every
    parameter bf16, the RoPE buffers fp32 as diffusers builds them."""
    import torch
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
    from sglang_train_parity import wan
    from sglang_train_parity.reference import inject_lora

    with torch.device("meta"):
        model = WanTransformer3DModel(**config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    gpu_common.randomize_(model, 0, device)
    model.rope = WanRotaryPosEmbed(
        config["attention_head_dim"], config["patch_size"], config["rope_max_seq_len"]
    ).to(device)
    state = gpu_lora_state(config, LORA_RANK, LORA_ALPHA, device, family="wan")
    inject_lora(model, state, LORA_RANK, LORA_ALPHA, wan.LORA_TARGETS)
    del state
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    backend = "_native_flash" if device == "cuda" else "native"
    model.eval().set_attention_backend(backend)
    return model, {"attention_backend": backend}


def wan_diffusers_step_fn(model, config, clip, device):
    import torch
    from sglang_train_parity.autocast_emulation import cuda_autocast

    latents, text = wan_inputs(config, clip, device)
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), cuda_autocast(device):
            outs = {
                k: model(
                    hidden_states=latents,
                    encoder_hidden_states=t,
                    timestep=ts[i % 64],
                    return_dict=False,
                )[0]
                for k, t in text.items()
            }
            return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def ltx2_inputs(config: dict, clip: tuple[int, int, int], device):
    from sglang_train_parity.ltx2 import LTX2DiTInputs, audio_tokens, latent_grid

    from benchmark.gpu_parity_ltx2 import TEXT_TOKENS

    frames, height, width = clip
    inputs = LTX2DiTInputs.random(
        1, latent_grid(*clip), audio_tokens(frames), TEXT_TOKENS, config, 999.0, seed=7
    )
    for field in ("latents", "audio_latents", "text"):
        setattr(inputs, field, getattr(inputs, field).to(device))
    return inputs


def ltx2_fork_step_fn(model, config, clip, device):
    """One unguided forward per step, as the denoising stage calls the DiT: under train_parity
    without the audio-video cross-attention, the default path with it and the prompt K/V
    projected once per request."""
    import torch
    from sglang_train_parity.ltx2 import FPS

    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    inputs = ltx2_inputs(config, clip, device)
    frames, height, width = inputs.grid
    call = dict(
        hidden_states=inputs.latents.bfloat16(),
        audio_hidden_states=inputs.audio_latents.bfloat16(),
        encoder_hidden_states=inputs.text,
        audio_encoder_hidden_states=inputs.text,
        num_frames=frames,
        height=height,
        width=width,
        fps=FPS,
        audio_num_frames=inputs.audio_latents.shape[1],
        return_latents=False,
    )
    if model.train_parity:
        call.update(disable_a2v_cross_attn=True, disable_v2a_cross_attn=True)
    else:
        key = model.prepare_prompt_kv(inputs.text, inputs.text)
        call.update(
            encoder_hidden_states=None,
            audio_encoder_hidden_states=None,
            cached_prompt_kv=key,
        )
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), set_forward_context(
            current_timestep=i, attn_metadata=None, forward_batch=None
        ):
            return model(**call, timestep=ts[i % 64])[0]

    return step


def build_ltx2_reference(config: dict, device: str):
    """ltx-core's LTXModel + PEFT with the fork variants' weights and LoRA (same draws), every
    parameter bf16."""
    import diffusers
    import torch
    from sglang_train_parity import ltx2
    from sglang_train_parity.reference import inject_lora

    with torch.device("meta"):
        full_config = dict(diffusers.LTX2VideoTransformer3DModel(**config).config)
        model = ltx2.ltx_core_model(full_config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in gpu_common.random_weights_iterator(
            config, 0, device, "LTX2VideoTransformer3DModel"
        ):
            params.pop(ltx2.ltx_core_name(name)).copy_(tensor)
    if params:
        raise RuntimeError(
            f"ltx-core parameters without a weight: {sorted(params)[:4]}"
        )
    state = gpu_lora_state(config, LORA_RANK, LORA_ALPHA, device, family="ltx-2")
    inject_lora(model, state, LORA_RANK, LORA_ALPHA, ltx2.LORA_TARGETS)
    del state
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model.eval(), {"attention": "SDPA math"}


def ltx2_reference_step_fn(model, config, clip, device):
    """The trainer's step: the video stream alone, under CUDA autocast, SDPA math."""
    import torch
    from sglang_train_parity.autocast_emulation import cuda_autocast
    from sglang_train_parity.ltx2 import trainer_modalities
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inputs = ltx2_inputs(config, clip, device)
    ts = timesteps_for(64, device)

    def step(i):
        inputs.timestep = ts[i % 64]
        video, _ = trainer_modalities(inputs, device)
        with torch.no_grad(), cuda_autocast(device), sdpa_kernel(SDPBackend.MATH):
            return model(video=video, audio=None, perturbations=None)[0]

    return step
