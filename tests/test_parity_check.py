"""`sglang-train-parity check` on the tiny Qwen-Image, Qwen-Image 2.1, Wan and LTX-2 models (CPU): bitwise
equal under train_parity with a LoRA adapter (both experts of Wan2.2 A14B, video cases), the negative control
(`--numerics default`) fails and names the first diverging module, a RoPE-table mismatch names the
option that fixes it, and bad input is refused with a clear message (exit 2) before any model is
loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the console script of this environment
CHECK = [str(Path(sys.executable).parent / "sglang-train-parity"), "check"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen_image) -> Path:
    return tiny_qwen_image


def parity_check(*args: str) -> subprocess.CompletedProcess:
    """The tool in its own process: it loads the sglang DiT, which sets process globals."""
    return subprocess.run([*CHECK, *args], capture_output=True, text=True)


@pytest.mark.slow
def test_train_parity_with_lora_is_bitwise(tiny_model, tmp_path):
    result = parity_check(
        "--model-path", str(tiny_model), "--batch-sizes", "1,2", "--timesteps", "500",
        "--lora-rank", "8", "--lora-alpha", "12", "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["equal"] and report["first_divergence"] is None
    assert report["lora"] == {"path": None, "rank": 8, "alpha": 12}
    assert len(report["cases"]) == 2
    pairs = [p for case in report["cases"] for p in case["pairs"]]
    assert all(p["equal"] and p["max_ulp"] in (0, None) for p in pairs)
    compared = {p["sglang"] for p in pairs}
    for module in ("", "txt_norm", "transformer_blocks.0.attn.to_q.base_layer"):
        assert module in compared, module  # model output, a norm, a LoRA'd base layer
    assert (tmp_path / "ulp.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "PASS: all" in result.stdout


@pytest.mark.slow
def test_default_numerics_fails_and_names_first_divergence(tiny_model, tmp_path):
    result = parity_check(
        "--model-path", str(tiny_model), "--numerics", "default", "--batch-sizes", "1",
        "--timesteps", "500", "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["equal"]
    # the first op whose default arithmetic differs (RMSNorm rounding), before any block
    assert report["first_divergence"] == "txt_norm"
    assert report["cases"][0]["first_divergence"] == "txt_norm"
    assert "first divergence: txt_norm" in result.stdout
    assert (tmp_path / "ulp.png").read_bytes().startswith(PNG_SIGNATURE)


A14B = "Wan2.2-T2V-A14B-Diffusers"


@pytest.fixture(scope="module")
def tiny_a14b(tmp_path_factory) -> Path:
    from sglang_train_parity.wan import build_tiny_dits

    return build_tiny_dits(tmp_path_factory.mktemp("wan") / "tiny-a14b", A14B)


@pytest.mark.slow
def test_wan_two_experts_with_lora_are_bitwise(tiny_a14b, tmp_path):
    """The folder's layout names the variant; every case runs on both experts."""
    result = parity_check(
        "--model-path", str(tiny_a14b), "--batch-sizes", "1,2", "--frames", "5",
        "--image-sizes", "64x96", "--timesteps", "900", "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["equal"] and report["model_id"] == A14B
    assert report["experts"] == ["transformer", "transformer_2"]
    cases = {(c["expert"], c["batch"], c["frames"]) for c in report["cases"]}
    assert cases == {(e, b, 5) for e in report["experts"] for b in (1, 2)}
    compared = {p["sglang"] for case in report["cases"] for p in case["pairs"]}
    for module in ("", "patch_embedding.proj", "blocks.0.attn2.to_k.base_layer"):
        assert module in compared, module
    assert "9x" not in result.stdout and "5x64x96 t900 transformer_2" in result.stdout
    assert (tmp_path / "ulp.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.slow
def test_wan_default_numerics_fails_at_the_qk_norm(tmp_path):
    """The embedded tiny Wan2.1 model (--model-id) under upstream's numerics."""
    result = parity_check(
        "--model-id", "Wan2.1-T2V-1.3B-Diffusers", "--numerics", "default",
        "--batch-sizes", "1", "--timesteps", "500", "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["first_divergence"] == "blocks.0.norm_q"
    assert "first divergence: blocks.0.norm_q" in result.stdout


@pytest.mark.slow
def test_qwen21_with_lora_is_bitwise_and_default_differs(tmp_path, monkeypatch):
    """The embedded tiny Qwen-Image 2.1 DiT (--model-id): train_parity with LoRA on every
    module, then upstream's numerics, which differ from the time embedding on (its t=0 and
    real-timestep rows go through separate GEMMs)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the tiny model goes there
    common = ["--model-id", "Qwen-Image-2.1", "--image-sizes", "64x96", "--timesteps", "500"]
    result = parity_check(*common, "--batch-sizes", "1,2", "--out-dir", str(tmp_path / "tp"))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "tp" / "report.json").read_text())
    assert report["equal"] and report["model_id"] == "Qwen-Image-2.1"
    compared = {p["sglang"] for case in report["cases"] for p in case["pairs"]}
    for module in ("", "modulation", "transformer_blocks.1.img_mlp.out.base_layer"):
        assert module in compared, module
    result = parity_check(
        *common, "--numerics", "default", "--batch-sizes", "1", "--out-dir", str(tmp_path / "d")
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["first_divergence"] == "time_text_embed.timestep_embedder.linear_1"


@pytest.mark.slow
def test_ltx2_with_lora_is_bitwise(tmp_path, monkeypatch):
    """The embedded tiny LTX-2 DiT (--model-id): train_parity with LoRA on miles' targets
    against ltx-core, both streams (the default numerics' difference is checked at the model
    level, tests/test_train_parity_ltx2.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the tiny model goes there
    result = parity_check(
        "--model-id", "LTX-2", "--image-sizes", "64x96", "--timesteps", "500",
        "--batch-sizes", "1,2", "--out-dir", str(tmp_path / "tp"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "tp" / "report.json").read_text())
    assert report["equal"] and report["model_id"] == "LTX-2"
    compared = {p["sglang"] for case in report["cases"] for p in case["pairs"]}
    for module in ("", "audio", "transformer_blocks.1.ff.proj_out.base_layer"):
        assert module in compared, module


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model-id", "Qwen-Image-2.1", "--image-sizes", "48"],
            "multiples of 32 pixels",
        ),
        (["--frames", "8", "--model-id", A14B], "a video has 4k+1 frames"),
        (["--frames", "5"], "Qwen-Image is an image model"),
        (["--model-id", "Wan2.1-I2V-14B-480P-Diffusers"], "no embedded tiny model"),
        (
            ["--model-id", A14B, "--trainer-rope-tables", "cpu"],
            "builds its RoPE tables in one place",
        ),
        (["--model-id", "LTX-2", "--frames", "13"], "give 8k+1 frames"),
        (["--model-id", "LTX-2", "--image-sizes", "48"], "multiples of 32 pixels"),
        (["--model-id", A14B, "--lora-path", "x.safetensors"], "has 2 experts"),
        (
            ["--model-id", "Wan2.2-TI2V-5B-Diffusers", "--image-sizes", "48"],
            "multiples of 32 pixels",
        ),
    ],
)
def test_bad_wan_input_is_refused(args, message, capsys, tmp_path, monkeypatch):
    from sglang_train_parity.check import main

    monkeypatch.setenv(
        "XDG_CACHE_HOME", str(tmp_path)
    )  # the tiny TI2V model goes there
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--out-dir", str(tmp_path / "report")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def not_qwen_model(tmp_path) -> Path:
    (tmp_path / "transformer").mkdir()
    config = {"_class_name": "FluxTransformer2DModel"}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--image-sizes", "128,100"], "multiple of 16"),
        (["--image-sizes", "big"], "expected N or HxW"),
        (["--batch-sizes", "0"], "'0' is not a positive integer"),
        (["--text-lengths", "-3"], "'-3' is not a positive integer"),
        (["--timesteps", "1500"], "outside the scheduler's 0..1000"),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (["--model-path", "/nonexistent"], "not a diffusers-layout model"),
        (
            ["--numerics", "default", "--lora-rank", "4"],
            "needs --numerics train_parity",
        ),
        (["--lora-path", "/nonexistent"], "no safetensors adapter"),
        (["--numerics", "fast"], "invalid choice: 'fast'"),
    ],
)
def test_bad_input_is_refused(args, message, capsys):
    from sglang_train_parity.check import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_model_family_is_refused(not_qwen_model, capsys):
    from sglang_train_parity.check import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model-path", str(not_qwen_model)])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "'FluxTransformer2DModel' is no train_parity family's" in message
    assert (
        "supported: QwenImageTransformer2DModel, QwenImage21Transformer2DModel, "
        "WanTransformer3DModel" in message
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused(capsys):
    from sglang_train_parity.check import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_rope_table_mismatch_names_the_option(capsys):
    """On CPU trainer and server tables are built on the same device whatever the option; the
    report of a run where they differ (as on a GPU) points at the option."""
    from types import SimpleNamespace

    from sglang_train_parity.check import ROPE_TABLES_HINT, print_report

    modules = [
        {"index": 0, "sglang": "rotary_emb", "diffusers": "pos_embed", "dtype": "complex64",
         "shape": [64, 64], "cases": 1, "cases_equal": 0, "equal": False,
         "max_abs_diff": 1e-7, "max_ulp": None},
    ]  # fmt: skip
    args = SimpleNamespace(all_modules=False, max_rows=40, out_dir=Path("out"))
    print_report(modules, [], args)
    out = capsys.readouterr().out
    assert "first divergence: rotary_emb" in out
    assert ROPE_TABLES_HINT in out and "--train-parity-rope-tables" in ROPE_TABLES_HINT
