"""Load a Qwen-Image DiT through sglang's real loader on CPU, run it (batch 1 and 2), record
every module's output. Run as a script, one process per sglang build / numerics mode:

    python tests/dit_forward.py MODEL_DIR OUT.pt [--numerics MODE] [--probe-op]

Whichever `sglang` is first on sys.path runs: the installed fork, or a pristine upstream tree put
first on PYTHONPATH (so the fork's tool modules are loaded from this checkout, see fork_modules).
--probe-op gives RMSNorm a `forward_train_parity` before loading, to show which mode the loader
built the layers for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fork_modules import load_tool  # noqa: E402

BATCHES = (1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--numerics", default=None)
    parser.add_argument("--probe-op", action="store_true")
    args = parser.parse_args()
    kernel_calls = load_tool("cpu_kernels").register_cpu_kernels()
    sglang_dit, reference = load_tool("sglang_dit"), load_tool("reference")

    import sglang
    from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
    from sglang.multimodal_gen.runtime.layers.layernorm import RMSNorm

    if args.probe_op:

        def forward_train_parity(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

        RMSNorm.forward_train_parity = forward_train_parity
    server_kwargs = {} if args.numerics is None else {"numerics": args.numerics}
    model = sglang_dit.load_dit(args.model_dir, **server_kwargs)
    dispatch = {  # a partial for a train_parity op without a train_parity forward
        name: getattr(module._forward_method, "func", module._forward_method).__name__
        for name, module in model.named_modules()
        if isinstance(module, CustomOp)
    }
    outputs = {}
    for batch in BATCHES:
        inputs = reference.QwenDiTInputs.random(batch, 8, 8, 7, 64, seed=batch)
        for name, out in sglang_dit.sglang_forward(model, inputs).items():
            outputs[f"b{batch}/{name or '<root>'}"] = out
    torch.save(
        {
            "sglang_file": sglang.__file__,
            "outputs": outputs,
            "dispatch": dispatch,
            "kernel_calls": dict(kernel_calls),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
