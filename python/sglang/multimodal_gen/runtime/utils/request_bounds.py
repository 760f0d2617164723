# SPDX-License-Identifier: Apache-2.0
"""Bounds on the denoising work one request may ask for under
``--numerics train_parity``.

A replica runs one request at a time, so a request for a million denoising
steps or a hundred thousand frames holds the server, and every trainer call
behind it, for hours. Each request is checked at admission against the
server's bounds, and one over a bound is refused naming the field, the bound
and the flag that sets it:

* ``num_inference_steps`` <= ``--train-parity-max-inference-steps``
* ``num_frames`` <= ``--train-parity-max-num-frames``
* ``width * height`` <= ``--train-parity-max-image-pixels`` (derived from
  device memory, see ``train_parity_requests.max_image_pixels``)
* the denoising work ``num_inference_steps * num_frames * width * height``
  (pixel-steps: what the DiT denoises, whatever the model's VAE and patch
  sizes; CFG branches are not counted, so a guided request costs up to twice
  its work) <= ``--train-parity-max-denoising-work``.

Steps or a size a request leaves unset are the model's defaults, within the
bounds; the work bound counts what the request states.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

if TYPE_CHECKING:
    from sglang.multimodal_gen.runtime.server_args.server_args import ServerArgs

logger = init_logger(__name__)

# Flow-matching and DDPM schedules are trained on 1000 timesteps; more steps
# than that revisit the same timesteps.
MAX_INFERENCE_STEPS = 1000
# Wan generates 81-121 frames, LTX-2 121-257 (481 for 20 s at 24 fps).
# 1025 = 4 * 256 + 1 = 8 * 128 + 1 is valid under both families' frame rules
# and is twice LTX-2's longest clip.
MAX_NUM_FRAMES = 1025
# 1e11 pixel-steps: a 257-frame 3840 x 2160 LTX-2 clip at 40 steps (8.5e10) and
# a 1000-step 1328 x 1328 image (1.8e9) fit; 1000 steps of a 121-frame
# 1280 x 720 video (1.1e11) do not.
MAX_DENOISING_WORK = 10**11

# ServerArgs field -> (flag, the bounded quantity); the pixel bound's default
# is resolved from device memory by train_parity_requests.adjust_server_args.
BOUNDS = {
    "train_parity_max_inference_steps": (
        "--train-parity-max-inference-steps",
        "num_inference_steps",
    ),
    "train_parity_max_num_frames": ("--train-parity-max-num-frames", "num_frames"),
    "train_parity_max_image_pixels": (
        "--train-parity-max-image-pixels",
        "width * height",
    ),
    "train_parity_max_denoising_work": (
        "--train-parity-max-denoising-work",
        "num_inference_steps * num_frames * width * height",
    ),
}


def validate_server_args(args: ServerArgs) -> None:
    """Each bound is a positive int."""
    for field, (flag, _) in BOUNDS.items():
        value = getattr(args, field)
        if value is None and field == "train_parity_max_image_pixels":
            continue  # resolved from device memory under train_parity
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be positive, got {value!r}")


def log_bounds(args: ServerArgs) -> None:
    logger.info(
        "--numerics train_parity: request bounds %s",
        ", ".join(
            f"{what} <= {getattr(args, field)} ({flag})"
            for field, (flag, what) in BOUNDS.items()
        ),
    )


def request_problems(
    params: Any, server_args: ServerArgs
) -> Iterator[tuple[str, str, str]]:
    """(option, why, instead) for each bound the request is over."""
    steps = params.num_inference_steps
    max_steps = server_args.train_parity_max_inference_steps
    if steps is not None and steps > max_steps:
        yield (
            f"num_inference_steps={steps}",
            f"more than the server's bound of {max_steps} steps",
            "ask for fewer or raise --train-parity-max-inference-steps",
        )
    max_frames = server_args.train_parity_max_num_frames
    if params.num_frames > max_frames:
        yield (
            f"num_frames={params.num_frames}",
            f"more than the server's bound of {max_frames} frames",
            "ask for fewer or raise --train-parity-max-num-frames",
        )
    if params.width is None or params.height is None:
        return
    pixels = params.width * params.height
    max_pixels = server_args.train_parity_max_image_pixels
    if pixels > max_pixels:
        yield (
            f"width={params.width} height={params.height}",
            f"{pixels} pixels exceed the server's bound of {max_pixels}",
            "request a smaller image or raise --train-parity-max-image-pixels",
        )
    if steps is None:
        return
    work = steps * params.num_frames * pixels
    max_work = server_args.train_parity_max_denoising_work
    if work > max_work:
        yield (
            f"num_inference_steps={steps} num_frames={params.num_frames} "
            f"width={params.width} height={params.height}",
            f"{work} pixel-steps of denoising exceed the server's bound of "
            f"{max_work}",
            "ask for fewer steps, frames or pixels, or raise "
            "--train-parity-max-denoising-work",
        )
