# SPDX-License-Identifier: Apache-2.0
"""Under --numerics train_parity the server serves the trainer's policy or says
why not: options that batch or recast the DiT are refused at startup, requests
are checked at admission, and a LoRA update states its rank and alpha."""

import pytest
import torch

from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import LoRAPipeline
from sglang.multimodal_gen.runtime.post_training.weights_updater import WeightsUpdater
from sglang.multimodal_gen.runtime.utils import train_parity_requests
from sglang.multimodal_gen.runtime.utils.train_parity import TrainParityError
from sglang.multimodal_gen.test.unit.conftest import mock_cuda_platform


def test_stage_autocast_is_switched_off(train_parity_args):
    assert train_parity_args().disable_autocast is True
    assert train_parity_args(disable_autocast=True).disable_autocast is True


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(disable_autocast=False), "disable_autocast=False"),
        (dict(batching_max_size=4, batching_delay_ms=200), "--batching-max-size 4"),
    ],
)
def test_options_that_batch_or_recast_the_dit_are_refused(
    kwargs, option, train_parity_args
):
    with pytest.raises(TrainParityError, match=f"does not support {option}: "):
        train_parity_args(**kwargs)
    train_parity_args(numerics="default", **kwargs)  # the default mode serves them


def test_image_bound_derives_from_device_memory(train_parity_args):
    # mock_cuda_platform: an 80 GB device
    bound = train_parity_args().train_parity_max_image_pixels
    assert bound == 80 * 1024**3 // train_parity_requests.MIN_BYTES_PER_PIXEL
    explicit = train_parity_args(train_parity_max_image_pixels=4096)
    assert explicit.train_parity_max_image_pixels == 4096
    with pytest.raises(ValueError, match="must be positive, got 0"):
        train_parity_args(train_parity_max_image_pixels=0)
    with pytest.raises(ValueError, match="applies only with --numerics train_parity"):
        train_parity_args(numerics="default", train_parity_max_image_pixels=4096)


def test_a_complete_request_is_admitted(train_parity_args, train_parity_request):
    args = train_parity_args(train_parity_max_image_pixels=64 * 64)
    train_parity_request(
        args, true_cfg_scale=4.0, width=64, height=64, generator_device="cpu"
    )
    train_parity_request(args, true_cfg_scale=1.0, generator_device="cuda")


@pytest.mark.parametrize(
    "request_kwargs, option",
    [
        (dict(), "a request without true_cfg_scale"),
        (dict(true_cfg_scale=4.0, width=128, height=64), "width=128 height=64"),
        (
            dict(true_cfg_scale=4.0, generator_device="bogus"),
            "generator_device='bogus'",
        ),
        (dict(true_cfg_scale=4.0, width=8, height=64), "width=8"),
        (dict(true_cfg_scale=4.0, width=64, height=15), "height=15"),
        (dict(true_cfg_scale=4.0, width=24, height=64), "width=24"),
        (
            dict(true_cfg_scale=4.0, num_frames=5),
            "num_frames=5 on an image model",
        ),
        (dict(true_cfg_scale=4.0, fps=8), "fps=8 on an image model"),
    ],
)
def test_request_input_is_checked_at_admission(
    request_kwargs, option, train_parity_args, train_parity_request
):
    """Each is refused at admission. Admitted, a request without true_cfg_scale
    would fail at its first denoising step, a huge image allocating its
    latents, a size that is not a whole number of DiT patches in the pipeline
    (or serve another size); an unknown generator_device would mean the
    accelerator, and an image model would ignore the video fields."""
    args = train_parity_args(train_parity_max_image_pixels=64 * 64)
    with pytest.raises(TrainParityError, match=f"does not support {option}: "):
        train_parity_request(args, **request_kwargs)
    train_parity_request(train_parity_args(numerics="default"), **request_kwargs)


def test_whole_patches_and_a_single_frame_are_admitted(
    train_parity_args, train_parity_request
):
    args = train_parity_args()
    train_parity_request(args, true_cfg_scale=4.0, width=16, height=48, num_frames=1)
    with pytest.raises(TrainParityError, match="a width that is a multiple of 16"):
        train_parity_request(args, true_cfg_scale=4.0, width=15, height=16)


def test_a_cfg_scale_left_to_a_default_is_refused(train_parity_args):
    """A sampling params class may default the scale (Wan's guidance_scale):
    only a value the request states is the trainer's."""
    args = train_parity_args()
    params = SamplingParams(prompt="a cat", true_cfg_scale=4.0)
    params._explicit_fields = {"prompt"}
    with pytest.raises(TrainParityError, match="a request without true_cfg_scale"):
        train_parity_requests.adjust_sampling_params(params, args)
    params._explicit_fields = {"prompt", "true_cfg_scale"}
    train_parity_requests.adjust_sampling_params(params, args)


def test_rollouts_draw_noise_on_the_server_device(
    train_parity_args, train_parity_request
):
    """On a GPU server a rollout's SDE noise is drawn on the GPU with the request's
    generator: a CPU generator would fail there with a 500 at the first step."""
    args = train_parity_args()
    with mock_cuda_platform():
        with pytest.raises(
            TrainParityError, match="generator_device='cpu' in a rollout"
        ):
            train_parity_request(
                args, true_cfg_scale=4.0, generator_device="cpu", rollout=True
            )
        train_parity_request(
            args, true_cfg_scale=4.0, generator_device="cuda", rollout=True
        )
        # not a rollout
        train_parity_request(args, true_cfg_scale=4.0, generator_device="cpu")
    # on a CPU server
    train_parity_request(args, true_cfg_scale=4.0, generator_device="cpu", rollout=True)


def test_unknown_request_fields_are_refused(train_parity_args):
    with pytest.raises(TrainParityError, match="guidance_rescale"):
        train_parity_requests.check_request_fields(
            ["guidance_rescale"], train_parity_args()
        )
    train_parity_requests.check_request_fields([], train_parity_args())
    train_parity_requests.check_request_fields(
        ["guidance_rescale"], train_parity_args(numerics="default")
    )


class _TinyDiT(torch.nn.Module):
    def __init__(self, numerics: str):
        super().__init__()
        self.numerics = numerics
        self.proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)


class _TestLoRAPipeline(LoRAPipeline):
    def create_pipeline_stages(self, server_args):
        pass


def _lora_update(numerics: str, **request):
    pipeline = object.__new__(_TestLoRAPipeline)
    pipeline.modules = {"transformer": _TinyDiT(numerics)}
    pipeline.exclude_lora_layers = []
    pipeline.lora_initialized = False
    tensors = [
        ("proj.lora_A.weight", torch.randn(2, 8)),
        ("proj.lora_B.weight", torch.randn(8, 2)),
    ]
    return WeightsUpdater(pipeline).update_weights_from_tensor(
        tensors, weight_update_mode="lora_merge", **request
    )


@pytest.mark.parametrize(
    "request_kwargs, missing",
    [
        (dict(lora_rank=2), "lora_alpha"),
        (dict(lora_alpha=4), "lora_rank"),
        (dict(), "lora_rank and lora_alpha"),
    ],
)
def test_lora_update_states_rank_and_alpha(request_kwargs, missing):
    """Without lora_alpha the update would apply scale 1 (alpha = rank): it is
    refused before any layer is wrapped."""
    ok, message = _lora_update("train_parity", **request_kwargs)
    assert not ok
    assert f"does not support a LoRA update without {missing}: " in message
