"""benchmark/speed.py's models and CFG steps for Qwen-Image and Qwen-Image 2.1: the benchmark's
constants and per-family specs, the LoRA state drawn on the device, the fork's DiT built through
sglang's loader (`build_fork`), and each variant's step function (the fork's, and the trainer's
forward: diffusers + PEFT under autocast).
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmark import default_path, gpu_common

LORA_RANK, LORA_ALPHA = 64, 128
CFG_SCALE = 4.0
TXT_LEN = {"cond": 211, "uncond": 77}
TXT_LEN_TINY = {"cond": 13, "uncond": 7}
# Wan: T5 tokens before the zero padding to 512
WAN_TEXT_LEN = {"cond": 35, "uncond": 120}
WAN_CLIP, WAN_CLIP_TINY = (81, 480, 832), (5, 48, 64)
FAMILY_SPECS = {
    "qwen-image": {
        "model_cls": "QwenImageTransformer2DModel",
        "targets": None,  # filled in main (sglang_train_parity.reference.LORA_TARGETS)
        "default_layers": 60,
    },
    "qwen-image-2.1": {
        "model_cls": "QwenImage21Transformer2DModel",
        "targets": None,  # sglang_train_parity.qwen_image21.LORA_TARGETS
        "default_layers": 32,
        "model_id": "Qwen-Image-2.1",
        "model_index": {
            "_class_name": "QwenImage21Pipeline",
            "_diffusers_version": "0.42.1",
            "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
        },
    },
    "ltx-2": {
        "model_cls": "LTX2VideoTransformer3DModel",
        "targets": None,  # sglang_train_parity.ltx2.LORA_TARGETS
        "default_layers": 48,
        "model_id": "LTX-2",
        "model_index": {
            "_class_name": "LTX2Pipeline",
            "_diffusers_version": "0.42.1",
            "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
        },
    },
    "wan": {
        "model_cls": "WanTransformer3DModel",
        "targets": None,  # sglang_train_parity.wan.LORA_TARGETS
        "default_layers": 40,
        "model_id": "Wan2.1-T2V-14B-Diffusers",
        "model_index": {
            "_class_name": "WanPipeline",
            "_diffusers_version": "0.42.1",
            "transformer": ["diffusers", "WanTransformer3DModel"],
        },
    },
}


def gpu_lora_state(
    config: dict,
    rank: int,
    alpha: float,
    device,
    seed: int = 0,
    family: str = "qwen-image",
) -> dict:
    """train_parity.reference.random_lora_state's distribution, generated on the device."""
    import diffusers
    import torch
    from sglang_train_parity.reference import _LORA_DELTA_GAIN, is_lora_target
    from torch import nn

    spec = FAMILY_SPECS[family]
    with torch.device("meta"):
        meta = getattr(diffusers, spec["model_cls"])(**config)
    g = torch.Generator(device=device).manual_seed(seed)
    scaling = alpha / rank
    state = {}
    for name, module in meta.named_modules():
        if is_lora_target(name, spec["targets"]) and isinstance(module, nn.Linear):
            a = torch.randn(rank, module.in_features, generator=g, device=device)
            b = torch.randn(module.out_features, rank, generator=g, device=device)
            state[f"{name}.lora_A.weight"] = a / math.sqrt(module.in_features)
            state[f"{name}.lora_B.weight"] = b * (_LORA_DELTA_GAIN / (rank * scaling))
    return state


def make_inputs(config: dict, grid: tuple[int, int], txt: dict, device, batch: int = 1):
    import torch

    g = torch.Generator(device=device).manual_seed(7)
    h, w = grid
    latents = torch.randn(
        batch, h * w, config["in_channels"], generator=g, device=device
    )
    text = {
        k: torch.randn(
            batch, n, config["joint_attention_dim"], generator=g, device=device
        ).bfloat16()
        for k, n in txt.items()
    }
    return latents, text, [[(1, h, w)]] * batch


def timesteps_for(n: int, device):
    import torch

    # a scheduler's descending fp32 timesteps on sglang's 0..1000 scale, one tensor per step
    return [torch.tensor([1000.0 * (1 - i / (n + 1))], device=device) for i in range(n)]


def build_fork(
    numerics: str,
    config: dict,
    model_dir: Path,
    device: str,
    harness=None,
    family: str = "qwen-image",
):
    import importlib

    import torch
    from sglang_train_parity.sglang_dit import push_lora, wrap_linears_for_lora

    spec = FAMILY_SPECS[family]
    kwargs = {"numerics": numerics}
    if "model_id" in spec:
        kwargs["model_id"] = spec["model_id"]
    if numerics == "default" and device == "cuda":
        kwargs["attention_backend"] = "torch_sdpa"
    with gpu_common.generated_weights(config, 0, device, spec["model_cls"]):
        model, _ = gpu_common.load_fork_dit(model_dir, **kwargs)
    wrap_linears_for_lora(model, numerics)
    state = gpu_lora_state(config, LORA_RANK, LORA_ALPHA, device, family=family)
    info = {"server_args": kwargs}
    if numerics == "train_parity":
        push_lora(model, state, LORA_RANK, LORA_ALPHA, merge=False)
    elif family != "qwen-image":  # no fused LoRA targets in these default DiTs
        bf16 = {name: t.to(torch.bfloat16) for name, t in state.items()}
        push_lora(model, bf16, LORA_RANK, LORA_ALPHA, merge=False)
    else:
        info["lora_layers_set"] = gpu_common.push_lora_any(
            model, state, LORA_RANK, LORA_ALPHA, merge=False, dtype=torch.bfloat16
        )
    if numerics == "default":
        default_path.mount_default_quality(model)
        dit_module = importlib.import_module(type(model).__module__)
        harness.install(model, dit_module)
    del state
    info["dispatch"] = gpu_common.dispatch_table(model)
    return model, info


def fork_step_fn(model, config, grid, txt, device, batch=1):
    """One CFG step of the fork's DiT, its cond and uncond forwards run as the
    denoising stage runs them (``run_cfg_branches``: at once on two streams where
    the DiT replays CUDA graphs)."""
    import torch

    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
        QwenImagePipelineConfig,
    )
    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )
    from sglang.multimodal_gen.runtime.utils import train_parity_graphs

    latents, text, img_shapes = make_inputs(config, grid, txt, device, batch)
    latents = latents.bfloat16()
    freqs = {
        k: QwenImagePipelineConfig.get_freqs_cis(
            img_shapes,
            [t.shape[1]] * batch,
            model.rotary_emb,
            torch.device(device),
            torch.bfloat16,
        )
        for k, t in text.items()
    }
    ts = timesteps_for(64, device)

    def forward(k, t):
        return model(
            hidden_states=latents,
            encoder_hidden_states=text[k],
            encoder_hidden_states_mask=None,
            timestep=t,
            img_shapes=img_shapes,
            txt_seq_lens=[text[k].shape[1]] * batch,
            freqs_cis=freqs[k][0],
            freqs_complex=freqs[k][1],
        )

    def step(i):
        t = ts[i % len(ts)].expand(batch).contiguous()
        with torch.no_grad(), set_forward_context(
            current_timestep=i, attn_metadata=None, forward_batch=None
        ):
            cond, uncond = train_parity_graphs.run_cfg_branches(
                model, lambda k: forward(k, t), ("cond", "uncond")
            )
        return uncond + CFG_SCALE * (cond - uncond)

    return step


def build_diffusers(config: dict, device: str):
    import torch
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from sglang_train_parity.reference import (
        ADAPTER,
        LORA_TARGETS,
        _rebuild_rope_tables,
    )

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    gpu_common.randomize_(model, 0, device)
    _rebuild_rope_tables(model.pos_embed, torch.device(device))
    lora_config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        init_lora_weights="gaussian",
    )
    inject_adapter_in_model(lora_config, model, adapter_name=ADAPTER)
    state = gpu_lora_state(config, LORA_RANK, LORA_ALPHA, device)
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    del state
    model = model.to(dtype=torch.bfloat16).eval()
    model.set_attention_backend("_native_flash" if device == "cuda" else "native")
    return model, {
        "attention_backend": "_native_flash" if device == "cuda" else "native"
    }


def diffusers_step_fn(model, config, grid, txt, device, batch=1):
    import torch
    from sglang_train_parity.autocast_emulation import cuda_autocast

    latents, text, img_shapes = make_inputs(config, grid, txt, device, batch)
    ts = timesteps_for(64, device)

    def step(i):
        t = (ts[i % len(ts)] / 1000.0).expand(batch)
        outs = {}
        with torch.no_grad(), cuda_autocast(device):
            for k in ("cond", "uncond"):
                (outs[k],) = model(
                    hidden_states=latents,
                    encoder_hidden_states=text[k],
                    encoder_hidden_states_mask=None,
                    timestep=t,
                    img_shapes=img_shapes,
                    return_dict=False,
                )
            return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def qwen21_inputs(config: dict, grid: tuple[int, int], device):
    """Latents [1, H*W, C] and per-branch text embeds [1, TXT_LEN, D] bf16."""
    import torch

    g = torch.Generator(device=device).manual_seed(7)
    h, w = grid
    latents = torch.randn(1, h * w, config["in_channels"], generator=g, device=device)
    text = {
        k: torch.randn(
            1, n, config["context_in_dim"], generator=g, device=device
        ).bfloat16()
        for k, n in TXT_LEN.items()
    }
    return latents, text


def qwen21_fork_step_fn(model, config, grid, device):
    import torch

    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )
    from sglang.multimodal_gen.runtime.models.dits.qwen_image21 import build_layout

    latents, text = qwen21_inputs(config, grid, device)
    latents = latents.bfloat16()
    layouts = {
        k: [
            build_layout(
                [False] * t.shape[1], [(1, *grid)], config["axes_dims_rope"], device
            )
        ]
        for k, t in text.items()
    }
    # the default path fills its prefix K/V at the first step and reuses them for the request
    caches = {
        k: None if model.train_parity else [[{} for _ in range(config["num_layers"])]]
        for k in text
    }
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), set_forward_context(
            current_timestep=i, attn_metadata=None, forward_batch=None
        ):
            outs = {
                k: model(
                    hidden_states=latents,
                    encoder_hidden_states=t,
                    timestep=ts[i % 64],
                    layouts=layouts[k],
                    prefix_caches=caches[k],
                )
                for k, t in text.items()
            }
        return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def build_qwen21_diffusers(config: dict, device: str):
    """diffusers' Qwen-Image 2.1 DiT + PEFT with the fork variants' weights and LoRA (same draws),
    every parameter bf16; RoPE tables built on the device (as the fork's default), the timestep
    frequencies on the CPU (as diffusers' __init__)."""
    import torch
    from diffusers import QwenImage21Transformer2DModel
    from sglang_train_parity import qwen_image21
    from sglang_train_parity.reference import inject_lora

    with torch.device("meta"):
        model = QwenImage21Transformer2DModel(**config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    gpu_common.randomize_(model, 0, device)
    qwen_image21._rebuild_rope_tables(model.pos_embed, torch.device(device))
    time_proj = model.time_text_embed.time_proj
    half = time_proj.freqs.numel()
    steps = torch.arange(start=0, end=half, dtype=torch.float32)
    time_proj.freqs = torch.exp(-math.log(10000) * steps / half).to(device)
    state = gpu_lora_state(
        config, LORA_RANK, LORA_ALPHA, device, family="qwen-image-2.1"
    )
    inject_lora(model, state, LORA_RANK, LORA_ALPHA, qwen_image21.LORA_TARGETS)
    del state
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    model.eval().set_attention_backend("native")
    return model, {"attention_backend": "native"}


def qwen21_diffusers_step_fn(model, config, grid, device):
    import torch
    from sglang_train_parity.autocast_emulation import cuda_autocast

    latents, text = qwen21_inputs(config, grid, device)
    n = latents.shape[1]
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), cuda_autocast(device):
            outs = {}
            for k, t in text.items():
                img_mask = torch.zeros(
                    1, t.shape[1] + n // 4, dtype=torch.bool, device=device
                )
                img_mask[:, t.shape[1] :] = True
                outs[k] = model(
                    hidden_states=latents,
                    encoder_hidden_states=t,
                    timestep=ts[i % 64] / 1000,
                    img_shapes=[[(1, *grid)]],
                    img_mask=img_mask,
                    return_dict=False,
                )[0][:, -n:]
            return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step
