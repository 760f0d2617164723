# SPDX-License-Identifier: Apache-2.0
"""Under --numerics train_parity the server serves the trainer's policy or says
why not: options that batch or recast the DiT are refused at startup, requests
are checked at admission, and a LoRA update states its rank and alpha."""

from dataclasses import dataclass

import pytest
import torch

from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
    QwenImagePipelineConfig,
)
from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import LoRAPipeline
from sglang.multimodal_gen.runtime.post_training.weights_updater import WeightsUpdater
from sglang.multimodal_gen.runtime.utils import train_parity
from sglang.multimodal_gen.runtime.utils.train_parity import (
    TrainParityContract,
    TrainParityError,
)
from sglang.multimodal_gen.test.unit.conftest import mock_cuda_platform
from sglang.multimodal_gen.test.unit.test_train_parity_mode import server_args_for
from sglang.multimodal_gen.test.unit.test_train_parity_options import _request


@dataclass
class _OptedInPipelineConfig(QwenImagePipelineConfig):
    train_parity_contract = TrainParityContract(
        "Test family",
        "a training forward",
        "QwenImageTransformer2DModel",
        (),
        cfg_scale_fields=("true_cfg_scale",),
        pixels_per_patch=16,
    )


def _args(numerics: str = "train_parity", **kwargs):
    return server_args_for(_OptedInPipelineConfig(), numerics=numerics, **kwargs)


def test_stage_autocast_is_switched_off():
    assert _args().disable_autocast is True
    assert _args(disable_autocast=True).disable_autocast is True


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(disable_autocast=False), "disable_autocast=False"),
        (dict(batching_max_size=4, batching_delay_ms=200), "--batching-max-size 4"),
    ],
)
def test_options_that_batch_or_recast_the_dit_are_refused(kwargs, option):
    with pytest.raises(TrainParityError, match=f"does not support {option}: "):
        _args(**kwargs)
    _args(numerics="default", **kwargs)  # the default mode serves them


def test_image_bound_derives_from_device_memory():
    # mock_cuda_platform: an 80 GB device
    bound = _args().train_parity_max_image_pixels
    assert bound == 80 * 1024**3 // train_parity.MIN_BYTES_PER_PIXEL
    assert _args(train_parity_max_image_pixels=4096).train_parity_max_image_pixels == (
        4096
    )
    with pytest.raises(ValueError, match="must be positive, got 0"):
        _args(train_parity_max_image_pixels=0)
    with pytest.raises(ValueError, match="applies only with --numerics train_parity"):
        _args(numerics="default", train_parity_max_image_pixels=4096)


def test_a_complete_request_is_admitted():
    args = _args(train_parity_max_image_pixels=64 * 64)
    _request(args, true_cfg_scale=4.0, width=64, height=64, generator_device="cpu")
    _request(args, true_cfg_scale=1.0, generator_device="cuda")


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
def test_request_input_is_checked_at_admission(request_kwargs, option):
    """Each used to be accepted: without true_cfg_scale the request failed at its
    first denoising step, a huge image failed allocating its latents, an
    unknown generator_device silently meant the accelerator, a size that is not
    a whole number of DiT patches failed in the pipeline (or served another
    size), and an image model ignored the video fields."""
    args = _args(train_parity_max_image_pixels=64 * 64)
    with pytest.raises(TrainParityError, match=f"does not support {option}: "):
        _request(args, **request_kwargs)
    _request(_args(numerics="default"), **request_kwargs)


def test_whole_patches_and_a_single_frame_are_admitted():
    args = _args()
    _request(args, true_cfg_scale=4.0, width=16, height=48, num_frames=1)
    with pytest.raises(TrainParityError, match="a width that is a multiple of 16"):
        _request(args, true_cfg_scale=4.0, width=15, height=16)


def test_a_cfg_scale_left_to_a_default_is_refused():
    """A sampling params class may default the scale (Wan's guidance_scale):
    only a value the request states is the trainer's."""
    args = _args()
    params = SamplingParams(prompt="a cat", true_cfg_scale=4.0)
    params._explicit_fields = {"prompt"}
    with pytest.raises(TrainParityError, match="a request without true_cfg_scale"):
        train_parity.adjust_sampling_params(params, args)
    params._explicit_fields = {"prompt", "true_cfg_scale"}
    train_parity.adjust_sampling_params(params, args)


def test_rollouts_draw_noise_on_the_server_device():
    """On a GPU server a rollout's SDE noise is drawn on the GPU with the request's
    generator: a CPU generator used to fail there with a 500 at the first step."""
    args = _args()
    with mock_cuda_platform():
        with pytest.raises(
            TrainParityError, match="generator_device='cpu' in a rollout"
        ):
            _request(args, true_cfg_scale=4.0, generator_device="cpu", rollout=True)
        _request(args, true_cfg_scale=4.0, generator_device="cuda", rollout=True)
        _request(args, true_cfg_scale=4.0, generator_device="cpu")  # not a rollout
    _request(args, true_cfg_scale=4.0, generator_device="cpu", rollout=True)  # CPU


def test_unknown_request_fields_are_refused():
    with pytest.raises(TrainParityError, match="guidance_rescale"):
        train_parity.check_request_fields(["guidance_rescale"], _args())
    train_parity.check_request_fields([], _args())
    train_parity.check_request_fields(["guidance_rescale"], _args(numerics="default"))


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
    """Without lora_alpha the update used to apply scale 1 (alpha = rank). It is
    refused before any layer is wrapped."""
    ok, message = _lora_update("train_parity", **request_kwargs)
    assert not ok
    assert f"does not support a LoRA update without {missing}: " in message
