"""Model level: the fork's tiny Qwen-Image DiT under numerics="train_parity" is bitwise equal to
diffusers + PEFT under CUDA's autocast policy (emulated on CPU), module by module, for batch 1 and
2, cond and uncond text, two timesteps and three successive LoRA updates; numerics="default" is not.
The contract: docs/numerics-contract.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen_image) -> Path:
    return tiny_qwen_image


def parity_run(model: Path, out: Path, *args: str) -> list[dict]:
    script = REPO / "tests" / "qwen_parity_run.py"
    run([sys.executable, str(script), str(model), str(out), *args])
    return json.loads(out.read_text())


def first_divergence(record: dict) -> str | None:
    return next((p["sglang"] for p in record["pairs"] if not p["equal"]), None)


@pytest.mark.slow
def test_train_parity_is_bitwise_with_lora_updates(tiny_model, tmp_path):
    records = parity_run(tiny_model, tmp_path / "tp.json", "--numerics", "train_parity")
    cases = {(r["update"], r["batch"], r["branch"], r["timestep"]) for r in records}
    assert len(cases) == 3 * 2 * 2 * 2
    for record in records:
        assert record["root_equal"], record
        assert first_divergence(record) is None, record
    compared = {p["sglang"] for r in records for p in r["pairs"]}
    for module in (
        "",
        "txt_norm",
        "transformer_blocks.1",
        "transformer_blocks.0.attn",
        "transformer_blocks.0.attn.norm_added_k",
        "transformer_blocks.0.attn.add_v_proj",  # LoRA'd
        "transformer_blocks.1.txt_mlp.net.2",  # LoRA'd, RowParallel
        # LoRA'd up-projection + GELU, input from norm2 + modulation (the projection's
        # forward_gelu_tanh runs inside this module, not as a module call of its own)
        "transformer_blocks.0.img_mlp.net.0",
        "proj_out",
    ):
        assert module in compared, module


@pytest.mark.slow
def test_default_numerics_differs(tiny_model, tmp_path):
    """Negative control: the same comparison with upstream's numerics finds differences."""
    records = parity_run(
        tiny_model, tmp_path / "default.json", "--numerics", "default", "--updates", "0"
    )
    assert not any(r["root_equal"] for r in records)
    assert all(r["root_max_ulp"] > 0 for r in records)
    assert {first_divergence(r) for r in records} <= {"txt_norm", "img_in", "txt_in"}


@pytest.mark.parametrize(
    "table_device, built_on_cpu_first_use, built_on_accelerator_first_use",
    [("cpu", ["cpu"], []), ("device", ["cpu"], ["meta"])],
)
def test_rope_tables_are_built_where_asked(
    table_device, built_on_cpu_first_use, built_on_accelerator_first_use, monkeypatch
):
    """ "cpu": as diffusers (on the CPU, then moved); "device": on the device of first use, as
    trainers that rebuild them on the GPU. The meta device stands in for an accelerator.
    """
    from sglang.multimodal_gen.runtime.models.dits.qwen_image import QwenEmbedRope

    built_on = []
    init = QwenEmbedRope._init_freqs

    def spy(self, device=None):
        built_on.append(str(device))
        return init(self, device)

    def first_use(construction_device: str, device: str) -> list[str]:
        with torch.device(construction_device):
            rope = QwenEmbedRope(10000, [16, 56, 56], True, table_device=table_device)
        built_on.clear()
        monkeypatch.setattr(QwenEmbedRope, "_init_freqs", spy)
        rope._prepare_freqs(torch.device(device))
        monkeypatch.setattr(QwenEmbedRope, "_init_freqs", init)
        assert rope.pos_freqs.device.type == device
        assert rope.pos_freqs.dtype == torch.complex64
        return list(built_on)

    # the loader constructs on meta; the first forward runs on the CPU
    assert first_use("meta", "cpu") == built_on_cpu_first_use
    # constructed on the CPU as diffusers does; first forward on an accelerator
    assert first_use("cpu", "meta") == built_on_accelerator_first_use


def test_rope_tables_option_reaches_the_model_and_needs_train_parity(tiny_model):
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    args = ServerArgs.from_kwargs(
        model_path=str(tiny_model),
        numerics="train_parity",
        train_parity_rope_tables="device",
    )
    assert args.train_parity_rope_tables == "device"
    with pytest.raises(ValueError, match="applies only with --numerics train_parity"):
        ServerArgs.from_kwargs(
            model_path=str(tiny_model), train_parity_rope_tables="device"
        )
    with pytest.raises(ValueError, match="train_parity_rope_tables must be one of"):
        ServerArgs.from_kwargs(
            model_path=str(tiny_model),
            numerics="train_parity",
            train_parity_rope_tables="gpu",
        )
