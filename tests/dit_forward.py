"""Load a Qwen-Image DiT through sglang's real transformer loader on CPU, run it, record every
module's output. Run as a script (one process per sglang build / numerics mode):

    python tests/dit_forward.py MODEL_DIR OUT.pt [--numerics MODE] [--probe-op]

Whichever `sglang` is first on sys.path runs: the installed fork, or a pristine upstream tree put
first on PYTHONPATH. --probe-op gives RMSNorm a `forward_train_parity` before loading, to show
which mode the loader built the layers for.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.cpu_kernel_standins import register_cpu_kernel_standins  # noqa: E402

BATCHES = (1, 2)
IMG_H = IMG_W = 8  # latent patch grid
TXT_LEN = 7
TIMESTEP = 500.0  # sglang's DiT divides by 1000 itself


def _single_process_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # assigned, not defaulted: a parent process's MASTER_PORT is its own store's
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )


def load_dit(model_dir: Path, numerics: str | None):
    from sglang.multimodal_gen.runtime.distributed.parallel_state import (
        maybe_init_distributed_environment_and_model_parallel,
    )
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

    kwargs = {} if numerics is None else {"numerics": numerics}
    server_args = ServerArgs.from_kwargs(
        model_path=str(model_dir), num_gpus=1, **kwargs
    )
    set_global_server_args(server_args)
    maybe_init_distributed_environment_and_model_parallel(tp_size=1, sp_size=1)
    loaded = PipelineComponentLoader.load_component(
        component_name="transformer",
        component_model_path=str(model_dir / "transformer"),
        transformers_or_diffusers="diffusers",
        server_args=server_args,
        loader_cls=TransformerLoader,  # no silent fallback to the diffusers model
    )
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    return model.eval()


def run_forwards(model) -> dict[str, torch.Tensor]:
    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
        QwenImagePipelineConfig,
    )
    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    outputs: dict[str, torch.Tensor] = {}
    prefix = [""]

    def record(name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, torch.Tensor):
                outputs[f"{prefix[0]}{name}"] = out.detach().clone()

        return hook

    for name, module in model.named_modules():
        module.register_forward_hook(record(name or "<root>"))
    generator = torch.Generator().manual_seed(0)
    for batch in BATCHES:
        prefix[0] = f"b{batch}/"
        hidden = torch.randn(batch, IMG_H * IMG_W, 64, generator=generator).bfloat16()
        text = torch.randn(batch, TXT_LEN, 64, generator=generator).bfloat16()
        img_shapes = [[(1, IMG_H, IMG_W)]] * batch
        freqs_cis, freqs_complex = QwenImagePipelineConfig.get_freqs_cis(
            img_shapes,
            [TXT_LEN] * batch,
            model.rotary_emb,
            torch.device("cpu"),
            torch.bfloat16,
        )
        with torch.no_grad(), set_forward_context(
            current_timestep=0, attn_metadata=None, forward_batch=None
        ):
            model(
                hidden_states=hidden,
                encoder_hidden_states=text,
                encoder_hidden_states_mask=None,
                timestep=torch.full((batch,), TIMESTEP).bfloat16(),
                img_shapes=img_shapes,
                txt_seq_lens=[TXT_LEN] * batch,
                freqs_cis=freqs_cis,
                freqs_complex=freqs_complex,
            )
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--numerics", default=None)
    parser.add_argument("--probe-op", action="store_true")
    args = parser.parse_args()
    _single_process_env()
    standin_calls = register_cpu_kernel_standins()

    import sglang
    from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
    from sglang.multimodal_gen.runtime.layers.layernorm import RMSNorm

    if args.probe_op:

        def forward_train_parity(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

        RMSNorm.forward_train_parity = forward_train_parity
    model = load_dit(args.model_dir, args.numerics)
    dispatch = {
        name: module._forward_method.__name__
        for name, module in model.named_modules()
        if isinstance(module, CustomOp)
    }
    outputs = run_forwards(model)
    torch.save(
        {
            "sglang_file": sglang.__file__,
            "outputs": outputs,
            "dispatch": dispatch,
            "standin_calls": dict(standin_calls),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
