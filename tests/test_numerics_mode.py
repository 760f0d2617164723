"""The `--numerics` switch through the real entry points and loader on the tiny Qwen-Image: the CLI,
a family without a contract refused at startup, Qwen-Image's options, the layers the loader
builds, and the default mode's bits against unpatched upstream. The rules themselves are tested
op by op by the series' own unit tests (python/sglang/multimodal_gen/test/unit/)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run

REPO = Path(__file__).resolve().parent.parent
SGLANG_CLI = Path(sys.executable).parent / "sglang"


@pytest.fixture(scope="session")
def tiny_model(tiny_qwen_image) -> Path:
    return tiny_qwen_image


def server_args(model: Path, **kwargs):
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    return ServerArgs.from_kwargs(model_path=str(model), **kwargs)


# ---------------------------------------------------------------- entry points


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_help_lists_numerics(command, monkeypatch, capsys):
    """The `sglang` command's main function in this process: a process of its own would spend
    half a minute on imports (the script itself runs in
    test_cli_refuses_a_family_without_a_contract and as the demo's servers)."""
    from sglang.cli.main import main

    monkeypatch.setattr(sys, "argv", ["sglang", command, "--help"])
    with contextlib.suppress(SystemExit):  # argparse exits after the help
        main()
    assert "--numerics {default,train_parity}" in capsys.readouterr().out


def test_cli_numerics_reaches_server_args(tiny_model):
    from sglang.multimodal_gen.runtime.server_args import prepare_server_args

    args = prepare_server_args(
        ["--model-path", str(tiny_model), "--numerics", "train_parity"]
    )
    assert args.numerics == "train_parity"
    assert args.attention_backend == "torch_sdpa"
    assert args.lora_merge_mode == "dynamic"


def test_cli_rejects_unknown_numerics(tiny_model, capsys):
    from sglang.multimodal_gen.runtime.server_args import prepare_server_args

    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", str(tiny_model), "--numerics", "bitwise"])
    assert "invalid choice: 'bitwise'" in capsys.readouterr().err


def test_from_kwargs_rejects_unknown_numerics(tiny_model):
    with pytest.raises(ValueError, match="numerics must be one of"):
        server_args(tiny_model, numerics="bitwise")


def test_default_mode_changes_nothing(tiny_model):
    from sglang.multimodal_gen.runtime.utils.train_parity import NUMERICS_MODES

    assert NUMERICS_MODES == ("default", "train_parity")
    args = server_args(tiny_model)
    assert args.numerics == "default"
    assert args.lora_merge_mode == "auto"
    assert args.attention_backend is None


def test_generator_path_takes_numerics():
    """DiffGenerator.from_pretrained builds its ServerArgs with from_kwargs(**kwargs)."""
    import inspect

    from sglang.multimodal_gen import DiffGenerator

    source = inspect.getsource(DiffGenerator.from_pretrained)
    assert "ServerArgs.from_kwargs(**kwargs)" in source


# ------------------------------------------------------------- families opt in


def test_cli_refuses_a_family_without_a_contract(tmp_path):
    """A diffusers-layout model of another family (only its model_index.json is needed: the
    refusal comes before anything is loaded) under `sglang generate --numerics train_parity`.
    """
    model = tmp_path / "flux-like"
    index = {"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1"}
    for component, cls in (
        ("transformer", "FluxTransformer2DModel"),
        ("vae", "AutoencoderKL"),
    ):
        index[component] = ["diffusers", cls]
        (model / component).mkdir(parents=True)
        (model / component / "config.json").write_text(json.dumps({"_class_name": cls}))
    (model / "model_index.json").write_text(json.dumps(index))
    result = subprocess.run(
        [str(SGLANG_CLI), "generate", "--model-path", str(model), "--prompt", "a cat"]
        + ["--numerics", "train_parity"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"--numerics train_parity does not support the model {model}" in output
    assert "serve a supported family: " in output
    assert "Qwen-Image (QwenImagePipelineConfig)" in output


def test_qwen_image_opts_in_and_its_options_are_set(tiny_model):
    args = server_args(tiny_model, numerics="train_parity")
    assert type(args.pipeline_config).__name__ == "QwenImagePipelineConfig"
    assert args.pipeline_config.numerics == "train_parity"
    assert (args.attention_backend, args.lora_merge_mode) == ("torch_sdpa", "dynamic")
    assert args.train_parity_rope_tables == "device"


def test_rope_tables_option_needs_train_parity(tiny_model):
    args = server_args(
        tiny_model, numerics="train_parity", train_parity_rope_tables="cpu"
    )
    assert args.train_parity_rope_tables == "cpu"
    with pytest.raises(ValueError, match="applies only with --numerics train_parity"):
        server_args(tiny_model, train_parity_rope_tables="cpu")


# ------------------------------------------------------------------- dispatch


def _dit_forward(
    tiny_model: Path, out: Path, *args: str, pythonpath: Path | None = None
) -> dict:
    env = dict(
        os.environ, TORCH_COMPILE_DISABLE="1"
    )  # upstream compiles forward_native on CPU
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    run(
        [
            sys.executable,
            str(REPO / "tests" / "dit_forward.py"),
            str(tiny_model),
            str(out),
            *args,
        ],
        env=env,
    )
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("numerics", ["default", "train_parity"])
def test_transformer_loader_builds_layers_for_the_mode(tiny_model, tmp_path, numerics):
    record = _dit_forward(
        tiny_model, tmp_path / "out.pt", "--probe-op", "--numerics", numerics
    )
    rms_norms = {
        n: f
        for n, f in record["dispatch"].items()
        if n.endswith(("norm_q", "txt_norm"))
    }
    assert rms_norms
    expected = "forward_train_parity" if numerics == "train_parity" else "forward_cpu"
    assert set(rms_norms.values()) == {expected}


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


@pytest.mark.slow
def test_default_mode_bits_equal_unpatched_upstream(
    tiny_model, tmp_path, pristine_package
):
    """Every module output of the tiny DiT (batch 1 and 2), fork vs pristine upstream wheel."""
    fork = _dit_forward(tiny_model, tmp_path / "fork.pt")
    upstream = _dit_forward(
        tiny_model, tmp_path / "upstream.pt", pythonpath=pristine_package
    )
    assert Path(upstream["sglang_file"]).is_relative_to(pristine_package)
    assert not Path(fork["sglang_file"]).is_relative_to(pristine_package)
    assert fork["kernel_calls"] == upstream["kernel_calls"] != {}
    outputs = fork["outputs"]
    assert {"b1/<root>", "b2/<root>", "b2/transformer_blocks.1.attn"} <= outputs.keys()
    assert _differing(outputs, upstream["outputs"]) == []
    # the comparison sees a one-ULP change
    changed = dict(outputs)
    root = changed["b1/<root>"].clone()
    root.view(torch.int16)[0, 0, 0] += 1
    changed["b1/<root>"] = root
    assert _differing(changed, upstream["outputs"]) == ["b1/<root>"]
