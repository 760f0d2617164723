# SPDX-License-Identifier: Apache-2.0
"""``--numerics train_parity``: a DiT forward bitwise equal to the training forward.

RL trainers for diffusion models sample rollouts with sglang and train with
diffusers + PEFT LoRA (bf16 parameters, ``torch.autocast("cuda", bf16)``).
Under ``numerics="train_parity"`` the DiT of a family that opts in computes
exactly what that training forward computes, so the trainer's recompute of a
rollout step matches it bit for bit.

The mode's rules:

* How layers see the mode. Like the attention backend, it is scoped to
  construction: the transformer loader builds the DiT inside
  ``numerics_mode_context`` and ``CustomOp`` picks ``forward_train_parity`` once,
  in ``__init__``. Text encoders and VAEs are built outside it and keep the
  default numerics.
* Which models support it. A DiT family opts in with a ``TrainParityContract``
  in the body of its pipeline config class; every other model is refused at
  startup, and a loaded DiT that builds an op its contract does not list is
  refused before it serves.
* What the server and each request must hold to: ``train_parity_requests``.
* What a LoRA adapter may be: ``train_parity_lora``.
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
    check_pipeline(contract, args.pipeline_class_name)
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
