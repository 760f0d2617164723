"""Shared plumbing for benchmark/gpu_parity*.py and benchmark/speed.py (the closest default path
that runs here, for `numerics="default"`, is benchmark/default_path.py).

* process setup (stand-ins for `sgl_kernel`, single-process distributed env, JIT policy);
* a Qwen-Image model folder with random weights (diffusers format), and the fork's DiT loaded from it
  through sglang's real transformer loader (`PipelineComponentLoader` + `TransformerLoader`);
* LoRA into the fork the way the post-training weight updater puts it there;
* versions of everything that matters.

Import this module before torch is used: `setup()` sets environment variables that torch / sglang read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the server harness's sitecustomize appends it instead
    sys.path.insert(0, str(REPO))

from benchmark import gpu_standins  # noqa: E402

# Real Qwen-Image DiT widths (diffusers config of Qwen/Qwen-Image), num_layers set per run.
REAL_CONFIG = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    axes_dims_rope=(16, 56, 56),
)
# CPU dry runs: the same structure, small widths (head_dim stays 128: the RoPE axes need it).
TINY_CONFIG = dict(
    REAL_CONFIG, num_layers=2, num_attention_heads=2, joint_attention_dim=64
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


def setup(device: str, jit: str = "off") -> None:
    """Process setup; call before importing sglang.

    device "cuda": stand-ins for the two packages the H200 image lacks (calls fail loudly).
    device "cpu": the three CPU sgl_kernel ops upstream's default CPU norm path calls, as the CPU tests
    register them (sglang_train_parity.cpu_kernels), and torch.compile off (as the CPU tests run).
    jit "off": sglang's nvcc-at-first-use JIT kernels are not built (SGLANG_CRASH_ON_JIT_COMPILE=1:
    a load raises, upstream's can_use_* predicates then pick their unfused branch).
    """
    gpu_standins.install()
    if jit == "off":
        os.environ["SGLANG_CRASH_ON_JIT_COMPILE"] = "1"
    if device == "cpu":
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        from sglang_train_parity.cpu_kernels import register_cpu_kernels

        register_cpu_kernels()
    else:
        # upstream compiles several default-path forwards; leave torch.compile as upstream runs it
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "0")


# ----------------------------------------------------------------------------------------------
# model folder with random weights
# ----------------------------------------------------------------------------------------------


def randomize_(model, seed: int, device) -> None:
    """Every parameter random, at a realistic scale: Linear weights N(0, 1/fan_in), biases
    N(0, 0.02), norm weights U(0.8, 1.2) (default init zeroes some tensors, which hides paths).
    """
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _fill_random_(name, param, generator)


def _fill_random_(name: str, tensor, generator) -> None:
    """`randomize_`'s scale for the parameter `name`, drawn into `tensor`."""
    if name.endswith("weight") and "norm" in name:
        tensor.uniform_(0.8, 1.2, generator=generator)
    elif name.endswith("weight") and tensor.dim() == 2:
        tensor.normal_(0.0, 1.0 / math.sqrt(tensor.shape[1]), generator=generator)
    else:
        tensor.normal_(0.0, 0.02, generator=generator)


def write_model_dir(root: Path, config: dict, seed: int, device: str) -> Path:
    """A Qwen-Image model folder (sglang detects the family from the name and model_index.json)
    whose transformer is a random diffusers `QwenImageTransformer2DModel` saved in bf16.
    """
    import torch
    from diffusers import QwenImageTransformer2DModel

    root.mkdir(parents=True, exist_ok=True)
    with torch.device(device):
        model = QwenImageTransformer2DModel(**config)
    randomize_(model, seed, device)
    model.to(device="cpu", dtype=torch.bfloat16).save_pretrained(root / "transformer")
    del model
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=1))
    for component in ("scheduler", "vae", "text_encoder", "tokenizer"):
        (root / component).mkdir(exist_ok=True)
    return root


def write_config_only_model_dir(
    root: Path,
    config: dict,
    model_cls: str = "QwenImageTransformer2DModel",
    model_index: dict = MODEL_INDEX,
) -> Path:
    """A model folder whose transformer (diffusers' `model_cls`) has the config and one tiny
    safetensors file, for loading through the real loader with generated weights
    (`random_weights_iterator`)."""
    import diffusers
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = getattr(diffusers, model_cls)(**config)
    model.save_config(root / "transformer")
    name, param = min(model.named_parameters(), key=lambda item: item[1].numel())
    save_file(
        {name: torch.zeros(param.shape, dtype=torch.bfloat16)},
        str(root / "transformer" / "diffusion_pytorch_model.safetensors"),
    )
    (root / "model_index.json").write_text(json.dumps(model_index, indent=1))
    for component in ("scheduler", "vae", "text_encoder", "tokenizer"):
        (root / component).mkdir(exist_ok=True)
    return root


def random_weights_iterator(
    config: dict, seed: int, device, model_cls: str = "QwenImageTransformer2DModel"
) -> Iterator[tuple[str, Any]]:
    """(diffusers name, bf16 tensor) for every parameter of diffusers' `model_cls` that `config`
    describes, generated on `device` one at a time, at `randomize_`'s scales."""
    import diffusers
    import torch

    with torch.device("meta"):
        reference = getattr(diffusers, model_cls)(**config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in reference.named_parameters():
        t = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
        _fill_random_(name, t, generator)
        yield name, t


# ----------------------------------------------------------------------------------------------
# the fork's DiT through sglang's real loader
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def generated_weights(
    config: dict, seed: int, device, model_cls: str = "QwenImageTransformer2DModel"
):
    """Inside: the transformer loader reads its weights from `random_weights_iterator` instead of
    the folder's safetensors (the loader's own `weights_iterator` argument; everything else,
    construction, name mapping, post-load processing, is the loader's)."""
    from sglang.multimodal_gen.runtime.loader.component_loaders.transformer_loader import (
        TransformerLoader,
    )

    original = TransformerLoader.load_state_dict_model

    def load_state_dict_model(self, *args, **kwargs):
        if kwargs.get("weights_iterator") is None:
            kwargs["weights_iterator"] = random_weights_iterator(
                config, seed, device, model_cls
            )
        return original(self, *args, **kwargs)

    TransformerLoader.load_state_dict_model = load_state_dict_model
    try:
        yield
    finally:
        TransformerLoader.load_state_dict_model = original


def load_fork_dit(model_dir: Path, **server_kwargs):
    """The fork's DiT through sglang's real loader (train_parity.sglang_dit.load_dit) with extra
    ServerArgs (numerics, train_parity_rope_tables, attention_backend); it stays on the device.
    """
    import torch
    from sglang_train_parity.sglang_dit import load_dit

    from sglang.multimodal_gen.runtime.server_args import get_global_server_args

    model = load_dit(
        model_dir,
        dit_cpu_offload=False,
        text_encoder_cpu_offload=False,
        **server_kwargs,
    )
    devices = {p.device.type for p in model.parameters()}
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    if devices != {expected}:
        raise RuntimeError(f"DiT parameters on {devices}, expected all on {expected}")
    return model, get_global_server_args()


# ----------------------------------------------------------------------------------------------
# LoRA
# ----------------------------------------------------------------------------------------------


def push_lora_any(
    model, state: dict, rank: int, alpha: float, merge: bool, dtype=None
) -> int:
    """The weight updater's IPC path (post_training/weights_updater.py): plain targets get their
    pair; sections of a fused layer (default numerics packs add_q/k/v_proj into `to_added_qkv`)
    are stacked with `stack_or_compose_fused_lora`. Returns the number of layers set."""
    from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import (
        stack_or_compose_fused_lora,
    )

    fused: dict[str, dict[int, tuple]] = {}
    count = 0
    sections = {"add_q_proj": 0, "add_k_proj": 1, "add_v_proj": 2}
    for key in sorted(k for k in state if k.endswith(".lora_A.weight")):
        prefix = key.removesuffix(".lora_A.weight")
        a, b = state[key], state[f"{prefix}.lora_B.weight"]
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        try:
            layer = model.get_submodule(prefix)
        except AttributeError:
            parent, _, leaf = prefix.rpartition(".")
            if leaf not in sections:
                raise
            fused.setdefault(f"{parent}.to_added_qkv", {})[sections[leaf]] = (a, b)
            continue
        layer.lora_rank, layer.lora_alpha = rank, alpha
        layer.set_lora_weights(a, b, merge_weights=merge, clear_existing=True)
        count += 1
    for name, parts in fused.items():
        layer = model.get_submodule(name)
        idx = sorted(parts)
        a, b, fused_alpha = stack_or_compose_fused_lora(
            [parts[i][0] for i in idx], [parts[i][1] for i in idx], alpha
        )
        if fused_alpha is not None:
            layer.lora_rank = layer.lora_alpha = fused_alpha
        else:
            layer.lora_rank, layer.lora_alpha = int(a.shape[-2]), alpha
        layer.set_lora_weights(a, b, merge_weights=merge, clear_existing=True)
        count += len(parts)
    return count


def dispatch_table(model) -> dict[str, int]:
    """CustomOp class.forward method -> instance count, as constructed."""
    from collections import Counter

    from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp

    counts: Counter = Counter()
    for _, module in model.named_modules():
        if isinstance(module, CustomOp):
            method = getattr(module._forward_method, "__name__", "?")
            counts[f"{type(module).__name__}.{method}"] += 1
    return dict(sorted(counts.items()))


# ----------------------------------------------------------------------------------------------
# versions
# ----------------------------------------------------------------------------------------------


def versions() -> dict:
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": (
            torch.backends.cudnn.version()
            if torch.backends.cudnn.is_available()
            else None
        ),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "allow_bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "SGLANG_CRASH_ON_JIT_COMPILE": os.environ.get("SGLANG_CRASH_ON_JIT_COMPILE"),
        "TORCH_COMPILE_DISABLE": os.environ.get("TORCH_COMPILE_DISABLE"),
    }
    for dist in (
        "sglang",
        "diffusers",
        "peft",
        "transformers",
        "triton",
        "apache-tvm-ffi",
    ):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    try:
        import sglang

        info["sglang_file"] = sglang.__file__
    except Exception:  # noqa: BLE001
        pass
    if torch.cuda.is_available():
        try:
            import subprocess

            info["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                text=True,
            ).strip()
        except Exception:  # noqa: BLE001
            pass
    info["standin_modules"] = gpu_standins.modules_created()
    return info


def captured(body):
    """A CUDA graph of ``body()``, run once on a side stream first, as capture
    requires."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def format_exc() -> str:
    return traceback.format_exc()[-4000:]
