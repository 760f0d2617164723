"""Model level: tiny Wan DiTs of the three covered layouts (Wan2.1 T2V, Wan2.2 T2V-A14B's two
experts, Wan2.2 TI2V-5B's per-token timesteps) under numerics="train_parity" are bitwise equal to
diffusers + PEFT under CUDA's autocast policy (emulated on CPU), module by module, for batch 1 and
2, cond and uncond text, two timesteps per expert, an odd number of latent frames, a non-square
latent grid and three successive LoRA updates per expert; numerics="default" is not.
The contract: docs/numerics-contract.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sglang_train_parity import wan

from tests.conftest import run

REPO = Path(__file__).resolve().parent.parent
A14B = "Wan2.2-T2V-A14B-Diffusers"
TI2V = "Wan2.2-TI2V-5B-Diffusers"


@pytest.fixture(scope="module")
def tiny_dits(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    return {
        model_id: wan.build_tiny_dits(root / model_id, model_id)
        for model_id in (A14B, TI2V)
    }


def parity_run(model: Path, model_id: str, out: Path, *args: str) -> list[dict]:
    script = REPO / "tests" / "wan_parity_run.py"
    run([sys.executable, str(script), str(model), str(out), "--model-id", model_id, *args])
    return json.loads(out.read_text())


def first_divergence(record: dict) -> str | None:
    return next((p["sglang"] for p in record["pairs"] if not p["equal"]), None)


@pytest.mark.parametrize("model_id", [A14B, TI2V])
def test_train_parity_is_bitwise_with_lora_updates(model_id, tiny_dits, tmp_path):
    args = ["--per-token-timesteps"] if model_id == TI2V else []
    records = parity_run(tiny_dits[model_id], model_id, tmp_path / "tp.json", *args)
    experts = len(wan.TINY_VARIANTS[model_id][1])
    cases = {(r["expert"], r["update"], r["batch"], r["branch"], r["timestep"]) for r in records}
    assert len(cases) == experts * 3 * 2 * 2 * 2
    for record in records:
        assert record["root_equal"], record
        assert first_divergence(record) is None, record
    compared = {p["sglang"] for r in records for p in r["pairs"]}
    for module in (
        "",
        "patch_embedding.proj",
        "condition_embedder",
        "blocks.1",
        "blocks.0.to_q",  # LoRA'd self-attention projection
        "blocks.0.attn2.to_k",  # LoRA'd, input from the text
        "blocks.0.self_attn_residual_norm",  # fp32 residual, rounded once, then norm2
        "blocks.1.ffn.fc_out",  # LoRA'd, RowParallel
        "proj_out",
    ):
        assert module in compared, module


def test_default_numerics_differs(tiny_dits, tmp_path):
    """Negative control: the same comparison with upstream's numerics finds differences."""
    records = parity_run(
        tiny_dits[A14B], A14B, tmp_path / "default.json", "--numerics", "default", "--updates", "0"
    )
    assert not any(r["root_equal"] for r in records)
    assert all(r["root_max_ulp"] > 0 for r in records)
    assert {first_divergence(r) for r in records} == {"blocks.0.norm_q"}
