# SPDX-License-Identifier: Apache-2.0
"""The sglang side of a parity check: a Qwen-Image DiT loaded through sglang's real transformer
loader in this process, LoRA put in as the post-training weight updater does, one forward with
every module's output recorded."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # imports of upstream modules stay inside the functions, so this file
    # also runs against a pristine upstream sglang (the tests' negative controls)
    from sglang_train_parity.reference import QwenDiTInputs


def init_single_process(device: str = "cpu") -> None:
    """sglang's parallel state for one process (gloo on CPU)."""
    from sglang.multimodal_gen.runtime.distributed.parallel_state import (
        maybe_init_distributed_environment_and_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    # assigned, not defaulted: a parent process's MASTER_PORT is its own store's
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    maybe_init_distributed_environment_and_model_parallel(tp_size=1, sp_size=1)


def load_dit(
    model_dir: Path,
    model_id: str = "Qwen-Image",
    component: str = "transformer",
    **server_kwargs,
) -> nn.Module:
    """The DiT `component` of the diffusers-layout `model_dir`, served as `model_id`, built for
    `server_kwargs` (e.g. numerics)."""
    from sglang.multimodal_gen.runtime.loader.component_loaders.component_loader import (
        PipelineComponentLoader,
    )
    from sglang.multimodal_gen.runtime.loader.component_loaders.transformer_loader import (
        TransformerLoader,
    )
    from sglang.multimodal_gen.runtime.server_args import (
        ServerArgs,
        set_global_server_args,
    )

    server_args = ServerArgs.from_kwargs(
        model_path=str(model_dir), model_id=model_id, num_gpus=1, **server_kwargs
    )
    set_global_server_args(server_args)
    init_single_process()
    loaded = PipelineComponentLoader.load_component(
        component_name=component,
        component_model_path=str(Path(model_dir) / component),
        transformers_or_diffusers="diffusers",
        server_args=server_args,
        loader_cls=TransformerLoader,  # no silent fallback to the diffusers model
    )
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    return model.eval()


def wrap_linears_for_lora(model: nn.Module, numerics: str) -> None:
    """What LoRAPipeline.convert_module_lora_layers does on the first LoRA update: every
    supported Linear wrapped, in the DiT's numerics mode."""
    from sglang.multimodal_gen.runtime.layers.lora.linear import (
        replace_submodule,
        wrap_with_lora_layer,
    )
    from sglang.multimodal_gen.runtime.utils.train_parity import numerics_mode_context

    for name, layer in list(model.named_modules()):
        with numerics_mode_context(numerics):
            wrapped = wrap_with_lora_layer(layer)
        if wrapped is not None:
            replace_submodule(model, name, wrapped)


def push_lora(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    rank: int,
    alpha: int,
    merge: bool = False,
) -> None:
    """The weight updater's per-layer step for PEFT-named A/B pairs (fp32 masters or bf16), each
    addressed as the updater resolves a trainer's module name (the model's name mappings)."""
    from sglang.multimodal_gen.runtime.layers.lora.linear import BaseLayerWithLoRA
    from sglang.multimodal_gen.runtime.post_training.weights_updater import (
        _resolve_lora_ipc_layer_dict_key,
    )

    lora_layers = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, BaseLayerWithLoRA)
    }
    for key in sorted(k for k in state if k.endswith(".lora_A.weight")):
        prefix = key.removesuffix(".lora_A.weight")
        layer, _, _ = _resolve_lora_ipc_layer_dict_key(prefix, lora_layers, model)
        if layer is None:
            raise KeyError(f"no LoRA layer of the model takes {prefix}")
        layer.lora_rank, layer.lora_alpha = rank, alpha
        layer.set_lora_weights(
            state[key],
            state[f"{prefix}.lora_B.weight"],
            merge_weights=merge,
            clear_existing=True,
        )


def record_outputs(model: nn.Module, outputs: dict[str, torch.Tensor], names=None) -> list:
    """Forward hooks storing each module's first output tensor, by module name ("" = root);
    only the modules in `names` when given."""

    def record(name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, torch.Tensor):
                outputs.setdefault(name, out.detach().clone())

        return hook

    return [
        m.register_forward_hook(record(n))
        for n, m in model.named_modules()
        if names is None or n in names
    ]


def recorded_call(model: nn.Module, record=None, **call_kwargs) -> dict[str, torch.Tensor]:
    """`model(**call_kwargs)` as a denoising stage calls a DiT (no autograd, in a forward
    context), every module's output recorded by name ("" = the output); only the modules named
    in `record` when given (a hook can change a module's path: a LoRA base layer with a hook
    keeps its GEMM out of the kernel that adds the update)."""
    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    outputs: dict[str, torch.Tensor] = {}
    handles = record_outputs(model, outputs, record)
    try:
        with torch.no_grad(), set_forward_context(
            current_timestep=0, attn_metadata=None, forward_batch=None
        ):
            outputs[""] = model(**call_kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def run_dit(
    model: nn.Module, inputs: "QwenDiTInputs", device: str = "cpu"
) -> torch.Tensor:
    """One forward as sglang's denoising stage makes it (hooks on `model` see every module)."""
    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
        QwenImagePipelineConfig,
    )
    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    batch, txt_len = inputs.text.shape[:2]
    # the pipeline config calls the model's rotary_emb
    freqs_cis, freqs_complex = QwenImagePipelineConfig.get_freqs_cis(
        inputs.img_shapes,
        [txt_len] * batch,
        model.rotary_emb,
        torch.device(device),
        torch.bfloat16,
    )
    with torch.no_grad(), set_forward_context(
        current_timestep=0, attn_metadata=None, forward_batch=None
    ):
        return model(
            hidden_states=inputs.latents.to(device, torch.bfloat16),
            encoder_hidden_states=inputs.text.to(device),
            encoder_hidden_states_mask=None,
            timestep=inputs.timestep.to(device),
            img_shapes=inputs.img_shapes,
            txt_seq_lens=[txt_len] * batch,
            freqs_cis=freqs_cis,
            freqs_complex=freqs_complex,
        )


def sglang_forward(
    model: nn.Module, inputs: "QwenDiTInputs", device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """`run_dit` with every module's output recorded by name ("" = the output)."""
    outputs: dict[str, torch.Tensor] = {}
    handles = record_outputs(model, outputs)
    try:
        outputs[""] = run_dit(model, inputs, device)
    finally:
        for handle in handles:
            handle.remove()
    return outputs
