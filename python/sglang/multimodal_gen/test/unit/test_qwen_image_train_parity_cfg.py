# SPDX-License-Identifier: Apache-2.0
"""Qwen-Image's true-CFG rescale under --numerics train_parity, and the mode reaching the
pipeline config that runs it."""

from types import SimpleNamespace

import pytest
import torch

from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
    QwenImagePipelineConfig,
)
from sglang.multimodal_gen.configs.utils import update_config_from_args
from sglang.multimodal_gen.runtime.utils.train_parity import TrainParityError

BF16 = torch.bfloat16


@pytest.mark.parametrize("numerics", ["default", "train_parity"])
def test_the_pipeline_config_carries_the_mode(numerics, server_args_for):
    args = server_args_for(QwenImagePipelineConfig(), numerics=numerics)
    assert args.pipeline_config.numerics == numerics
    # from CLI kwargs, both the pipeline config and ServerArgs take it
    kwargs = {"numerics": numerics}
    update_config_from_args(QwenImagePipelineConfig(), kwargs, pop_args=True)
    assert kwargs == {"numerics": numerics}


def _noise(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    cond, uncond = (torch.randn(2, 13, 64, generator=generator).to(BF16) for _ in "cu")
    combined = uncond + 4.0 * (cond - uncond)
    combined[0, 0] = 0  # an all-zero prediction: the clamp keeps it 0
    return combined, cond


def test_rescale_takes_fp32_norms_as_the_trainers_autocast_does():
    config = QwenImagePipelineConfig(numerics="train_parity")
    combined, cond = _noise()
    batch = SimpleNamespace(
        true_cfg_scale=4.0, guidance_scale=1.0, do_classifier_free_guidance=True
    )
    actual = config.postprocess_cfg_noise(batch, combined, cond)
    # torch.norm runs in fp32 under CUDA autocast; the product follows it
    cond_norm = torch.norm(cond.float(), dim=-1, keepdim=True)
    noise_norm = torch.norm(combined.float(), dim=-1, keepdim=True).clamp_min(1e-12)
    expected = combined * (cond_norm / noise_norm)
    assert actual.dtype == torch.float32 and torch.equal(actual, expected)
    # control: the default mode's bf16 norms
    default = QwenImagePipelineConfig().postprocess_cfg_noise(batch, combined, cond)
    assert default.dtype == BF16 and not torch.equal(default.float(), expected)


def test_cfg_needs_true_cfg_scale():
    config = QwenImagePipelineConfig(numerics="train_parity")
    batch = SimpleNamespace(
        true_cfg_scale=None, guidance_scale=4.0, do_classifier_free_guidance=True
    )
    with pytest.raises(TrainParityError, match="set true_cfg_scale"):
        config.postprocess_cfg_noise(batch, *_noise())
