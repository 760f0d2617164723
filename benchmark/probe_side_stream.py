# SPDX-License-Identifier: Apache-2.0
"""What the Qwen-Image text stream on a side CUDA stream saves, and at which
stream priority: the 60-block train_parity DiT of benchmark/speed.py (1024x1024,
batch 1, CFG as two forwards, LoRA r64), replayed from CUDA graphs, timed with
the side stream at high priority (as the DiT runs it), at normal priority, and
with everything on one stream (``SideStream(overlap=False)``). The variants'
timed rounds are interleaved; each recaptures its graphs, and each step output
is checked bitwise against the one-stream output.

    python3 benchmark/probe_side_stream.py --out $OUT/side_stream.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark import gpu_common, speed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run of the script")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/side_stream"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    gpu_common.setup(device, "off")
    import torch

    from sglang.multimodal_gen.runtime.models.dits import qwen_image
    from sglang.multimodal_gen.runtime.utils import side_stream
    from sglang.multimodal_gen.runtime.utils.side_stream import SideStream
    from sglang_train_parity import reference

    speed.FAMILY_SPECS["qwen-image"]["targets"] = reference.LORA_TARGETS
    config = dict(
        gpu_common.TINY_CONFIG if args.tiny else gpu_common.REAL_CONFIG,
        num_layers=args.layers,
    )
    grid = (8, 8) if args.tiny else (64, 64)
    txt = speed.TXT_LEN_TINY if args.tiny else speed.TXT_LEN
    model_dir = gpu_common.write_config_only_model_dir(args.workdir / "qwen-image", config)
    model, _ = speed.build_fork("train_parity", config, model_dir, device)
    graphs = model.__dict__.get("forward")
    step = speed.fork_step_fn(model, config, grid, txt, device)

    def normal_priority(device):
        return torch.cuda.Stream(device, priority=0)

    variants = {
        "side stream, high priority": {},
        "side stream, normal priority": {
            (side_stream, "_side_stream"): functools.cache(normal_priority)
        },
        "one stream": {
            (qwen_image, "SideStream"): functools.partial(SideStream, overlap=False)
        },
    }
    originals = {
        key: getattr(*key) for patches in variants.values() for key in patches
    }
    result = {"script": "benchmark/probe_side_stream.py", "argv": sys.argv[1:]}
    result["graphs"] = graphs is not None
    times = {name: [] for name in variants}
    outputs = {}
    for round_ in range(args.rounds):
        for name, patches in variants.items():
            for key, value in originals.items():
                setattr(*key, patches.get(key, value))
            if graphs is not None:
                # as after an update: the next call drops every graph
                graphs.state = None
            # first sight eager, second capture: then replays
            for i in range(3):
                step(i)
            times[name].append(speed.time_steps(step, 0, args.steps, device))
            if round_ == 0:
                outputs[name] = step(0).detach().cpu()
    for key, value in originals.items():
        setattr(*key, value)
    reference_output = outputs["one stream"]
    result["variants"] = {
        name: {
            "step_ms_median": round(statistics.median(sum(runs, [])), 2),
            "round_medians_ms": [round(statistics.median(r), 2) for r in runs],
            "equal_to_one_stream": bool(torch.equal(outputs[name], reference_output)),
        }
        for name, runs in times.items()
    }
    result["versions"] = gpu_common.versions()
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["variants"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
