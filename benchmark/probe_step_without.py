# SPDX-License-Identifier: Apache-2.0
"""Time-only probe: what the Qwen-Image train_parity step of benchmark/speed.py
saves when one memory-bound pass of the image stream is dropped from it, so the
most that fusing that pass into a neighbouring kernel could gain in the step.
A kernel's time in the profile overstates this where it runs beside another
stream's GEMMs (docs/results.md, runs 71-75).

Each drop runs `speed.py --variants train_parity` from an overlay of the
installed fork (symbolic links, with the dropped passes' files edited) ahead of
the install on PYTHONPATH; `none` runs the overlay unedited, as the baseline. A
dropped pass launches nothing in the replayed step: it returns a tensor of real
values (its input, or its own first result per shape held), since a GEMM
reading zeros draws less power and so runs at a higher clock (run 76). A
dropped step computes something else: only the times mean anything. The
passes, each only for the image stream (sequences of 1024 tokens or more; the
prompts are shorter); drops joined by `+` are applied together, and a drop
named twice runs twice:

* `gated-residual`: `train_parity_kernels.gated_residual` returns the residual;
* `layernorm`: `train_parity_kernels.layer_norm_scale_shift` returns its first
  result;
* `v-cat`: the joint attention's V is its first `torch.cat` of the text and
  image V;
* `lora-down`: each LoRA'd linear's `lora_A(x)` is its first result.

Out: `speed_<i>_<drop>.json` and `.log` per run (`+` written `_and_`), and
`summary.txt`, the lines of `speed.py`'s table for each.

    python3 benchmark/probe_step_without.py --site /tmp/site --out $OUT/without \
        [--drops none,gated-residual,layernorm,v-cat,lora-down,none] \
        [--workdir /tmp/step_without] \
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

_FIRST_RESULT = '''

def _probe_first_result(results, key, compute, hold=True):
    # later calls read the first call's real result and launch nothing; a zero
    # buffer would draw less power in the GEMMs that read it and so raise the clock
    if not hold:
        return compute()
    if key not in results:
        results[key] = compute()
    return results[key]
'''

_IMAGE_STREAM = "{x}.dim() == 3 and {x}.shape[1] >= 1024"

# drop -> (file, text found exactly once, its replacement, text appended to the file)
DROPS = {
    "none": None,
    "gated-residual": (
        KERNELS,
        "    reference = partial(train_parity_ops.gated_residual, residual, gate, x)\n",
        "    reference = partial(train_parity_ops.gated_residual, residual, gate, x)\n"
        f"    if {_IMAGE_STREAM.format(x='residual')}:\n"
        "        return residual\n",
        "",
    ),
    "layernorm": (
        KERNELS,
        "        train_parity_ops.layer_norm_scale_shift, x, shift, scale, eps, weight, bias\n"
        "    )\n",
        "        train_parity_ops.layer_norm_scale_shift, x, shift, scale, eps, weight, bias\n"
        "    )\n"
        f"    if {_IMAGE_STREAM.format(x='x')}:\n"
        "        return _probe_first_result(\n"
        "            globals().setdefault('_probe_results', {}), x.shape, reference\n"
        "        )\n",
        _FIRST_RESULT,
    ),
    "v-cat": (
        QWEN_IMAGE,
        "            torch.cat([txt_value, img_value], dim=1),\n",
        "            _probe_first_result(\n"
        "                self.__dict__.setdefault('_probe_results', {}),\n"
        "                (txt_value.shape, img_value.shape),\n"
        "                lambda: torch.cat([txt_value, img_value], dim=1),\n"
        "            ),\n",
        _FIRST_RESULT,
    ),
    "lora-down": (
        LORA_LINEAR,
        "        down = train_parity_ops.lora_down(\n"
        "            x, self.lora_A.to(device=x.device, non_blocking=True)\n"
        "        )\n",
        "        down = _probe_first_result(\n"
        "            self.__dict__.setdefault('_probe_results', {}),\n"
        "            x.shape,\n"
        "            lambda: train_parity_ops.lora_down(\n"
        "                x, self.lora_A.to(device=x.device, non_blocking=True)\n"
        "            ),\n"
        f"            hold={_IMAGE_STREAM.format(x='x')},\n"
        "        )\n",
        _FIRST_RESULT,
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
        default="none,gated-residual,layernorm,v-cat,lora-down,none",
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
    summary = []
    for index, drop in enumerate(drops):
        root = overlay(args.site, args.workdir / drop, drop)
        env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{args.site}")
        name = f"speed_{index}_{drop.replace('+', '_and_')}"
        command = [sys.executable, str(Path(__file__).with_name("speed.py")), "--variants",
                   "train_parity", "--out", str(args.out / f"{name}.json"), *speed_args]
        with open(args.out / f"{name}.log", "w") as log:
            result = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        rc |= result.returncode
        first = len(summary)
        summary.append(f"== {drop} (exit {result.returncode})")
        summary += [
            line
            for line in (args.out / f"{name}.log").read_text().splitlines()
            if line.startswith("train_parity ")
        ]
        print("\n".join(summary[first:]), flush=True)
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
