# SPDX-License-Identifier: Apache-2.0
"""A checksum of everything that determines a DiT's forward: its base weights and the
state of every LoRA adapter on it.

``/get_weights_checksum`` hashes a module's parameters. It does not see an adapter's rank,
alpha, strength, or whether it is merged or enabled, so after ``/v1/merge_lora_weights``
with another strength, or ``/v1/unmerge_lora_weights``, it can report the value it
reported before while the engine serves another policy. An RL trainer that syncs its
adapter after every step compares this checksum with the one it computes from its own
model the same way (the functions below take plain tensors and numbers), and so knows
the engine serves exactly its policy.

Format ``POLICY_CHECKSUM_FORMAT`` (SHA-256, hex):

* ``base``: the base parameters sorted by name, each as name, dtype, shape and raw
  bytes. LoRA wrappers' ``.base_layer`` is dropped from names (PEFT's names become the
  plain module's) and adapter tensors are not base parameters. A merged adapter shows
  here, in the merged weights.
* ``adapter``: every enabled adapter, sorted by module name, each as module name, rank,
  alpha, strength, merged, then A, B and the output offset (if any) as dtype, shape and
  raw bytes. A trainer hashes A and B as its forward uses them (the bf16 copies of fp32
  masters under FSDP2 mixed precision).
* ``policy``: the format, ``base`` and ``adapter`` together.

Tensors are hashed as each rank holds them: with tensor parallelism the values are a
rank's shards.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

POLICY_CHECKSUM_FORMAT = "sglang-policy-checksum/v1"
# a LoRA wrapper's adapter parameters (lora_A, lora_B: PEFT's names for them too)
ADAPTER_TENSOR_NAMES = ("lora_A", "lora_B", "lora_output_offset")


@dataclass(frozen=True)
class AdapterState:
    """One adapter as a Linear's forward applies it."""

    module: str
    rank: int
    alpha: float
    strength: float
    merged: bool
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    output_offset: torch.Tensor | None = None


def _update_tensor(hasher, tensor: torch.Tensor) -> None:
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    hasher.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def base_checksum(named_params: Iterable[tuple[str, torch.Tensor]]) -> str:
    hasher = hashlib.sha256()
    for name, tensor in sorted(named_params, key=lambda item: item[0]):
        hasher.update(name.encode())
        _update_tensor(hasher, tensor)
    return hasher.hexdigest()


def adapter_checksum(adapters: Iterable[AdapterState]) -> str:
    hasher = hashlib.sha256()
    for adapter in sorted(adapters, key=lambda a: a.module):
        hasher.update(
            f"{adapter.module}|{int(adapter.rank)}|{float(adapter.alpha)!r}|"
            f"{float(adapter.strength)!r}|{bool(adapter.merged)}".encode()
        )
        for tensor in (adapter.lora_A, adapter.lora_B, adapter.output_offset):
            if tensor is not None:
                _update_tensor(hasher, tensor)
    return hasher.hexdigest()


def policy_checksum(base: str, adapter: str) -> str:
    return hashlib.sha256(
        f"{POLICY_CHECKSUM_FORMAT}|{base}|{adapter}".encode()
    ).hexdigest()


def module_adapters(module: torch.nn.Module) -> list[AdapterState]:
    """The adapters the LoRA wrappers in ``module`` apply: every merged one, and the
    enabled unmerged one (what the dynamic forward adds)."""
    from sglang.multimodal_gen.runtime.layers.lora.linear import BaseLayerWithLoRA

    adapters = []
    for name, layer in module.named_modules():
        if not isinstance(layer, BaseLayerWithLoRA):
            continue
        if layer.merged:
            entries = [
                (lora_A, lora_B, strength, rank, alpha, offset)
                for lora_A, lora_B, _, strength, rank, alpha, offset in (
                    layer.lora_weights_list
                )
            ]
        elif not layer.disable_lora and layer.lora_A is not None:
            entries = [
                (
                    layer.lora_A,
                    layer.lora_B,
                    layer.strength,
                    layer.lora_rank,
                    layer.lora_alpha,
                    layer.lora_output_offset,
                )
            ]
        else:
            continue
        for lora_A, lora_B, strength, rank, alpha, offset in entries:
            rank = lora_A.shape[-2] if rank is None else rank
            alpha = rank if alpha is None else alpha  # no alpha: scaling 1
            adapters.append(
                AdapterState(
                    name, rank, alpha, strength, layer.merged, lora_A, lora_B, offset
                )
            )
    return adapters


def _same_object(ref: Any, tensor: torch.Tensor | None) -> bool:
    return (ref is None and tensor is None) or (ref is not None and ref() is tensor)


def cached_adapter_checksum(module: torch.nn.Module) -> str:
    """``adapter_checksum(module_adapters(module))``, recomputed only when an adapter's
    settings or tensors changed. ``set_lora_weights`` installs new tensors for every
    adapter it sets, so a changed adapter is a tensor that is not the cached one. A
    write in place keeps the tensor and, under ``torch.inference_mode`` or through
    ``.data``, its version counter too: whatever writes a module's parameters in place
    calls `forget_adapter_checksum`."""
    adapters = module_adapters(module)
    settings = [(a.module, a.rank, a.alpha, a.strength, a.merged) for a in adapters]
    tensors = [t for a in adapters for t in (a.lora_A, a.lora_B, a.output_offset)]
    cached = getattr(module, "_adapter_checksum_cache", None)
    if (
        cached is not None
        and cached[0] == settings
        and len(cached[1]) == len(tensors)
        and all(_same_object(ref, t) for ref, t in zip(cached[1], tensors))
    ):
        return cached[2]
    checksum = adapter_checksum(adapters)
    refs = [None if t is None else weakref.ref(t) for t in tensors]
    module._adapter_checksum_cache = (settings, refs, checksum)
    return checksum


def forget_adapter_checksum(module: torch.nn.Module) -> None:
    """Drop ``module``'s cached adapter checksum: its parameters were written in place."""
    module.__dict__.pop("_adapter_checksum_cache", None)


def module_base_params(
    named_params: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """A module's parameters without its adapters, LoRA wrappers' names made plain."""
    for name, tensor in named_params:
        if name.rsplit(".", 1)[-1] not in ADAPTER_TENSOR_NAMES:
            yield name.replace(".base_layer.", "."), tensor


def module_policy_checksum(
    module: torch.nn.Module,
    named_params: Iterable[tuple[str, torch.Tensor]],
    include_base: bool = True,
) -> dict[str, str]:
    """``module``'s checksums; ``named_params`` are its materialized parameters.
    Without ``include_base`` only ``adapter`` is computed (cheap: adapters are small).
    """
    result = {
        "format": POLICY_CHECKSUM_FORMAT,
        "adapter": adapter_checksum(module_adapters(module)),
    }
    if include_base:
        result["base"] = base_checksum(module_base_params(named_params))
        result["policy"] = policy_checksum(result["base"], result["adapter"])
    return result
