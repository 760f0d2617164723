"""Model level: a tiny LTX-2 DiT under numerics="train_parity" is bitwise equal to ltx-core's
LTXModel + PEFT under CUDA's autocast policy (emulated on CPU) with SDPA's math kernel, each stream
alone, module by module, for batch 1 and 2 (at two timesteps) and three successive LoRA updates;
numerics="default" is not. The contract: docs/numerics-contract.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sglang_train_parity import ltx2

from tests.conftest import run

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_dit(tmp_path_factory):
    # sglang resolves the LTX-2 pipeline from the folder name
    return ltx2.build_tiny_dit(tmp_path_factory.mktemp("ltx2") / "LTX-2")


def parity_run(model: Path, out: Path, *args: str) -> list[dict]:
    script = REPO / "tests" / "ltx2_parity_run.py"
    run([sys.executable, str(script), str(model), str(out), *args])
    return json.loads(out.read_text())


def first_divergence(record: dict) -> str | None:
    return next((p["sglang"] for p in record["pairs"] if not p["equal"]), None)


def test_train_parity_is_bitwise_with_lora_updates(tiny_dit, tmp_path):
    records = parity_run(tiny_dit, tmp_path / "tp.json", "--updates", "3")
    assert len({(r["update"], r["batch"], r["timestep"]) for r in records}) == 3 * 2
    for record in records:
        assert record["root_equal"] and record["audio_equal"], record
        assert first_divergence(record) is None, record
    compared = {p["sglang"] for r in records for p in r["pairs"]}
    for module in (
        "",
        "audio",
        "patchify_proj",
        "adaln_single",  # the trainer's bf16 sigma
        "caption_projection",
        "transformer_blocks.0.attn1.to_q",  # LoRA'd
        "transformer_blocks.0.attn1.to_q.base_layer",
        "transformer_blocks.1.attn1.to_out.0",  # after RoPE and SDPA math
        "transformer_blocks.1.attn2.to_out.0",  # the text cross-attention
        "transformer_blocks.1.ff.proj_out",  # ltx-core's ff.net.2
        "transformer_blocks.1.audio_ff.proj_out",
        "proj_out",
        "audio_proj_out",
    ):
        assert module in compared, module


def test_default_numerics_differs(tiny_dit, tmp_path):
    """Negative control: upstream's numerics take the timestep in fp32 (not the trainer's bf16
    sigma), so the first difference is the timestep embedding."""
    records = parity_run(
        tiny_dit, tmp_path / "default.json", "--numerics", "default", "--updates", "0"
    )
    assert not any(r["root_equal"] or r["audio_equal"] for r in records)
    assert all(r["root_max_ulp"] > 0 for r in records)
    assert {first_divergence(r) for r in records} <= {
        "adaln_single.emb.timestep_embedder.linear_1",
        "audio_adaln_single.emb.timestep_embedder.linear_1",
    }
