# SPDX-License-Identifier: Apache-2.0
"""A tensor weight update either loads every tensor it was sent, or is refused
before any parameter changes."""

import pytest
import torch

from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import LoRAPipeline
from sglang.multimodal_gen.runtime.post_training.weights_updater import WeightsUpdater


class _TinyDiT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
        self.out = torch.nn.Linear(8, 4, dtype=torch.bfloat16)


class _TestLoRAPipeline(LoRAPipeline):
    def create_pipeline_stages(self, server_args):
        pass


def _pipeline() -> LoRAPipeline:
    pipeline = object.__new__(_TestLoRAPipeline)
    pipeline.modules = {"transformer": _TinyDiT()}
    pipeline.exclude_lora_layers = []
    pipeline.lora_initialized = False
    return pipeline


def _params(pipeline) -> dict[str, torch.Tensor]:
    dit = pipeline.modules["transformer"]
    return {name: p.detach().clone() for name, p in dit.named_parameters()}


def _update(pipeline, named_tensors, **kwargs):
    return WeightsUpdater(pipeline).update_weights_from_tensor(named_tensors, **kwargs)


def _assert_refused_unchanged(pipeline, result, *fragments):
    before = _params(pipeline)
    ok, message = result()
    assert not ok
    for fragment in fragments:
        assert fragment in message, message
    after = _params(pipeline)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_full_update_reports_the_tensors_it_loaded():
    pipeline = _pipeline()
    new = torch.ones(8, 8, dtype=torch.bfloat16)
    ok, message = _update(
        pipeline, [("proj.weight", new), ("proj.bias", torch.zeros(8))]
    )
    assert ok, message
    assert message == "Updated 1 modules from tensor (transformer): 2 tensors."
    assert torch.equal(pipeline.modules["transformer"].proj.weight, new)


@pytest.mark.parametrize("mode", ["lora", "LoRA_merge", "full", ""])
def test_unknown_update_mode_is_refused(mode):
    """An unknown mode is refused, not taken for the full-weight path, which
    would skip every LoRA tensor and report success."""
    pipeline = _pipeline()
    tensors = [("proj.lora_A.weight", torch.randn(2, 8))]
    _assert_refused_unchanged(
        pipeline,
        lambda: _update(pipeline, tensors, weight_update_mode=mode),
        f"Unknown weight_update_mode {mode!r}",
        "'lora_merge'",
    )


def test_lora_tensors_without_the_lora_mode_are_refused():
    pipeline = _pipeline()
    tensors = [
        ("proj.lora_A.weight", torch.randn(2, 8)),
        ("proj.lora_B.weight", torch.randn(8, 2)),
    ]
    _assert_refused_unchanged(
        pipeline,
        lambda: _update(pipeline, tensors),
        "Weight update refused, served weights unchanged",
        "2 LoRA adapter tensor(s) (proj.lora_A.weight, proj.lora_B.weight)",
        "LoRA A/B tensors need weight_update_mode='lora_merge'",
    )


def test_one_unknown_tensor_refuses_the_whole_update():
    """The known tensors are not loaded with the unknown one skipped with a
    warning: the whole update is refused."""
    pipeline = _pipeline()
    tensors = [
        ("proj.weight", torch.ones(8, 8)),
        ("proj.no_such_weight", torch.ones(8)),
    ]
    _assert_refused_unchanged(
        pipeline,
        lambda: _update(pipeline, tensors),
        "1 tensor(s) match no parameter of transformer: proj.no_such_weight",
    )


@pytest.mark.parametrize("mode", [None, "lora_merge"])
@pytest.mark.parametrize(
    "payload, named",
    [
        (5, "Unsupported module payload type"),
        ([1, 2], "entry 0 is not a (name, tensor) pair"),
        ([], "holds no tensors"),
    ],
    ids=["not a list", "not pairs", "empty"],
)
def test_malformed_payload_is_refused(mode, payload, named):
    pipeline = _pipeline()
    if mode is not None and payload == []:
        named = "No LoRA A/B tensor pairs"
    _assert_refused_unchanged(
        pipeline,
        lambda: _update(
            pipeline, payload, weight_update_mode=mode, lora_rank=2, lora_alpha=2
        ),
        named,
    )
