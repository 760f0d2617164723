# SPDX-License-Identifier: Apache-2.0
"""``--numerics train_parity``: a DiT forward bitwise equal to the training forward.

RL trainers for diffusion models sample rollouts with sglang and train with
diffusers + PEFT LoRA (bf16 parameters, ``torch.autocast("cuda", bf16)``).
Under ``numerics="train_parity"`` the DiT of a family that opts in computes
exactly what that training forward computes, so the trainer's recompute of a
rollout step matches it bit for bit.

The mode's rules live here:

* How layers see the mode. Like the attention backend, it is scoped to
  construction: the transformer loader builds the DiT inside
  ``numerics_mode_context`` and ``CustomOp`` picks ``forward_train_parity`` once,
  in ``__init__``. Text encoders and VAEs are built outside it and keep the
  default numerics.
* Which models support it. A DiT family opts in with a ``TrainParityContract``
  in the body of its pipeline config class; every other model is refused at
  startup, and a loaded DiT that builds an op its contract does not list is
  refused before it serves.
* What the server and each request must hold to. Options that change what
  the DiT or the CFG combine computes are refused at startup or per request,
  never ignored; options with one valid value are set to it when left unset
  (the log says so), and an explicit other value is refused.
* What a LoRA adapter may be: one unmerged PEFT adapter at strength 1, as the
  trainer runs it, whichever entry point sets it (``check_lora``).
* ``TrainParityError``, the one error type of every train_parity refusal.

The mode is independent of the per-request ``quality`` tiers and of the
process-wide switches of ``numerics_policy`` (TF32, bf16 reduced-precision
reduction), which trainer and rollout must set alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sglang.multimodal_gen import envs
from sglang.multimodal_gen.runtime.utils import request_bounds
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

if TYPE_CHECKING:
    from sglang.multimodal_gen.runtime.server_args.server_args import ServerArgs

logger = init_logger(__name__)

NUMERICS_DEFAULT = "default"
NUMERICS_TRAIN_PARITY = "train_parity"
NUMERICS_MODES = (NUMERICS_DEFAULT, NUMERICS_TRAIN_PARITY)

# Where RoPE frequency tables are built under train_parity: on the device the
# DiT runs on, as trainers that rebuild them there do (the default), or on the
# CPU as diffusers builds them in __init__. CPU and GPU pow/polar differ by
# ULPs, so the rollout must build them where the trainer does.
ROPE_TABLE_DEVICES = ("device", "cpu")

_numerics_mode: ContextVar[str] = ContextVar("numerics_mode", default=NUMERICS_DEFAULT)
_rope_tables: ContextVar[str] = ContextVar(
    "train_parity_rope_tables", default=ROPE_TABLE_DEVICES[0]
)


def check_numerics_mode(mode: str) -> str:
    if mode not in NUMERICS_MODES:
        raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {mode!r}")
    return mode


def get_numerics_mode() -> str:
    """The mode layers constructed now are built for."""
    return _numerics_mode.get()


def is_train_parity() -> bool:
    return _numerics_mode.get() == NUMERICS_TRAIN_PARITY


def check_rope_tables(rope_tables: str) -> str:
    if rope_tables not in ROPE_TABLE_DEVICES:
        raise ValueError(
            f"train_parity_rope_tables must be one of {ROPE_TABLE_DEVICES}, "
            f"got {rope_tables!r}"
        )
    return rope_tables


def train_parity_rope_tables() -> str:
    """Where train_parity DiTs constructed now build their RoPE tables."""
    return _rope_tables.get()


@contextmanager
def numerics_mode_context(
    mode: str, rope_tables: str = ROPE_TABLE_DEVICES[0]
) -> Iterator[None]:
    """Build the layers constructed inside this block for ``mode`` (and, under
    train_parity, with RoPE tables built where ``rope_tables`` says)."""
    mode_token = _numerics_mode.set(check_numerics_mode(mode))
    tables_token = _rope_tables.set(check_rope_tables(rope_tables))
    try:
        yield
    finally:
        _rope_tables.reset(tables_token)
        _numerics_mode.reset(mode_token)


class TrainParityError(ValueError):
    """Something --numerics train_parity cannot serve bitwise: the option or
    input, why it would not match the training forward, and what to do instead."""

    def __init__(self, option: str, why: str, instead: str):
        super().__init__(
            f"--numerics train_parity does not support {option}: {why}; {instead}"
        )


@dataclass(frozen=True)
class TrainParityContract:
    """What a DiT family promises under ``numerics="train_parity"``.

    Declared as ``train_parity_contract`` in the body of the family's pipeline
    config class; subclasses (edit, layered, distilled variants) do not
    inherit it, since their pipelines compute other things.
    """

    # The name users know the family by.
    family: str
    # The training forward the DiT is bitwise equal to.
    reference: str
    # Class name of the DiT that implements it.
    dit: str
    # Class names of the CustomOps the DiT's train_parity forward calls, each
    # with a forward_train_parity. A DiT that builds another op is refused when
    # it is loaded: the op would run a forward nobody checked against the
    # reference.
    ops: tuple[str, ...]
    # CustomOps the DiT builds only for their parameters, which its train_parity
    # forward reads without calling the op (calling one raises).
    parameter_only_ops: tuple[str, ...] = ()
    # The request fields that carry the trainer's CFG scales. Every request
    # must set each of them: left unset, the pipeline would guide with a
    # default (its own or the sampling params class's) the trainer does not
    # know.
    cfg_scale_fields: tuple[str, ...] = ()
    # True where the trainer's step is one unguided forward: every CFG scale
    # field must then be 1.
    unguided: bool = False
    # The pipeline classes whose stages compute the trainer's step, where the
    # config serves several; empty for all.
    pipeline_classes: tuple[str, ...] = ()
    # Pixels along the height and the width per DiT token: the VAE's spatial
    # downsampling times the DiT's patch size. A request's width and height
    # must each be a whole number of patches.
    pixels_per_patch: int = field(kw_only=True)


def train_parity_contract(pipeline_config: Any) -> TrainParityContract | None:
    """The contract declared by ``pipeline_config``'s own class (or by that class, when
    given one), not a parent's."""
    config_cls = (
        pipeline_config if isinstance(pipeline_config, type) else type(pipeline_config)
    )
    return vars(config_cls).get("train_parity_contract")


def supported_families() -> str:
    """Every registered family with a contract, for error messages."""
    from sglang.multimodal_gen.registry import get_registered_pipeline_config_classes

    contracts = {
        f"{contract.family} ({config_cls.__name__})"
        for config_cls in get_registered_pipeline_config_classes()
        if (contract := train_parity_contract(config_cls)) is not None
    }
    return ", ".join(sorted(contracts)) or "none"


def require_contract(args: ServerArgs) -> TrainParityContract:
    """The served model's contract; a model without one is refused."""
    contract = train_parity_contract(args.pipeline_config)
    if contract is None:
        config_cls = type(args.pipeline_config)
        covered_parent = next(
            (
                parent
                for parent in config_cls.__mro__[1:]
                if train_parity_contract(parent) is not None
            ),
            None,
        )
        why = "its DiT family declares no train_parity forward"
        if covered_parent is not None:
            why = (
                f"train_parity covers {train_parity_contract(covered_parent).family} "
                f"({covered_parent.__name__}), not this variant, whose pipeline "
                "computes something else"
            )
        raise TrainParityError(
            f"the model {args.model_path} (pipeline {config_cls.__name__})",
            why,
            f"serve a supported family: {supported_families()}",
        )
    # None: the pipeline the model's model_index.json names (checked when built)
    check_pipeline(contract, getattr(args, "pipeline_class_name", None))
    return contract


def check_pipeline(contract: TrainParityContract, pipeline: str | None) -> None:
    """The pipeline serving the model must be one whose stages compute the
    trainer's step, where the contract names them."""
    if pipeline is None or not contract.pipeline_classes:
        return
    if pipeline not in contract.pipeline_classes:
        raise TrainParityError(
            f"the pipeline {pipeline}",
            f"{contract.family}'s train_parity step is that of "
            f"{', '.join(contract.pipeline_classes)}",
            f"serve {contract.pipeline_classes[0]}",
        )


def check_model_supported(args: ServerArgs) -> None:
    """At startup: under train_parity, refuse a model without a contract, and say
    what the served one promises."""
    if args.numerics == NUMERICS_TRAIN_PARITY:
        contract = require_contract(args)
        logger.info(
            "--numerics train_parity: %s, bitwise equal to %s",
            contract.family,
            contract.reference,
        )


def check_dit_class(contract: TrainParityContract, dit_cls: type) -> None:
    """Before the DiT is built: it must be the class the contract names."""
    if dit_cls.__name__ != contract.dit:
        raise TrainParityError(
            f"the DiT class {dit_cls.__name__}",
            f"{contract.family}'s train_parity forward is {contract.dit}'s",
            "serve the family's own transformer",
        )


def module_numerics(module: nn.Module) -> str:
    """The mode a DiT was built for (``BaseDiT`` records it); modules built
    elsewhere run the default numerics."""
    return getattr(module, "numerics", NUMERICS_DEFAULT)


def refuse_forward(op: nn.Module, *args: Any, **kwargs: Any) -> None:
    """The forward of a CustomOp built under train_parity without a
    forward_train_parity: it raises instead of running another forward."""
    raise TrainParityError(
        f"calling {type(op).__name__}",
        "it has no forward_train_parity",
        "give it one, or compute its output in the model's train_parity forward",
    )


def hold_parameters_in_bf16(dit: nn.Module) -> None:
    """The training forward uses every parameter as the bf16 rounding of its fp32
    master (FSDP2's param_dtype). Parameters a DiT keeps in fp32 for its default
    path (e.g. Wan's cross-attention norm) are rounded once here; weight updates
    copy into the parameter's dtype, so they round the same way."""
    for param in dit.parameters():
        if param.dtype == torch.float32:
            param.data = param.data.to(torch.bfloat16)


def check_dit_ops(contract: TrainParityContract, dit: nn.Module) -> None:
    """After the DiT is built: every CustomOp it holds is one the contract lists,
    with a forward_train_parity unless it is held only for its parameters."""
    from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp

    def checked(op: CustomOp) -> bool:
        name = type(op).__name__
        if name in contract.parameter_only_ops:
            return True
        has_forward = op._defined_forward("forward_train_parity") is not None
        return name in contract.ops and has_forward

    unchecked = sorted(
        {
            type(module).__name__
            for module in dit.modules()
            if isinstance(module, CustomOp) and not checked(module)
        }
    )
    if unchecked:
        raise TrainParityError(
            f"{contract.family}'s DiT with the ops {', '.join(unchecked)}",
            "they have no forward checked against the training forward",
            f"give each a forward_train_parity and list it in {contract.family}'s "
            "train_parity_contract",
        )


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
    policy = getattr(args.pipeline_config, "cfg_policy", None)
    return bool(getattr(policy, "parallel_uses_serial_arithmetic", False))


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
        if (getattr(args, name, None) or 1) > 1:
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
    if nunchaku is not None and getattr(nunchaku, "enable_svdquant", True):
        yield (
            "Nunchaku SVDQuant",
            "the training forward uses bf16 weights",
            "serve the bf16 checkpoint",
        )
    if getattr(args.kv_cache_quant_config, "bits", None) is not None:
        yield (
            "--kv-cache-quant",
            "the training forward keeps K/V in bf16",
            "leave K/V unquantized",
        )
    dit_precision = getattr(args.pipeline_config, "dit_precision", "bf16")
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
        if getattr(params, option, False):
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


def check_lora_update(lora_rank: Any, lora_alpha: Any) -> None:
    """An adapter pushed as tensors states its rank and alpha."""
    missing = [
        name
        for name, value in (("lora_rank", lora_rank), ("lora_alpha", lora_alpha))
        if value is None
    ]
    if missing:
        raise TrainParityError(
            f"a LoRA update without {' and '.join(missing)}",
            "the adapter's scale alpha / rank is not in its tensors, and the "
            "default alpha = rank serves another policy than the trainer's",
            "send the trainer's lora_rank and lora_alpha",
        )


_UNMERGED = (
    "PEFT adds the update to the base layer's output; a weight with the update "
    "merged in rounds differently"
)


def lora_conflicts(
    strengths: tuple[float, ...] = (1.0,),
    strength_option: str = "LoRA strength",
    merge: bool = False,
    stacked_adapters: bool = False,
    output_offset: bool = False,
    stacked_ab: bool = False,
) -> Iterator[tuple[str, str, str]]:
    """(option, why, instead) for each way a LoRA setting departs from the one
    unmerged PEFT adapter at strength 1 the trainer runs."""
    for strength in strengths:
        if strength != 1.0:
            yield (
                f"{strength_option} {strength}",
                "the trainer applies its adapter at strength 1",
                "set strength 1.0 (scale the adapter's alpha in training instead)",
            )
    if merge:
        yield "merged LoRA weights", _UNMERGED, "keep --lora-merge-mode dynamic"
    if stacked_adapters:
        yield (
            "several LoRA adapters at once",
            "the trainer runs one PEFT adapter",
            "set one adapter",
        )
    if output_offset:
        yield "a LoRA output offset", "PEFT's adapter has none", "drop the offset"
    if stacked_ab:
        yield (
            "stacked (3-D) LoRA A/B",
            "PEFT's adapter is one A/B pair per Linear",
            "send one pair per projection",
        )


def check_lora(**settings: Any) -> None:
    """Refuse the first of ``lora_conflicts(**settings)``."""
    for option, why, instead in lora_conflicts(**settings):
        raise TrainParityError(option, why, instead)


def refuse_lora_endpoint(endpoint: str) -> None:
    """Merging, re-scaling or disabling the served adapter."""
    raise TrainParityError(
        endpoint,
        f"{_UNMERGED}, and disabling or re-scaling the adapter would serve a "
        "policy the trainer does not run",
        "push the trainer's adapter with /update_weights_from_tensor or "
        "/v1/set_lora (strength 1)",
    )


def check_peft_config(config: dict[str, Any]) -> None:
    """A PEFT adapter loaded from disk: plain LoRA without dropout."""
    problems = [name for name in ("use_rslora", "use_dora") if config.get(name)]
    if config.get("lora_dropout"):
        problems.append(f"lora_dropout={config['lora_dropout']}")
    if problems:
        raise TrainParityError(
            f"a PEFT adapter with {', '.join(problems)}",
            "train_parity reproduces plain PEFT LoRA without dropout",
            "train with use_rslora=False, use_dora=False, lora_dropout=0",
        )
