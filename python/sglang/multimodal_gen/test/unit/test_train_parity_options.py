# SPDX-License-Identifier: Apache-2.0
"""Server and request options under --numerics train_parity: set, or refused with the reason."""

import logging
from dataclasses import dataclass

import pytest

from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
    QwenImagePipelineConfig,
)
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.utils import train_parity_requests
from sglang.multimodal_gen.runtime.utils.train_parity import (
    TrainParityContract,
    TrainParityError,
)


@dataclass
class _OptedInPipelineConfig(QwenImagePipelineConfig):
    train_parity_contract = TrainParityContract(
        "Test family",
        "a training forward",
        "QwenImageTransformer2DModel",
        (),
        pixels_per_patch=16,
    )


@pytest.fixture
def opted_in_args(server_args_for):
    """ServerArgs for a family that opts in:
    ``opted_in_args(numerics=..., pipeline_kwargs=..., **fields)``."""

    def build(numerics: str = "train_parity", pipeline_kwargs=None, **kwargs):
        pipeline_config = _OptedInPipelineConfig(**(pipeline_kwargs or {}))
        return server_args_for(pipeline_config, numerics=numerics, **kwargs)

    return build


@pytest.fixture
def train_parity_log():
    """Lines logged by the train_parity rules."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    train_parity_requests.logger.addHandler(handler)
    yield lines
    train_parity_requests.logger.removeHandler(handler)


def test_single_valued_options_are_set_and_logged(train_parity_log, opted_in_args):
    args = opted_in_args()
    assert args.attention_backend == "torch_sdpa"
    assert args.lora_merge_mode == "dynamic"
    assert args.enable_breakable_cuda_graph is False
    assert args.sp_degree == 1
    assert not args.enable_cfg_parallel
    log = "\n".join(train_parity_log)
    for field in (
        "attention_backend",
        "lora_merge_mode",
        "enable_breakable_cuda_graph",
    ):
        assert f"--numerics train_parity: setting {field}=" in log


def test_the_valid_values_are_accepted_explicitly(opted_in_args):
    args = opted_in_args(
        attention_backend="torch_sdpa",
        lora_merge_mode="dynamic",
        enable_breakable_cuda_graph=False,
        sp_degree=1,
    )
    assert (args.attention_backend, args.lora_merge_mode) == ("torch_sdpa", "dynamic")


def test_the_default_mode_sets_nothing(opted_in_args):
    args = opted_in_args(numerics="default")
    assert args.lora_merge_mode == "auto"
    assert args.attention_backend != "torch_sdpa"


REFUSED = {
    "attention_backend='fa'": dict(attention_backend="fa"),
    "--component-attention-backends transformer=fa": dict(
        component_attention_backends={"transformer": "fa"}
    ),
    "lora_merge_mode='merge'": dict(lora_merge_mode="merge"),
    "lora_merge_mode='auto'": dict(lora_merge_mode="auto"),
    "--enable-torch-compile": dict(enable_torch_compile=True),
    "enable_breakable_cuda_graph=True": dict(enable_breakable_cuda_graph=True),
    "cache-dit": dict(cache_dit_config={"Fn_compute_blocks": 1}),
    "sp_degree=2": dict(sp_degree=2, num_gpus=2),
    "ulysses_degree=2": dict(ulysses_degree=2, num_gpus=2),
    "quantized DiT weights": dict(quantization="fp8"),
    "--kv-cache-quant": dict(kv_cache_quant_config=QVGKVQuantArgs(bits=4)),
    "dit_precision='fp32'": dict(pipeline_kwargs=dict(dit_precision="fp32")),
    "--backend diffusers": dict(backend="diffusers"),
}


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_option_is_refused_with_its_reason(option, opted_in_args):
    with pytest.raises(TrainParityError) as refused:
        opted_in_args(**REFUSED[option])
    message = str(refused.value)
    assert message.startswith(f"--numerics train_parity does not support {option}: ")
    assert "; " in message  # why, then what to do instead


def test_cache_dit_from_the_environment_is_refused(monkeypatch, opted_in_args):
    monkeypatch.setenv("SGLANG_CACHE_DIT_ENABLED", "true")
    with pytest.raises(TrainParityError, match="cache-dit"):
        opted_in_args()


def test_cfg_parallel_only_with_serial_arithmetic(opted_in_args):
    args = opted_in_args()
    args.enable_cfg_parallel = True
    assert not args.pipeline_config.cfg_policy.parallel_uses_serial_arithmetic
    with pytest.raises(TrainParityError, match="--enable-cfg-parallel"):
        train_parity_requests.validate_server_args(args)
    args.pipeline_config.cfg_policy.parallel_uses_serial_arithmetic = True
    train_parity_requests.validate_server_args(args)


def test_tensor_parallel_starts_with_a_warning(train_parity_log, opted_in_args):
    assert opted_in_args(tp_size=2, num_gpus=2).tp_size == 2
    assert any("correct but not bitwise" in line for line in train_parity_log)


def test_requests_run_the_exact_tier(opted_in_args, train_parity_request):
    assert train_parity_request(opted_in_args()).quality == "exact"
    assert train_parity_request(opted_in_args(), quality="exact").quality == "exact"
    assert train_parity_request(opted_in_args(numerics="default")).quality != "exact"


@pytest.mark.parametrize(
    "request_kwargs, option",
    [
        (dict(quality="lossless"), "quality='lossless'"),
        (dict(quality="high"), "quality='high'"),
        (dict(enable_teacache=True), "enable_teacache"),
        (dict(enable_cache_dit=True), "enable_cache_dit"),
        (dict(enable_spectrum=True), "enable_spectrum"),
        (dict(guidance_rescale=0.7), "guidance_rescale=0.7"),
        (dict(cfg_normalization=1.5), "cfg_normalization=1.5"),
        (dict(cfg_gate_step=0.5), "cfg_gate_step=0.5"),
        (dict(attention_backend_override="fa"), "attention_backend_override='fa'"),
    ],
)
def test_request_option_is_refused(
    request_kwargs, option, opted_in_args, train_parity_request
):
    with pytest.raises(TrainParityError, match=f"does not support {option}: "):
        train_parity_request(opted_in_args(), **request_kwargs)
    train_parity_request(
        opted_in_args(numerics="default"), **request_kwargs
    )  # the default mode serves it
