"""Model-level parity run: the fork's Qwen-Image DiT (loaded through sglang's real loader) against
diffusers + PEFT under CUDA's autocast policy (emulated on CPU), every paired module compared.

    python tests/qwen_parity_run.py MODEL_DIR OUT.json --numerics train_parity [--updates 3]

LoRA goes into the sglang model the way the post-training weight updater puts it there: every
supported Linear wrapped in the DiT's numerics mode, then `set_lora_weights(A, B,
merge_weights=<from --lora-merge-mode>, clear_existing=True)` with the trainer's fp32 masters, once
per simulated optimizer step. Writes one JSON record per (update, batch, branch, timestep).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault(
    "TORCH_COMPILE_DISABLE", "1"
)  # upstream compiles forward_native on CPU

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.cpu_kernel_standins import register_cpu_kernel_standins  # noqa: E402
from tests.dit_forward import _single_process_env, load_dit  # noqa: E402
from tests.reference_qwen import (  # noqa: E402
    Pairing,
    QwenDiTInputs,
    build_reference,
    random_lora_state,
    reference_forward,
    sglang_to_diffusers,
)

IMG_H = IMG_W = 8
TXT_LEN = {"cond": 7, "uncond": 5}  # odd lengths, different per branch, as real prompts
TIMESTEPS = (999.0, 500.0)
BATCHES = (1, 2)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place (0 = bitwise equal)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)  # monotonic, -0.0 == +0.0

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def compare(
    sgl: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], lora: bool
) -> list[dict]:
    """Per paired module, in sglang's execution order: equal, dtype, max ULP."""
    pairs = []
    for name, out in sgl.items():
        pair = sglang_to_diffusers(name, lora=lora)
        if pair.pairing in (Pairing.DIFFERENT, Pairing.SGLANG_ONLY):
            continue
        theirs = ref.get(pair.diffusers)
        if theirs is None:
            continue
        if pair.pairing is Pairing.RESHAPED:
            theirs = theirs.reshape(out.shape)
        elif pair.pairing is Pairing.ROUNDED:
            theirs = theirs.to(out.dtype)
        same_layout = out.dtype == theirs.dtype and out.shape == theirs.shape
        pairs.append(
            {
                "sglang": name,
                "diffusers": pair.diffusers,
                "dtype": str(out.dtype),
                "equal": same_layout and torch.equal(out, theirs),
                "max_ulp": (
                    ulp_distance(out, theirs)
                    if same_layout and out.dtype == torch.bfloat16
                    else None
                ),
            }
        )
    return pairs


def sglang_forward(model, inputs: QwenDiTInputs):
    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
        QwenImagePipelineConfig,
    )
    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    outputs: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, torch.Tensor):
                outputs.setdefault(name, out.detach().clone())

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules()]
    batch, txt_len = inputs.text.shape[:2]
    freqs_cis, freqs_complex = QwenImagePipelineConfig.get_freqs_cis(
        inputs.img_shapes,
        [txt_len] * batch,
        model.rotary_emb,
        torch.device("cpu"),
        torch.bfloat16,
    )
    try:
        with torch.no_grad(), set_forward_context(
            current_timestep=0, attn_metadata=None, forward_batch=None
        ):
            output = model(
                hidden_states=inputs.latents.bfloat16(),
                encoder_hidden_states=inputs.text,
                encoder_hidden_states_mask=None,
                timestep=inputs.timestep,
                img_shapes=inputs.img_shapes,
                txt_seq_lens=[txt_len] * batch,
                freqs_cis=freqs_cis,
                freqs_complex=freqs_complex,
            )
    finally:
        for handle in handles:
            handle.remove()
    outputs[""] = output
    return outputs


def wrap_linears_for_lora(model, numerics: str) -> None:
    """What LoRAPipeline.convert_module_lora_layers does on the first IPC LoRA update."""
    from sglang.multimodal_gen.runtime.layers.lora.linear import (
        replace_submodule,
        wrap_with_lora_layer,
    )
    from sglang.multimodal_gen.runtime.utils.numerics_mode import numerics_mode_context

    for name, layer in list(model.named_modules()):
        with numerics_mode_context(numerics):
            wrapped = wrap_with_lora_layer(layer)
        if wrapped is not None:
            replace_submodule(model, name, wrapped)


def push_lora(
    model, state: dict[str, torch.Tensor], rank: int, alpha: int, merge: bool
):
    """The weight updater's plain-pair path: rank from the tensors, alpha from the request."""
    for key in sorted(k for k in state if k.endswith(".lora_A.weight")):
        prefix = key.removesuffix(".lora_A.weight")
        layer = model.get_submodule(prefix)
        layer.lora_rank, layer.lora_alpha = rank, alpha
        layer.set_lora_weights(
            state[key],
            state[f"{prefix}.lora_B.weight"],
            merge_weights=merge,
            clear_existing=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--numerics", default="train_parity")
    parser.add_argument(
        "--updates", type=int, default=3, help="LoRA updates (0: no LoRA)"
    )
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument(
        "--lora-alpha", type=int, default=12
    )  # scale 1.5: not a power of two
    parser.add_argument("--lora-merge-mode", default="dynamic")
    args = parser.parse_args()
    _single_process_env()
    register_cpu_kernel_standins()  # only upstream's default norm path calls them

    model = load_dit(args.model_dir, args.numerics)
    from diffusers import QwenImageTransformer2DModel

    masters = QwenImageTransformer2DModel.from_pretrained(
        args.model_dir / "transformer", torch_dtype=torch.float32
    )
    joint_dim = masters.config.joint_attention_dim
    lora = args.updates > 0
    if lora:
        wrap_linears_for_lora(model, args.numerics)
    records = []
    for update in range(max(args.updates, 1)):
        state = (
            random_lora_state(masters, args.lora_rank, args.lora_alpha, seed=update)
            if lora
            else None
        )
        reference = build_reference(
            copy.deepcopy(masters), state, args.lora_rank, args.lora_alpha
        )
        if lora:
            push_lora(
                model,
                state,
                args.lora_rank,
                args.lora_alpha,
                args.lora_merge_mode == "merge",
            )
        for batch in BATCHES:
            for branch, txt_len in TXT_LEN.items():
                for timestep in TIMESTEPS:
                    inputs = QwenDiTInputs.random(
                        batch,
                        IMG_H,
                        IMG_W,
                        txt_len,
                        joint_dim,
                        timestep,
                        seed=len(records),
                    )
                    ours = sglang_forward(model, inputs)
                    _, theirs = reference_forward(reference, inputs, "cpu")
                    pairs = compare(ours, theirs, lora)
                    root = next(p for p in pairs if p["sglang"] == "")
                    records.append(
                        {
                            "update": update,
                            "batch": batch,
                            "branch": branch,
                            "timestep": timestep,
                            "root_equal": root["equal"],
                            "root_max_ulp": root["max_ulp"],
                            "pairs": pairs,
                        }
                    )
    args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
