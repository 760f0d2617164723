# SPDX-License-Identifier: Apache-2.0
"""The trainer's side of rollout fingerprints: check a rollout step by step against the
outputs the trainer's own forward produced, without the rollout shipping any tensor.

Under ``--numerics train_parity`` every ``/rollout/generate`` response carries
``rollout_fingerprints`` (format ``sglang-rollout-fingerprint/v1``, defined in sglang's
``runtime/post_training/rollout_fingerprints.py``): per denoising step, a hash of each CFG
branch's DiT output, of the combined model output, and the adapter checksum the step ran with.
A trainer that recomputes the steps anyway hashes its own tensors and compares::

    from sglang_train_parity.fingerprints import verify_rollout

    verdict = verify_rollout(response["rollout_fingerprints"], trainer_steps, trainer_adapter)
    assert verdict.ok, verdict.explain()

``trainer_steps`` maps a step index to that step's outputs for this rollout's row (batch
dimension dropped), by branch name: ``{"conditional": pos, "unconditional": neg, "combined":
out}``; steps the trainer did not recompute are left out. ``trainer_adapter`` is
``trainer_policy_checksum(model, include_base=False)["adapter"]`` (sglang_train_parity.policy).
A model of several experts (Wan2.2 A14B: ``transformer`` while t >= the boundary, then
``transformer_2``) gives each recomputed step the adapter of the expert that ran it, by step
index: ``{0: adapter_1, 1: adapter_1, 2: adapter_2, ...}``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.multimodal_gen.runtime.post_training.rollout_fingerprints import (
    ROLLOUT_FINGERPRINT_FORMAT,
    tensor_fingerprint,
)


@dataclass
class StepCheck:
    """One recomputed step: which outputs differ, and whether the adapter matched."""

    step: int
    differing: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    adapter_equal: bool | None = None

    @property
    def equal(self) -> bool:
        return (
            not self.differing and not self.missing and self.adapter_equal is not False
        )


@dataclass
class Verdict:
    steps: list[StepCheck]
    not_recomputed: list[int]

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(step.equal for step in self.steps)

    @property
    def first_mismatch(self) -> StepCheck | None:
        return next((step for step in self.steps if not step.equal), None)

    def explain(self) -> str:
        if not self.steps:
            return "no step was recomputed: nothing to compare"
        bad = self.first_mismatch
        if bad is None:
            return f"all {len(self.steps)} recomputed steps bitwise equal"
        parts = [f"step {bad.step}"]
        if bad.differing:
            parts.append(f"{', '.join(bad.differing)} differ")
        if bad.missing:
            parts.append(f"{', '.join(bad.missing)} not in the rollout's fingerprints")
        if bad.adapter_equal is False:
            cause = "the engine ran another adapter than the trainer's (a sync problem)"
        elif bad.adapter_equal:
            cause = "with the trainer's adapter, so the forwards differ (a numerics problem)"
        else:
            cause = "adapter not compared"
        mismatched = sum(not step.equal for step in self.steps)
        return (
            f"{'; '.join(parts)}: {cause}; "
            f"{mismatched} of {len(self.steps)} recomputed steps differ"
        )


@contextmanager
def rollout_threads(rollout_fingerprints: Mapping[str, Any] | None) -> Iterator[None]:
    """Run the trainer's CPU recompute of a rollout with the intra-op thread count the
    rollout ran with (its fingerprints' ``cpu_threads``, present when the server's DiT ran
    on the CPU): CPU reductions split their work by the thread count, so the same forward
    can round differently with 2 threads and with 1 (a large ``sum`` does). A GPU rollout
    leaves the count as it is."""
    threads = (rollout_fingerprints or {}).get("cpu_threads")
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_fingerprints(outputs: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The fingerprints of one step's outputs, by name."""
    return {name: tensor_fingerprint(tensor) for name, tensor in outputs.items()}


class MalformedFingerprints(ValueError):
    """The rollout's fingerprints cannot be trusted as a record of its steps: a step
    recorded twice, a record without its step or adapter, a value of the wrong form."""


_FINGERPRINT = re.compile(r"[a-z0-9_]+:(\d+(x\d+)*)?:[0-9a-f]{64}")


def _record_problems(index: int, record: Any) -> Iterator[str]:
    if not isinstance(record, Mapping):
        yield f"record {index} is a {type(record).__name__}, not an object"
        return
    step = record.get("step")
    if type(step) is not int or step < 0:
        yield f"record {index} has step {step!r}, not a non-negative integer"
    if not isinstance(record.get("adapter"), str) or not record["adapter"]:
        yield f"record {index} (step {step!r}) has no adapter checksum"
    for name, value in record.items():
        if name in ("step", "adapter"):
            continue
        if not isinstance(value, str) or not _FINGERPRINT.fullmatch(value):
            yield (
                f"record {index} (step {step!r}) has {name}={value!r}, not a "
                "dtype:shape:sha256 fingerprint"
            )


def served_steps(rollout_fingerprints: Mapping[str, Any] | None) -> dict[int, Mapping]:
    """The rollout's records by step, after checking that each is well formed and that no
    step is recorded twice (a doctored record placed beside the real one must not pass)."""
    if not rollout_fingerprints:
        raise ValueError(
            "the rollout carries no fingerprints: serve with --numerics train_parity "
            "(or request rollout_return_fingerprints=true)"
        )
    if not isinstance(rollout_fingerprints, Mapping):
        raise MalformedFingerprints(
            f"rollout_fingerprints is a {type(rollout_fingerprints).__name__}, "
            "not an object"
        )
    if rollout_fingerprints.get("format") != ROLLOUT_FINGERPRINT_FORMAT:
        raise ValueError(
            f"fingerprint format {rollout_fingerprints.get('format')!r}, this verifier "
            f"reads {ROLLOUT_FINGERPRINT_FORMAT!r}"
        )
    records = rollout_fingerprints.get("steps")
    if not isinstance(records, list):
        raise MalformedFingerprints(
            f"rollout_fingerprints['steps'] is {type(records).__name__}, not a list"
        )
    threads = rollout_fingerprints.get("cpu_threads")
    if threads is not None and (type(threads) is not int or threads < 1):
        raise MalformedFingerprints(
            f"cpu_threads is {threads!r}, not a positive integer"
        )
    problems = [p for i, r in enumerate(records) for p in _record_problems(i, r)]
    if problems:
        raise MalformedFingerprints("; ".join(problems))
    counts = Counter(record["step"] for record in records)
    repeated = sorted(step for step, count in counts.items() if count > 1)
    if repeated:
        raise MalformedFingerprints(f"steps {repeated} are recorded more than once")
    return {record["step"]: record for record in records}


def verify_rollout(
    rollout_fingerprints: Mapping[str, Any] | None,
    trainer_steps: Mapping[int, Mapping[str, torch.Tensor]],
    trainer_adapter: str | Mapping[int, str] | None = None,
) -> Verdict:
    """Compare a rollout's fingerprints with the trainer's outputs of the same steps.
    `trainer_adapter`: the adapter checksum every step ran with, or one per recomputed step
    (by step index), or None not to compare adapters. Raises `MalformedFingerprints` for
    records that cannot be trusted (see `served_steps`)."""
    served = served_steps(rollout_fingerprints)
    unknown = sorted(set(trainer_steps) - set(served))
    if unknown:
        raise ValueError(f"steps {unknown} are not in the rollout ({sorted(served)})")
    if trainer_adapter is None or isinstance(trainer_adapter, str):
        adapters = dict.fromkeys(trainer_steps, trainer_adapter)
    else:
        adapters = dict(trainer_adapter)
        missing = sorted(set(trainer_steps) - set(adapters))
        if missing:
            raise ValueError(
                f"no trainer adapter given for the recomputed steps {missing}"
            )
    checks = []
    for step in sorted(trainer_steps):
        record = served[step]
        ours = step_fingerprints(trainer_steps[step])
        checks.append(
            StepCheck(
                step=step,
                differing=[n for n in ours if n in record and record[n] != ours[n]],
                missing=[n for n in ours if n not in record],
                adapter_equal=(
                    None
                    if adapters[step] is None
                    else record["adapter"] == adapters[step]
                ),
            )
        )
    return Verdict(checks, sorted(set(served) - set(trainer_steps)))
