# SPDX-License-Identifier: Apache-2.0
"""Per-step rollout fingerprints: one record per output row, each step's branch and
combined outputs hashed as raw bytes with dtype and shape, and the adapter the step
ran with."""

import types

import pytest
import torch
from torch import nn

from sglang.multimodal_gen.runtime.entrypoints.post_training import rollout_api
from sglang.multimodal_gen.runtime.layers.lora.linear import wrap_with_lora_layer
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch
from sglang.multimodal_gen.runtime.post_training import policy_checksum
from sglang.multimodal_gen.runtime.post_training.rl_dataclasses import (
    RolloutTrajectoryData,
    concat_rollout_trajectory_data,
    select_output_rollout_trajectory,
)
from sglang.multimodal_gen.runtime.post_training.rollout_fingerprints import (
    ROLLOUT_FINGERPRINT_FORMAT,
    RolloutFingerprints,
    tensor_fingerprint,
)
from sglang.multimodal_gen.runtime.post_training.rollout_hooks import (
    prepare_rollout_if_enabled,
)

BF16 = torch.bfloat16


def test_fingerprint_is_dtype_shape_and_raw_bytes():
    x = torch.randn(4, 6).to(BF16)
    fingerprint = tensor_fingerprint(x)
    dtype, shape, digest = fingerprint.split(":")
    assert (dtype, shape, len(digest)) == ("bfloat16", "4x6", 64)
    assert tensor_fingerprint(x.clone()) == fingerprint
    one_ulp = x.clone()
    one_ulp.view(torch.int16)[0, 0] += 1
    assert tensor_fingerprint(one_ulp) != fingerprint
    assert tensor_fingerprint(x.reshape(6, 4)) != fingerprint
    assert tensor_fingerprint(x.view(torch.int16)) != fingerprint  # same bytes
    # -0.0 and 0.0 compare equal, and differ in their bits
    assert tensor_fingerprint(torch.zeros(2)) != tensor_fingerprint(-torch.zeros(2))


def _lora_module(seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    module = nn.Sequential()
    module.add_module("proj", wrap_with_lora_layer(nn.Linear(8, 16, dtype=BF16)))
    module.proj.lora_rank, module.proj.lora_alpha = 4, 8
    module.proj.set_lora_weights(
        torch.randn(4, 8, generator=generator).to(BF16),
        torch.randn(16, 4, generator=generator).to(BF16),
        merge_weights=False,
        clear_existing=True,
    )
    return module


def test_adapter_checksum_is_cached_until_the_adapter_changes(monkeypatch):
    module = _lora_module(0)
    computed = []
    real = policy_checksum.adapter_checksum
    monkeypatch.setattr(
        policy_checksum,
        "adapter_checksum",
        lambda adapters: computed.append(1) or real(adapters),
    )
    expected = real(policy_checksum.module_adapters(module))
    assert policy_checksum.cached_adapter_checksum(module) == expected
    assert policy_checksum.cached_adapter_checksum(module) == expected
    assert len(computed) == 1

    other = _lora_module(1).proj
    module.proj.set_lora_weights(
        other.lora_A, other.lora_B, merge_weights=False, clear_existing=True
    )
    changed = policy_checksum.cached_adapter_checksum(module)
    assert changed != expected and len(computed) == 2
    module.proj.lora_alpha = 16  # settings are part of the key
    assert policy_checksum.cached_adapter_checksum(module) != changed


def test_steps_are_recorded_per_output_row():
    module = _lora_module(0)
    fingerprints = RolloutFingerprints()
    outputs = []
    for step in range(2):
        cond, uncond = torch.randn(2, 3, 4).to(BF16), torch.randn(2, 3, 4).to(BF16)
        combined = uncond.float() + 4.0 * (cond.float() - uncond.float())
        outputs.append((cond, uncond, combined))
        fingerprints.record_step(
            step, module, {"conditional": cond, "unconditional": uncond}, combined
        )
    adapter = policy_checksum.cached_adapter_checksum(module)

    records = fingerprints.per_output()

    assert len(records) == 2
    for row, record in enumerate(records):
        assert record["format"] == ROLLOUT_FINGERPRINT_FORMAT
        assert record["cpu_threads"] == torch.get_num_threads()
        assert [s["step"] for s in record["steps"]] == [0, 1]
        for step, (cond, uncond, combined) in zip(record["steps"], outputs):
            assert step == {
                "step": step["step"],
                "adapter": adapter,
                "conditional": tensor_fingerprint(cond[row]),
                "unconditional": tensor_fingerprint(uncond[row]),
                "combined": tensor_fingerprint(combined[row]),
            }


def test_outputs_are_kept_as_recorded():
    """Recording keeps a copy: a later in-place write does not change the record."""
    fingerprints = RolloutFingerprints()
    out = torch.zeros(1, 2)
    fingerprints.record_step(0, nn.Linear(1, 1), {"conditional": out}, out)
    expected = tensor_fingerprint(torch.zeros(2))
    out += 1
    assert fingerprints.per_output()[0]["steps"][0]["combined"] == expected


def _request(numerics: str, requested: bool | None):
    batch = types.SimpleNamespace(
        rollout=True, rollout_return_fingerprints=requested, rollout_fingerprints=None
    )
    config = types.SimpleNamespace(numerics=numerics)
    prepare_rollout_if_enabled(
        batch=batch, pipeline_config=config, build_controller=lambda **_: object()
    )
    return batch.rollout_fingerprints


@pytest.mark.parametrize(
    "numerics, requested, collected",
    [
        ("train_parity", None, True),
        ("default", None, False),
        ("default", True, True),
        ("train_parity", False, False),
    ],
)
def test_collected_under_train_parity_or_on_request(numerics, requested, collected):
    assert (_request(numerics, requested) is not None) == collected


def _trajectory(*records):
    return RolloutTrajectoryData(
        rollout_log_probs=torch.zeros(len(records), 2), fingerprints=list(records)
    )


def test_records_follow_their_rows_through_concat_select_and_the_response():
    a, b = {"steps": ["a"]}, {"steps": ["b"]}
    both = concat_rollout_trajectory_data([_trajectory(a), _trajectory(b)])
    assert both.fingerprints == [a, b]
    assert select_output_rollout_trajectory(both, 1).fingerprints == [b]

    result = OutputBatch(output=torch.zeros(2, 3), rollout_trajectory_data=both)
    responses = rollout_api._build_response("id", "a cat", 0, True, result)
    assert [r.rollout_fingerprints for r in responses] == [a, b]
