# SPDX-License-Identifier: Apache-2.0
"""The numerics mode the diffusion transformer's layers are built for.

``default`` runs sglang's own kernels. ``train_parity`` makes the DiT's forward
bitwise equal to the training forward of RL trainers (diffusers + PEFT LoRA,
bf16 parameters, CUDA autocast to bf16); see docs/numerics-contract.md of
sglang-train-parity.

Layers read the mode once, in ``__init__`` (``CustomOp`` chooses its forward at
construction), so the mode is scoped to construction: the transformer loader
sets it from ``ServerArgs.numerics`` around building the DiT. Components built
outside that scope (text encoders, VAE) keep the default numerics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

NUMERICS_DEFAULT = "default"
NUMERICS_TRAIN_PARITY = "train_parity"
NUMERICS_MODES = (NUMERICS_DEFAULT, NUMERICS_TRAIN_PARITY)

_numerics_mode: ContextVar[str] = ContextVar("numerics_mode", default=NUMERICS_DEFAULT)


def check_numerics_mode(mode: str) -> str:
    if mode not in NUMERICS_MODES:
        raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {mode!r}")
    return mode


def get_numerics_mode() -> str:
    """The mode layers constructed now are built for."""
    return _numerics_mode.get()


def is_train_parity() -> bool:
    return _numerics_mode.get() == NUMERICS_TRAIN_PARITY


@contextmanager
def numerics_mode_context(mode: str) -> Iterator[None]:
    """Build the layers constructed inside this block for ``mode``."""
    token = _numerics_mode.set(check_numerics_mode(mode))
    try:
        yield
    finally:
        _numerics_mode.reset(token)
