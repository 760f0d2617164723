# SPDX-License-Identifier: Apache-2.0
"""A LoRA tensor update is applied as a whole or refused before any layer changes."""

import pytest
import torch

from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import LoRAPipeline
from sglang.multimodal_gen.runtime.post_training.weights_updater import (
    WeightsUpdater,
    _lora_update_problems,
)

RANK = 2


class _TinyDiT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.to_q = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
        self.ff = torch.nn.Linear(8, 16, dtype=torch.bfloat16)


def _adapter(**overrides) -> dict[str, torch.Tensor]:
    tensors = {
        "attn.to_q.lora_A.weight": torch.randn(RANK, 8),
        "attn.to_q.lora_B.weight": torch.randn(8, RANK),
        "ff.lora_A.weight": torch.randn(RANK, 8),
        "ff.lora_B.weight": torch.randn(16, RANK),
    }
    tensors.update(overrides)
    return {name: t for name, t in tensors.items() if t is not None}


def _problems(tensors, lora_rank=None, lora_alpha=None):
    return _lora_update_problems(
        list(tensors.items()), _TinyDiT(), [], lora_rank, lora_alpha
    )


def test_a_complete_adapter_has_no_problems():
    assert _problems(_adapter(), lora_rank=RANK, lora_alpha=4) == []


@pytest.mark.parametrize(
    "tensors, request_args, expected",
    [
        (_adapter(**{"ff.lora_B.weight": None}), {}, "ff: lora_A and lora_B"),
        (
            _adapter(**{"attn.to_k.lora_A.weight": torch.randn(RANK, 8)}),
            {},
            "attn.to_k: lora_A and lora_B",
        ),
        (
            _adapter(
                **{
                    "attn.to_k.lora_A.weight": torch.randn(RANK, 8),
                    "attn.to_k.lora_B.weight": torch.randn(8, RANK),
                }
            ),
            {},
            "attn.to_k: unknown module",
        ),
        (
            _adapter(**{"ff.lora_A.weight": torch.randn(RANK, 4)}),
            {},
            "ff.lora_A: shape (2, 4), the layer needs (rank, 8)",
        ),
        (
            _adapter(**{"ff.lora_B.weight": torch.randn(8, RANK)}),
            {},
            "ff.lora_B: shape (8, 2), the layer and lora_A need (16, 2)",
        ),
        (_adapter(), {"lora_rank": 4}, "lora_rank=4 in the request"),
        (_adapter(), {"lora_rank": 0}, "lora_rank must be a positive integer"),
        (_adapter(), {"lora_alpha": -1.0}, "lora_alpha must be a positive number"),
        (
            _adapter(**{"ff.lora_A.weight": torch.full((RANK, 8), float("nan"))}),
            {},
            "ff.lora_A: contains NaN or Inf",
        ),
        (
            # finite in fp32, infinite once cast to the layer's bf16
            _adapter(**{"ff.lora_B.weight": torch.full((16, RANK), 3.4e38)}),
            {},
            "ff.lora_B: contains NaN or Inf",
        ),
        (
            _adapter(**{"ff.lora_A.weight": torch.ones(RANK, 8, dtype=torch.int64)}),
            {},
            "ff.lora_A: dtype torch.int64",
        ),
        (_adapter(**{"ff.bias": torch.zeros(16)}), {}, "ff.bias: not a lora_A"),
    ],
)
def test_each_problem_is_named(tensors, request_args, expected):
    problems = _problems(tensors, **request_args)
    assert any(expected in p for p in problems), problems


class _TestLoRAPipeline(LoRAPipeline):
    def create_pipeline_stages(self, server_args):
        pass


def _lora_pipeline(dit: torch.nn.Module) -> LoRAPipeline:
    pipeline = object.__new__(_TestLoRAPipeline)
    pipeline.modules = {"transformer": dit}
    pipeline.exclude_lora_layers = []
    pipeline.lora_initialized = False
    return pipeline


def test_refused_update_changes_nothing():
    """One unknown layer among valid ones: the whole update is refused, and
    nothing is wrapped or written."""
    dit = _TinyDiT()
    before = {name: p.clone() for name, p in dit.named_parameters()}
    pipeline = _lora_pipeline(dit)
    tensors = _adapter(
        **{
            "attn.to_k.lora_A.weight": torch.randn(RANK, 8),
            "attn.to_k.lora_B.weight": torch.randn(8, RANK),
        }
    )

    ok, message = WeightsUpdater(pipeline).update_weights_from_tensor(
        list(tensors.items()), weight_update_mode="lora_merge", lora_alpha=4
    )

    assert not ok
    assert message.startswith("LoRA update refused, served weights unchanged")
    assert "attn.to_k: unknown module" in message
    assert not pipeline.lora_initialized
    assert isinstance(dit.ff, torch.nn.Linear)
    after = dict(dit.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
