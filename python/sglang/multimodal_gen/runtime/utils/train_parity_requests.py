# SPDX-License-Identifier: Apache-2.0
"""What the server and each request must hold to under ``--numerics train_parity``.

Options that change what the DiT or the CFG combine computes are refused at
startup or per request, never ignored; options with one valid value are set to
it when left unset (the log says so), and an explicit other value is refused.

Request inputs that would fail once the request runs, or silently take a
default the trainer does not know, are refused at admission.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sglang.multimodal_gen import envs
from sglang.multimodal_gen.runtime.utils import request_bounds
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger
from sglang.multimodal_gen.runtime.utils.train_parity import (
    NUMERICS_DEFAULT,
    NUMERICS_TRAIN_PARITY,
    TrainParityError,
    check_rope_tables,
    train_parity_contract,
)
from sglang.multimodal_gen.runtime.utils.train_parity_lora import check_lora

if TYPE_CHECKING:
    from sglang.multimodal_gen.runtime.server_args.server_args import ServerArgs

logger = init_logger(__name__)


# Options with exactly one value the training forward allows, and why.
_ONE_VALUE_OPTIONS = {
    "attention_backend": (
        "torch_sdpa",
        "the training forward attends with torch SDPA (diffusers' native backend)",
    ),
    "lora_merge_mode": (
        "dynamic",
        "PEFT keeps LoRA unmerged: the base output with its bias, then the update",
    ),
    "enable_breakable_cuda_graph": (
        False,
        "graph capture pads text to buckets and replays fixed weights",
    ),
    "sp_degree": (1, "sequence parallelism splits attention and its reductions"),
    "enable_cfg_parallel": (
        False,
        "this pipeline's CFG-parallel combine is not the serial n + s * (p - n) "
        "the trainer computes",
    ),
    "disable_autocast": (
        True,
        "the denoising stage's autocast would recast the ops whose dtypes the "
        "train_parity forward already sets as the trainer's autocast does",
    ),
}
# Request options that switch on step caches, which skip or reuse DiT work.
REQUEST_CACHE_OPTIONS = ("enable_teacache", "enable_cache_dit", "enable_spectrum")
# Only the exact tier keeps the training forward's op sequence; lossless and
# high mount fusions that move roundings.
REQUEST_QUALITY = "exact"
# Device memory per image pixel below which no request can run: the VAE
# decoder holds at least one 128-channel bf16 activation at full resolution.
MIN_BYTES_PER_PIXEL = 256
# A request's generator_device: the CPU, or the server's accelerator.
GENERATOR_DEVICES = ("cpu", "cuda")


def _set_only_value(args: ServerArgs, field: str, unset: bool) -> None:
    value, why = _ONE_VALUE_OPTIONS[field]
    current = getattr(args, field)
    if not unset:
        if current != value:
            raise TrainParityError(
                f"{field}={current!r}", why, f"leave it unset or set {value!r}"
            )
        return
    if current != value:
        logger.info(
            "--numerics train_parity: setting %s=%r (its only valid value)",
            field,
            value,
        )
    setattr(args, field, value)


def _cfg_parallel_is_serial(args: ServerArgs) -> bool:
    return args.pipeline_config.cfg_policy.parallel_uses_serial_arithmetic


def adjust_server_args(args: ServerArgs) -> None:
    """Set the options train_parity allows one value for; runs before the
    attention backend, parallelism and breakable-CUDA-graph defaults resolve.
    The pipeline config carries the mode in every mode."""
    args.pipeline_config.numerics = args.numerics
    if args.numerics != NUMERICS_TRAIN_PARITY:
        return
    _set_only_value(args, "attention_backend", args.attention_backend is None)
    _set_only_value(
        args, "lora_merge_mode", not args.is_arg_explicitly_set("lora_merge_mode")
    )
    # Left unset, these resolve to a value train_parity cannot serve on some
    # hardware (several GPUs, pipelines opted into graph capture).
    _set_only_value(
        args,
        "enable_breakable_cuda_graph",
        args.enable_breakable_cuda_graph is None,
    )
    _set_only_value(args, "sp_degree", args.sp_degree is None)
    if args.enable_cfg_parallel is None and not _cfg_parallel_is_serial(args):
        _set_only_value(args, "enable_cfg_parallel", True)
    _set_only_value(args, "disable_autocast", args.disable_autocast is None)
    if args.train_parity_max_image_pixels is None:
        args.train_parity_max_image_pixels = max_image_pixels()
        logger.info(
            "--numerics train_parity: requests up to %d pixels (device memory / "
            "%d bytes; --train-parity-max-image-pixels sets another bound)",
            args.train_parity_max_image_pixels,
            MIN_BYTES_PER_PIXEL,
        )
    request_bounds.log_bounds(args)


def max_image_pixels() -> int:
    """The default bound on a request's width * height: larger images cannot
    fit in device memory."""
    from sglang.multimodal_gen.runtime.platforms import current_platform

    return current_platform.get_device_total_memory() // MIN_BYTES_PER_PIXEL


def _server_option_conflicts(args: ServerArgs) -> Iterator[tuple[str, str, str]]:
    """(option, why, instead) for each server option the training forward rules out."""
    for field in ("attention_backend", "lora_merge_mode", "disable_autocast"):
        if getattr(args, field) != _ONE_VALUE_OPTIONS[field][0]:
            value, why = _ONE_VALUE_OPTIONS[field]
            yield f"{field}={getattr(args, field)!r}", why, f"set {value!r}"
    if args.batching_max_size > 1:
        yield (
            f"--batching-max-size {args.batching_max_size}",
            "requests batched into one forward run at another batch size than "
            "the trainer's recompute of each rollout",
            "leave it at 1",
        )
    if args.backend == "diffusers":
        yield (
            "--backend diffusers",
            "train_parity is implemented by sglang's native model classes",
            "use the native backend",
        )
    attention_backend, why = _ONE_VALUE_OPTIONS["attention_backend"]
    for component, backend in (args.component_attention_backends or {}).items():
        if component.startswith("transformer") and backend != attention_backend:
            yield (
                f"--component-attention-backends {component}={backend}",
                why,
                f"use {attention_backend} for the transformer",
            )
    if args.enable_torch_compile:
        yield (
            "--enable-torch-compile",
            "Inductor fuses pointwise ops and moves bf16 roundings",
            "run eager",
        )
    if args.cache_dit_config is not None or envs.SGLANG_CACHE_DIT_ENABLED:
        yield (
            "cache-dit",
            "step caches skip or reuse DiT computation",
            "unset cache_dit_config and SGLANG_CACHE_DIT_ENABLED",
        )
    if args.enable_cfg_parallel and not _cfg_parallel_is_serial(args):
        yield (
            "--enable-cfg-parallel",
            _ONE_VALUE_OPTIONS["enable_cfg_parallel"][1],
            "run CFG serially",
        )
    for name in ("ulysses_degree", "ring_degree"):
        if (getattr(args, name) or 1) > 1:
            yield (
                f"{name}={getattr(args, name)}",
                _ONE_VALUE_OPTIONS["sp_degree"][1],
                "run one sequence-parallel rank",
            )
    if args.quantization is not None or "transformer" in (
        args.component_quantizations or {}
    ):
        yield (
            "quantized DiT weights",
            "the training forward uses bf16 weights",
            "serve the bf16 checkpoint",
        )
    nunchaku = args.nunchaku_config
    # the resolved NunchakuConfig has no switch: SVDQuant is on
    if nunchaku is not None and getattr(nunchaku, "enable_svdquant", True):
        yield (
            "Nunchaku SVDQuant",
            "the training forward uses bf16 weights",
            "serve the bf16 checkpoint",
        )
    if args.kv_cache_quant_config.bits is not None:
        yield (
            "--kv-cache-quant",
            "the training forward keeps K/V in bf16",
            "leave K/V unquantized",
        )
    dit_precision = args.pipeline_config.dit_precision
    if dit_precision != "bf16":
        yield (
            f"dit_precision={dit_precision!r}",
            "the training forward runs bf16 parameters",
            "use bf16",
        )


def validate_server_args(args: ServerArgs) -> None:
    """Refuse every server option that cannot be bitwise under train_parity."""
    check_rope_tables(args.train_parity_rope_tables)
    request_bounds.validate_server_args(args)
    if args.numerics != NUMERICS_TRAIN_PARITY:
        for field in ("train_parity_rope_tables", *request_bounds.BOUNDS):
            if args.is_arg_explicitly_set(field):
                raise ValueError(
                    f"--{field.replace('_', '-')} applies only with "
                    "--numerics train_parity"
                )
        return
    for option, why, instead in _server_option_conflicts(args):
        raise TrainParityError(option, why, instead)
    check_lora(strengths=(args.lora_scale,), strength_option="--lora-scale")
    if (args.tp_size or 1) > 1:
        logger.warning(
            "--numerics train_parity with tp_size=%d: results are correct but "
            "not bitwise equal to the training forward (tensor-parallel "
            "reductions run in another order)",
            args.tp_size,
        )


def _request_option_conflicts(params: Any) -> Iterator[tuple[str, str, str]]:
    """(option, why, instead) for each request option that changes what the DiT
    or the CFG combine computes, relative to the training forward."""
    attention_backend, why = _ONE_VALUE_OPTIONS["attention_backend"]
    backend = params.attention_backend_override
    if backend is not None and backend.lower() != attention_backend:
        yield f"attention_backend_override={backend!r}", why, "drop the override"
    if params.skip_softmax_params is not None:
        yield (
            "skip_softmax_params",
            "sparse attention skips softmax terms",
            "drop skip_softmax_params",
        )
    if params.guidance_rescale:
        yield (
            f"guidance_rescale={params.guidance_rescale}",
            "the trainer's CFG has no std rescale",
            "set guidance_rescale=0",
        )
    if params.cfg_normalization and float(params.cfg_normalization) > 0:
        yield (
            f"cfg_normalization={params.cfg_normalization}",
            "the trainer's CFG has no norm clipping",
            "set cfg_normalization=0",
        )
    # None follows the server's default, which may be set by environment.
    gate = params.cfg_gate_step
    if gate is None:
        gate = envs.SGLANG_DIFFUSION_CFG_GATE_STEP
    if gate < 1.0:
        yield (
            f"cfg_gate_step={gate}",
            "CFG gating reuses earlier steps' unconditional prediction",
            "set cfg_gate_step=1",
        )
    for option in REQUEST_CACHE_OPTIONS:
        if getattr(params, option):
            yield (
                option,
                "step caches skip or reuse DiT computation",
                f"drop {option}",
            )


def adjust_sampling_params(params: Any, server_args: ServerArgs) -> None:
    """Per request: the exact quality tier; refuse options that change the DiT
    forward or the CFG combine (see `_request_option_conflicts`)."""
    # Lighter stand-ins for ServerArgs (tests, tools) carry no numerics: the default.
    if getattr(server_args, "numerics", NUMERICS_DEFAULT) != NUMERICS_TRAIN_PARITY:
        return
    explicit = getattr(params, "_explicit_fields", set())
    if "quality" not in explicit:
        params.quality = REQUEST_QUALITY
    elif params.quality != REQUEST_QUALITY:
        raise TrainParityError(
            f"quality={params.quality!r}",
            "the lossless and high tiers mount fusions that move roundings",
            f"leave quality unset or set {REQUEST_QUALITY!r}",
        )
    for option, why, instead in _request_option_conflicts(params):
        raise TrainParityError(option, why, instead)
    for option, why, instead in _request_input_problems(params, server_args):
        raise TrainParityError(option, why, instead)


def _request_input_problems(
    params: Any, server_args: ServerArgs
) -> Iterator[tuple[str, str, str]]:
    """(option, why, instead) for each request input refused at admission,
    rather than failing, or silently defaulting, once the request runs."""
    from sglang.multimodal_gen.runtime.platforms import current_platform

    contract = train_parity_contract(server_args.pipeline_config)
    explicit = getattr(params, "_explicit_fields", None)
    for field in contract.cfg_scale_fields if contract else ():
        if explicit is not None:
            unset = field not in explicit
        else:  # params built without a record of the request's fields
            unset = getattr(params, field, None) is None
        if unset:
            yield (
                f"a request without {field}",
                "the pipeline would guide with a default scale the trainer does "
                "not know",
                f"set {field} (1 for no CFG)",
            )
        elif contract.unguided and getattr(params, field) != 1:
            yield (
                f"{field}={getattr(params, field)}",
                f"{contract.family}'s trainer steps without CFG",
                f"set {field}=1",
            )
    yield from request_bounds.request_problems(params, server_args)
    for side in ("width", "height") if contract else ():
        size, patch = getattr(params, side), contract.pixels_per_patch
        if size is not None and (size < patch or size % patch):
            yield (
                f"{side}={size}",
                f"{contract.family}'s DiT reads {patch}x{patch}-pixel patches (the "
                f"VAE's downsampling times the patch size), and {size} pixels are "
                "not a whole number of them",
                f"request a {side} that is a multiple of {patch}",
            )
    if (
        params.resolve_task_type(server_args.pipeline_config).is_image_gen()
        and not server_args.pipeline_config.allow_set_num_frames()
    ):
        ignored = [f"num_frames={params.num_frames}"] if params.num_frames != 1 else []
        if explicit is not None and "fps" in explicit:
            ignored.append(f"fps={params.fps}")
        if ignored:
            yield (
                f"{' and '.join(ignored)} on an image model",
                "the pipeline generates one image and would ignore it",
                "drop the video field(s)",
            )
    device = params.generator_device
    if device is not None and device not in GENERATOR_DEVICES:
        yield (
            f"generator_device={device!r}",
            "it names no device this server generates noise on",
            f"set one of {GENERATOR_DEVICES} or leave it unset",
        )
    elif device == "cpu" and params.rollout and not current_platform.is_cpu():
        yield (
            "generator_device='cpu' in a rollout on this server",
            f"the rollout draws its SDE noise on {current_platform.device_type} "
            "with the request's generator",
            f"set {current_platform.device_type!r} or leave it unset",
        )


def check_request_fields(unknown: list[str], server_args: ServerArgs) -> None:
    """Top-level request fields the endpoint does not read: refused under
    train_parity, where a misplaced option must not be dropped silently."""
    if unknown and server_args.numerics == NUMERICS_TRAIN_PARITY:
        raise TrainParityError(
            f"the unknown request field(s) {', '.join(sorted(unknown))}",
            "the server would ignore them",
            "put sampling options in extra_sampling_params",
        )
