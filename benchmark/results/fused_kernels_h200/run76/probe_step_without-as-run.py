# SPDX-License-Identifier: Apache-2.0
"""Time-only probe: what the Qwen-Image train_parity step of benchmark/speed.py
saves when one memory-bound pass of the image stream is dropped from it, so the
most that fusing that pass into a neighbouring kernel could gain in the step.
A kernel's time in the profile overstates this where it runs beside another
stream's GEMMs (docs/results.md, runs 71-75).

Each drop runs `speed.py --variants train_parity` from an overlay of the
installed fork (symbolic links, with one file edited) ahead of the install on
PYTHONPATH; `none` runs the overlay unedited, as the baseline. A dropped step
computes something else: only the times mean anything. The passes, each only
for the image stream (sequences of 1024 tokens or more; the prompts are
shorter):

* `gated-residual`: `train_parity_kernels.gated_residual` returns the residual;
* `layernorm`: `train_parity_kernels.layer_norm_scale_shift` returns its input;
* `v-cat`: the joint attention's V is a zero buffer held per shape (no
  `torch.cat` of the text and image V).

    python3 benchmark/probe_step_without.py --site /tmp/site --out $OUT/without \
        [--drops none,gated-residual,v-cat,layernorm] [--workdir /tmp/step_without] \
        [-- speed.py arguments]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

KERNELS = "sglang/multimodal_gen/runtime/layers/train_parity_kernels.py"
QWEN_IMAGE = "sglang/multimodal_gen/runtime/models/dits/qwen_image.py"
LORA_LINEAR = "sglang/multimodal_gen/runtime/layers/lora/linear.py"

_JOINT_VALUE = '''

def _probe_joint_value(module, txt_value, img_value):
    shape = (img_value.shape[0], txt_value.shape[1] + img_value.shape[1], *img_value.shape[2:])
    buffers = module.__dict__.setdefault("_probe_joint_values", {})
    if shape not in buffers:
        buffers[shape] = img_value.new_zeros(shape)
    return buffers[shape]
'''

_LORA_DOWN = '''

def _probe_lora_down(module, x):
    shape = (*x.shape[:-1], module.lora_A.shape[0])
    buffers = module.__dict__.setdefault("_probe_lora_downs", {})
    if shape not in buffers:
        buffers[shape] = x.new_zeros(shape)
    return buffers[shape]
'''

# drop -> (file, text found exactly once, its replacement, text appended to the file)
DROPS = {
    "none": None,
    "gated-residual": (
        KERNELS,
        "    reference = partial(train_parity_ops.gated_residual, residual, gate, x)\n",
        "    reference = partial(train_parity_ops.gated_residual, residual, gate, x)\n"
        "    if residual.dim() == 3 and residual.shape[1] >= 1024:\n"
        "        return residual\n",
        "",
    ),
    "layernorm": (
        KERNELS,
        "        train_parity_ops.layer_norm_scale_shift, x, shift, scale, eps, weight, bias\n"
        "    )\n",
        "        train_parity_ops.layer_norm_scale_shift, x, shift, scale, eps, weight, bias\n"
        "    )\n"
        "    if x.dim() == 3 and x.shape[1] >= 1024:\n"
        "        return x\n",
        "",
    ),
    "v-cat": (
        QWEN_IMAGE,
        "            torch.cat([txt_value, img_value], dim=1),\n",
        "            _probe_joint_value(self, txt_value, img_value),\n",
        _JOINT_VALUE,
    ),
    "lora-down": (
        LORA_LINEAR,
        "        down = train_parity_ops.lora_down(\n",
        "        down = _probe_lora_down(self, x) if x.dim() == 3 and x.shape[1] >= 1024 else "
        "train_parity_ops.lora_down(\n",
        _LORA_DOWN,
    ),
}


def overlay(site: Path, root: Path, drop: str) -> Path:
    """`root`/sglang: the installed package as symbolic links, with `drop`'s
    file a copy edited as DROPS says. Raises if its text is not found exactly
    once (the fork's code moved on)."""
    target = root / "sglang"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    subprocess.run(["cp", "-rs", str(site.resolve() / "sglang"), str(target)], check=True)
    for part in drop.split("+"):
        if DROPS[part] is None:
            continue
        rel, found, replacement, appended = DROPS[part]
        text = (root / rel).read_text()
        if text.count(found) != 1:
            raise RuntimeError(f"{part}: {found!r} found {text.count(found)} times in {rel}")
        (root / rel).unlink()
        (root / rel).write_text(text.replace(found, replacement) + appended)
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, required=True, help="where the fork is installed")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/step_without"))
    parser.add_argument(
        "--drops",
        default="none,gated-residual,v-cat,layernorm,lora-down,gated-residual+v-cat+layernorm",
    )
    parser.add_argument("speed_args", nargs="*", help="after --: speed.py's arguments")
    args = parser.parse_args()
    drops = args.drops.split(",")
    unknown = {part for drop in drops for part in drop.split("+")} - set(DROPS)
    if unknown:
        parser.error(f"unknown drops {sorted(unknown)}; known: {sorted(DROPS)}")
    speed_args = args.speed_args or ["--rounds", "3", "--steps", "3", "--warmup", "2"]
    args.out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for drop in drops:
        root = overlay(args.site, args.workdir / drop, drop)
        env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{args.site}")
        command = [sys.executable, str(Path(__file__).with_name("speed.py")), "--variants",
                   "train_parity", "--out", str(args.out / f"speed_{drop}.json"), *speed_args]
        with open(args.out / f"speed_{drop}.log", "w") as log:
            result = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        rc |= result.returncode
        print(f"== {drop} (exit {result.returncode})", flush=True)
        for line in (args.out / f"speed_{drop}.log").read_text().splitlines():
            if line.startswith("train_parity "):
                print(line, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
