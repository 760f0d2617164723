# SPDX-License-Identifier: Apache-2.0
"""What ``--numerics train_parity`` requires of the server and of each request.

train_parity promises a DiT forward bitwise equal to the training forward
(diffusers + PEFT LoRA under CUDA bf16 autocast). Options that change what
the forward computes cannot keep that promise, so they are rejected at startup
with the reason, never silently ignored. Options with exactly one valid value
are set to it when the user left them unset (and the log says so); an explicit
conflicting value is an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from sglang.multimodal_gen import envs
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger
from sglang.multimodal_gen.runtime.utils.numerics_mode import NUMERICS_TRAIN_PARITY

if TYPE_CHECKING:
    from sglang.multimodal_gen.runtime.server_args.server_args import ServerArgs

logger = init_logger(__name__)

# The training forward runs torch SDPA (diffusers' native attention backend).
ATTENTION_BACKEND = "torch_sdpa"
# PEFT keeps LoRA unmerged: base output with its bias, then the LoRA delta.
LORA_MERGE_MODE = "dynamic"
# Only the exact tier keeps the reference op sequence; lossless and high mount
# fusions that move roundings.
REQUEST_QUALITY = "exact"
# Request options that switch on step caches, which skip or reuse DiT work.
REQUEST_CACHE_OPTIONS = ("enable_teacache", "enable_cache_dit", "enable_spectrum")
# Where RoPE frequency tables are built: CPU and GPU `pow`/`polar` differ by
# ULPs, so the rollout must build them where the trainer does.
ROPE_TABLE_DEVICES = ("cpu", "device")


class TrainParityError(ValueError):
    """An option that --numerics train_parity cannot serve bitwise."""


def _reject(option: str, why: str) -> None:
    raise TrainParityError(f"--numerics train_parity does not support {option}: {why}")


def _set_only_value(args: ServerArgs, field: str, value: Any, unset: bool) -> None:
    current = getattr(args, field)
    if unset:
        if current != value:
            logger.info(
                "--numerics train_parity: setting %s=%r (its only valid value)",
                field,
                value,
            )
        setattr(args, field, value)
    elif current != value:
        _reject(f"{field}={current!r}", f"it requires {field}={value!r}")


def adjust_server_args(args: ServerArgs) -> None:
    """Set the options train_parity allows one value for; runs before the
    attention backend, parallelism and breakable-CUDA-graph defaults resolve."""
    if args.numerics != NUMERICS_TRAIN_PARITY:
        return
    _set_only_value(
        args, "attention_backend", ATTENTION_BACKEND, args.attention_backend is None
    )
    _set_only_value(
        args,
        "lora_merge_mode",
        LORA_MERGE_MODE,
        not args.is_arg_explicitly_set("lora_merge_mode"),
    )
    # Left unset, these resolve to a value train_parity cannot serve on some
    # hardware (several GPUs, pipelines opted into graph capture).
    if args.enable_breakable_cuda_graph is None:
        _set_only_value(args, "enable_breakable_cuda_graph", False, True)
    if args.sp_degree is None:
        _set_only_value(args, "sp_degree", 1, True)
    if args.enable_cfg_parallel is None and not _cfg_parallel_is_serial(args):
        _set_only_value(args, "enable_cfg_parallel", False, True)


def _cfg_parallel_is_serial(args: ServerArgs) -> bool:
    policy = getattr(args.pipeline_config, "cfg_policy", None)
    return bool(getattr(policy, "parallel_uses_serial_arithmetic", False))


def validate_server_args(args: ServerArgs) -> None:
    """Reject every option that cannot be bitwise under train_parity."""
    if args.train_parity_rope_tables not in ROPE_TABLE_DEVICES:
        raise ValueError(
            f"train_parity_rope_tables must be one of {ROPE_TABLE_DEVICES}, "
            f"got {args.train_parity_rope_tables!r}"
        )
    if args.numerics != NUMERICS_TRAIN_PARITY:
        if args.is_arg_explicitly_set("train_parity_rope_tables"):
            raise ValueError(
                "--train-parity-rope-tables applies only with --numerics train_parity"
            )
        return
    if args.backend == "diffusers":
        _reject(
            "--backend diffusers",
            "train_parity is implemented by sglang's native model classes",
        )
    for component, backend in (args.component_attention_backends or {}).items():
        if component.startswith("transformer") and backend != ATTENTION_BACKEND:
            _reject(
                f"--component-attention-backends {component}={backend}",
                f"the DiT must use {ATTENTION_BACKEND}",
            )
    if args.enable_torch_compile:
        _reject(
            "--enable-torch-compile",
            "Inductor fuses pointwise ops and moves bf16 roundings",
        )
    if args.enable_breakable_cuda_graph:
        _reject(
            "--enable-breakable-cuda-graph",
            "graph capture pads text to buckets and replays fixed weights",
        )
    if args.cache_dit_config is not None or envs.SGLANG_CACHE_DIT_ENABLED:
        _reject("cache-dit", "step caches skip or reuse DiT computation")
    if args.enable_cfg_parallel and not _cfg_parallel_is_serial(args):
        _reject(
            "--enable-cfg-parallel",
            "this pipeline's CFG-parallel combine is not the serial arithmetic "
            "n + s * (p - n) the trainer computes",
        )
    for name in ("sp_degree", "ulysses_degree", "ring_degree"):
        if (getattr(args, name, None) or 1) > 1:
            _reject(
                f"{name}={getattr(args, name)}",
                "sequence parallelism splits attention and its reductions",
            )
    if args.quantization is not None or "transformer" in (
        args.component_quantizations or {}
    ):
        _reject("quantized DiT weights", "the training forward uses bf16 weights")
    nunchaku = args.nunchaku_config
    if nunchaku is not None and getattr(nunchaku, "enable_svdquant", True):
        _reject("Nunchaku SVDQuant", "the training forward uses bf16 weights")
    if getattr(args.kv_cache_quant_config, "bits", None) is not None:
        _reject("--kv-cache-quant", "the training forward keeps K/V in bf16")
    dit_precision = getattr(args.pipeline_config, "dit_precision", "bf16")
    if dit_precision != "bf16":
        _reject(
            f"dit_precision={dit_precision!r}",
            "the training forward runs bf16 parameters",
        )
    if (args.tp_size or 1) > 1:
        logger.warning(
            "--numerics train_parity with tp_size=%d: results are correct but "
            "not bitwise equal to the training forward (tensor-parallel "
            "reductions run in another order)",
            args.tp_size,
        )


def _request_option_conflicts(params: Any) -> Iterator[tuple[str, str]]:
    """(option, why) for each request option that changes what the DiT or the
    CFG combine computes, relative to the training forward."""
    backend = params.attention_backend_override
    if backend is not None and backend.lower() != ATTENTION_BACKEND:
        yield (
            f"attention_backend_override={backend!r}",
            f"the DiT must use {ATTENTION_BACKEND}",
        )
    if params.skip_softmax_params is not None:
        yield "skip_softmax_params", "sparse attention skips softmax terms"
    if params.guidance_rescale:
        yield (
            f"guidance_rescale={params.guidance_rescale}",
            "the trainer's CFG has no std rescale",
        )
    if params.cfg_normalization and float(params.cfg_normalization) > 0:
        yield (
            f"cfg_normalization={params.cfg_normalization}",
            "the trainer's CFG has no norm clipping",
        )
    # None follows the server's default, which may be set by environment.
    gate = params.cfg_gate_step
    if gate is None:
        gate = envs.SGLANG_DIFFUSION_CFG_GATE_STEP
    if gate < 1.0:
        yield (
            f"cfg_gate_step={gate}",
            "CFG gating reuses earlier steps' unconditional prediction",
        )
    for option in REQUEST_CACHE_OPTIONS:
        if getattr(params, option, False):
            yield option, "step caches skip or reuse DiT computation"


def adjust_sampling_params(params: Any, server_args: ServerArgs) -> None:
    """Per request: force the exact quality tier; reject options that change
    the DiT forward or the CFG combine (see `_request_option_conflicts`)."""
    if getattr(server_args, "numerics", None) != NUMERICS_TRAIN_PARITY:
        return
    explicit = getattr(params, "_explicit_fields", set())
    if "quality" not in explicit:
        params.quality = REQUEST_QUALITY
    elif params.quality != REQUEST_QUALITY:
        raise TrainParityError(
            f"--numerics train_parity serves only quality={REQUEST_QUALITY!r}, "
            f"the request asks for quality={params.quality!r}"
        )
    for option, why in _request_option_conflicts(params):
        _reject(option, why)
