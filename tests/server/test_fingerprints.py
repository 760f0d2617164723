"""Online parity verification by fingerprints (issue 14): every train_parity rollout carries
per-step fingerprints of its DiT outputs; the trainer hashes the outputs of its own recompute
and compares, with no tensor shipped. Against the session's `--numerics train_parity` server
on CPU: equal on every step for the trainer's adapter; a wrong adapter, or a forward that
differs with the right adapter, is caught and named by fingerprints alone."""

from __future__ import annotations

import os
import re

import pytest
import torch
from sglang_train_parity import rollout_demo as demo
from sglang_train_parity.fingerprints import (
    MalformedFingerprints,
    rollout_threads,
    verify_rollout,
)
from sglang_train_parity.policy import trainer_policy_checksum

pytestmark = pytest.mark.slow

CFG = demo.ROLLOUT_REQUEST["true_cfg_scale"]
# what a production rollout asks for: the trainer's inputs, no debug tensors
PRODUCTION = dict(rollout_debug_mode=False, num_inference_steps=3, seed=5)


def _adapter(model) -> str:
    return trainer_policy_checksum(model, include_base=False)["adapter"]


@pytest.fixture(scope="module")
def rollout(server, served):
    return demo.request_rollout(server, **PRODUCTION)


def test_every_step_is_bitwise_by_fingerprint(rollout, served):
    assert (
        "rollout_debug_tensors" not in rollout or not rollout["rollout_debug_tensors"]
    )
    fingerprints = rollout["rollout_fingerprints"]
    assert fingerprints["format"] == "sglang-rollout-fingerprint/v1"
    assert [s["step"] for s in fingerprints["steps"]] == [0, 1, 2]
    steps = demo.trainer_step_outputs(served, rollout, CFG)
    verdict = verify_rollout(fingerprints, steps, _adapter(served))
    assert verdict.ok, verdict.explain()
    assert verdict.explain() == "all 3 recomputed steps bitwise equal"


def test_a_wrong_adapter_is_caught_as_a_sync_problem(rollout, model_dir, adapters):
    from sglang_train_parity.reference import build_reference

    stale = build_reference(
        model_dir / "transformer", adapters[1], demo.LORA_RANK, demo.LORA_ALPHA
    )
    steps = demo.trainer_step_outputs(stale, rollout, CFG)
    verdict = verify_rollout(rollout["rollout_fingerprints"], steps, _adapter(stale))
    assert not verdict.ok
    assert verdict.first_mismatch.step == 0
    assert verdict.explain().startswith(
        "step 0; conditional, unconditional, combined differ: the engine ran another "
        "adapter than the trainer's (a sync problem)"
    )


def test_another_forward_is_caught_as_a_numerics_problem(rollout, served):
    """The trainer's adapter, a forward that is not the served one (the combine's norms in
    bf16 instead of fp32): only `combined` differs, and the verdict says numerics."""
    steps = demo.trainer_step_outputs(served, rollout, CFG)
    for outputs in steps.values():
        outputs["combined"] = outputs["combined"].bfloat16().float()
    verdict = verify_rollout(rollout["rollout_fingerprints"], steps, _adapter(served))
    assert not verdict.ok
    assert (
        "combined differ: with the trainer's adapter, so the forwards differ (a numerics"
        in (verdict.explain())
    )
    assert all(step.differing == ["combined"] for step in verdict.steps)


def test_a_subset_of_steps_can_be_checked(rollout, served):
    steps = demo.trainer_step_outputs(served, rollout, CFG)
    verdict = verify_rollout(rollout["rollout_fingerprints"], {2: steps[2]})
    assert verdict.ok and verdict.not_recomputed == [0, 1]


def test_fingerprints_can_be_declined(server, served):
    rollout = demo.request_rollout(
        server, **PRODUCTION, rollout_return_fingerprints=False
    )
    assert rollout["rollout_fingerprints"] is None
    with pytest.raises(ValueError, match="the rollout carries no fingerprints"):
        verify_rollout(rollout["rollout_fingerprints"], {})


def test_verifier_refuses_what_it_cannot_compare():
    record = {
        "format": "sglang-rollout-fingerprint/v1",
        "steps": [{"step": 0, "adapter": "0" * 64}],
    }
    with pytest.raises(ValueError, match=r"steps \[3\] are not in the rollout"):
        verify_rollout(record, {3: {"combined": torch.zeros(1)}})
    with pytest.raises(ValueError, match="this verifier reads"):
        verify_rollout({**record, "format": "v0"}, {})


def test_each_step_is_checked_against_the_adapter_that_ran_it():
    """Wan2.2 A14B: the trainer gives every step the adapter of the expert that ran it; a
    step checked against another expert's is named a sync problem."""
    from sglang.multimodal_gen.runtime.post_training.rollout_fingerprints import (
        tensor_fingerprint,
    )

    outputs = {"combined": torch.zeros(2, dtype=torch.bfloat16)}
    ran = ["high-noise", "high-noise", "low-noise"]
    record = {
        "format": "sglang-rollout-fingerprint/v1",
        "steps": [
            {
                "step": step,
                "adapter": adapter,
                "combined": tensor_fingerprint(outputs["combined"]),
            }
            for step, adapter in enumerate(ran)
        ],
    }
    steps = dict.fromkeys(range(3), outputs)
    assert verify_rollout(record, steps, dict(enumerate(ran))).ok
    verdict = verify_rollout(record, steps, dict.fromkeys(range(3), "high-noise"))
    assert [check.step for check in verdict.steps if not check.equal] == [2]
    assert "the engine ran another adapter than the trainer's" in verdict.explain()
    with pytest.raises(ValueError, match=r"no trainer adapter given .* steps \[2\]"):
        verify_rollout(record, steps, {0: "high-noise", 1: "high-noise"})


def _record(outputs, steps=(0, 1)):
    from sglang.multimodal_gen.runtime.post_training.rollout_fingerprints import (
        tensor_fingerprint,
    )

    return {
        "format": "sglang-rollout-fingerprint/v1",
        "steps": [
            {"step": step, "adapter": "a" * 64, "combined": tensor_fingerprint(out)}
            for step, out in zip(steps, outputs)
        ],
    }


def test_a_step_recorded_twice_is_refused():
    """A doctored record placed before the real one used to pass: the verifier kept the
    last record of each step."""
    real = torch.ones(3, dtype=torch.bfloat16)
    doctored = torch.zeros(3, dtype=torch.bfloat16)
    record = _record([real, real])
    assert verify_rollout(record, {0: {"combined": real}}, "a" * 64).ok
    forged = _record([doctored, real, real], steps=(0, 0, 1))
    with pytest.raises(MalformedFingerprints, match=r"steps \[0\] are recorded more"):
        verify_rollout(forged, {0: {"combined": doctored}}, "a" * 64)


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda r: r.pop("adapter"), "record 1 (step 1) has no adapter checksum"),
        (lambda r: r.pop("step"), "record 1 has step None"),
        (lambda r: r.update(step=True), "record 1 has step True"),
        (lambda r: r.update(step=-1), "record 1 has step -1"),
        (lambda r: r.update(combined="sha:1"), "has combined='sha:1', not a dtype"),
        (lambda r: r.update(combined=None), "has combined=None"),
    ],
    ids=["no adapter", "no step", "bool step", "negative step", "bad hash", "no hash"],
)
def test_a_malformed_record_is_refused_by_name(edit, named):
    """A record without `adapter` used to raise a bare KeyError."""
    out = torch.ones(3, dtype=torch.bfloat16)
    record = _record([out, out])
    edit(record["steps"][1])
    with pytest.raises(MalformedFingerprints, match=re.escape(named)):
        verify_rollout(record, {0: {"combined": out}}, "a" * 64)


@pytest.mark.parametrize(
    "fingerprints, named",
    [
        ({"format": "sglang-rollout-fingerprint/v1"}, "is NoneType, not a list"),
        ({"format": "sglang-rollout-fingerprint/v1", "steps": [3]}, "record 0 is a int"),
        ([1], "rollout_fingerprints is a list"),
        (
            {"format": "sglang-rollout-fingerprint/v1", "cpu_threads": 0, "steps": []},
            "cpu_threads is 0, not a positive integer",
        ),
    ],
    ids=["no steps", "record not an object", "not an object", "zero threads"],
)
def test_fingerprints_of_the_wrong_form_are_refused(fingerprints, named):
    with pytest.raises(MalformedFingerprints, match=re.escape(named)):
        verify_rollout(fingerprints, {})


def test_fifty_cpu_steps_are_bitwise_with_the_rollouts_thread_count(server, served):
    """CPU reductions split their work by torch's intra-op thread count (the control below).
    The fingerprints carry the server's count (this server runs 2, the tests' processes 1),
    and the trainer's recompute runs with it (`rollout_threads`): 50 steps bitwise."""
    rollout = demo.request_rollout(
        server, **{**PRODUCTION, "num_inference_steps": 50, "seed": 7}
    )
    fingerprints = rollout["rollout_fingerprints"]
    assert fingerprints["cpu_threads"] == 2 != torch.get_num_threads()
    steps = demo.trainer_step_outputs(served, rollout, CFG)
    verdict = verify_rollout(fingerprints, steps, _adapter(served))
    assert verdict.ok and len(verdict.steps) == 50, verdict.explain()


def test_cpu_bits_depend_on_the_thread_count():
    """The control for `rollout_threads`: a CPU sum large enough to be split across threads
    rounds differently with 1 and 2 threads."""
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
    sums = {}
    for threads in (1, 2):
        with rollout_threads({"cpu_threads": threads}):
            assert torch.get_num_threads() == threads
            sums[threads] = x.sum()
    assert not torch.equal(sums[1], sums[2])
