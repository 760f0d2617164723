# SPDX-License-Identifier: Apache-2.0
"""Per-step fingerprints of a rollout's DiT outputs, for an always-on parity check.

An RL trainer recomputes each rollout step with its own forward. With these
fingerprints in the rollout response it can check, at no transfer cost, that
every step's outputs are bitwise the ones it computes, instead of shipping the
tensors (``rollout_debug_mode``) and comparing them.

Format ``ROLLOUT_FINGERPRINT_FORMAT``, one record per output (row of the batch)::

    {"format": "sglang-rollout-fingerprint/v1", "cpu_threads": 2,
     "steps": [{"step": 0, "adapter": <hex>, "conditional": <fp>,
                "unconditional": <fp>, "combined": <fp>}, ...]}

* ``step``: the denoising-loop index.
* ``conditional`` / ``unconditional`` (the CFG branch names): the DiT's output for
  the row; ``combined``: the model output the scheduler steps with, after the CFG
  combine. A branch that returns several tensors adds ``.0``, ``.1``, ...
* ``<fp>``: ``tensor_fingerprint`` of the row (the batch dimension dropped):
  dtype, shape and the SHA-256 of the raw bytes (hardware-accelerated on current
  CPUs), e.g. ``bfloat16:256x64:5f3c...``.
* ``adapter``: the ``adapter`` checksum of ``policy_checksum.py`` for the DiT that
  ran the step (what ``/get_policy_checksum`` reports), so a mismatch can be told
  apart as a synced-adapter problem or a numerics one.
* ``cpu_threads`` (only when the DiT ran on the CPU): torch's intra-op thread
  count. CPU reductions split their work by it, so a recompute matches bitwise
  only with the same count.

Outputs are kept on their device during the loop and hashed when the rollout
ends, so recording adds no synchronization per step.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from sglang.multimodal_gen.runtime.post_training.policy_checksum import (
    cached_adapter_checksum,
)

ROLLOUT_FINGERPRINT_FORMAT = "sglang-rollout-fingerprint/v1"
COMBINED = "combined"


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    """``dtype:shape:sha256`` of ``tensor``'s raw bytes."""
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.sha256(data.data).hexdigest()
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}:{'x'.join(str(d) for d in tensor.shape)}:{digest}"


def _named_tensors(name: str, output: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(output, torch.Tensor):
        return [(name, output)]
    return [(f"{name}.{i}", t) for i, t in enumerate(output)]


class RolloutFingerprints:
    """Collects one request's per-step outputs and the adapter each step ran.

    Adapter updates wait for running requests, so each DiT's adapter checksum is
    read once per request (a walk over its LoRA layers), not once per step."""

    def __init__(self) -> None:
        self._steps: list[tuple[int, str, list[tuple[str, torch.Tensor]]]] = []
        self._adapters: dict[int, str] = {}
        self._cpu_threads: int | None = None

    def record_step(
        self,
        step_index: int,
        model: torch.nn.Module,
        branch_outputs: dict[str, Any],
        combined: Any,
    ) -> None:
        outputs = [
            (name, tensor.detach().clone())
            for branch, output in (*branch_outputs.items(), (COMBINED, combined))
            for name, tensor in _named_tensors(branch, output)
        ]
        if id(model) not in self._adapters:
            self._adapters[id(model)] = cached_adapter_checksum(model)
        if outputs[0][1].device.type == "cpu":
            self._cpu_threads = torch.get_num_threads()
        self._steps.append((step_index, self._adapters[id(model)], outputs))

    def per_output(self) -> list[dict[str, Any]]:
        """One fingerprint record per output row."""
        if not self._steps:
            return []
        # one copy to the host per output, then a hash per row
        steps = [
            (step, adapter, [(name, t.cpu()) for name, t in outputs])
            for step, adapter, outputs in self._steps
        ]
        rows = steps[0][2][0][1].shape[0]
        threads = (
            {} if self._cpu_threads is None else {"cpu_threads": self._cpu_threads}
        )
        return [
            {
                "format": ROLLOUT_FINGERPRINT_FORMAT,
                **threads,
                "steps": [
                    {
                        "step": step,
                        "adapter": adapter,
                        **{name: tensor_fingerprint(t[row]) for name, t in outputs},
                    }
                    for step, adapter, outputs in steps
                ],
            }
            for row in range(rows)
        ]
