"""The training-side reference (sglang_train_parity.reference) is what the train-side contract says, and its
sglang -> diffusers module map fits a real sglang Qwen-Image DiT. CPU only."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sglang_train_parity.reference import (
    LORA_TARGETS,
    SGLANG_TO_DIFFUSERS,
    Pairing,
    QwenDiTInputs,
    build_reference,
    is_lora_target,
    random_lora_state,
    reference_forward,
    sglang_to_diffusers,
)
from sglang_train_parity.tiny_model import DIT_CONFIG, random_transformer

REPO = Path(__file__).resolve().parent.parent
RANK, ALPHA = 8, 12.0  # s = 1.5: the x s step rounds (s = 2 would be exact)
INPUTS = dict(batch=2, height=8, width=8, txt_len=7, joint_dim=64)


@pytest.fixture(scope="module")
def lora_reference():
    model = random_transformer()
    masters = random_lora_state(model, RANK, ALPHA, seed=1)
    return build_reference(model, masters, RANK, ALPHA), masters


def test_lora_targets_are_the_diffusers_projections():
    names = [n for n, _ in random_transformer().named_modules()]
    block0 = "transformer_blocks.0."
    targets = {
        n.removeprefix(block0)
        for n in names
        if n.startswith(block0) and is_lora_target(n)
    }
    assert targets == {f"attn.{t}" for t in LORA_TARGETS[:8]} | set(LORA_TARGETS[8:])
    assert sum(map(is_lora_target, names)) == 12 * DIT_CONFIG["num_layers"]


def test_lora_linear_is_base_plus_peft_ordered_delta(lora_reference):
    """Each LoRA'd Linear gives bf16 `F.linear(x, W, b) + ((x @ A.T) @ B.T) * s` with A, B the bf16
    roundings of the masters: biased base first, delta added last (PEFT `Linear.forward`).
    """
    model, masters = lora_reference
    inputs = {}
    lora_layers = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A")}
    handles = [
        m.register_forward_pre_hook(
            lambda m, args, name=n: inputs.__setitem__(name, args[0])
        )
        for n, m in lora_layers.items()
    ]
    try:
        _, outputs = reference_forward(model, QwenDiTInputs.random(**INPUTS), "cpu")
    finally:
        for handle in handles:
            handle.remove()
    assert len(inputs) == len(masters) // 2
    for name, layer in lora_layers.items():
        x = inputs[name].bfloat16()
        a = masters[f"{name}.lora_A.weight"].bfloat16()
        b = masters[f"{name}.lora_B.weight"].bfloat16()
        base = layer.base_layer
        expected = F.linear(x, base.weight, base.bias) + ((x @ a.T) @ b.T) * (
            ALPHA / RANK
        )
        assert torch.equal(outputs[name], expected), name
        assert not torch.equal(outputs[name], outputs[f"{name}.base_layer"]), name


def test_params_are_bf16_roundings_of_fp32_masters():
    master = random_transformer().float()
    with torch.no_grad():  # fp32 values that bf16 cannot hold, so the rounding is visible
        for param in master.parameters():
            param.add_(torch.randn_like(param) * 1e-4)
    lora = random_lora_state(master, RANK, ALPHA, seed=2)
    model = build_reference(copy.deepcopy(master), lora, RANK, ALPHA)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    for name, value in master.named_parameters():
        module, leaf = name.rsplit(".", 1)
        param = params[
            f"{module}.base_layer.{leaf}" if is_lora_target(module) else name
        ]
        assert torch.equal(param, value.bfloat16()), name
    for key, value in lora.items():
        assert value.dtype == torch.float32
        param = params[key.replace(".weight", ".default.weight")]
        assert torch.equal(param, value.bfloat16()), key
    assert all(not torch.equal(v, v.bfloat16().float()) for v in lora.values())


def run_sglang_dit(model_dir: Path, out: Path) -> None:
    """Subprocess body: the fork's DiT (train_parity) on `INPUTS`; saves every module's output and,
    after wrapping every Linear like the LoRA weight updater does, every module name."""
    from sglang_train_parity.sglang_dit import load_dit, sglang_forward

    from sglang.multimodal_gen.runtime.layers.lora.linear import (
        replace_submodule,
        wrap_with_lora_layer,
    )

    model = load_dit(model_dir, numerics="train_parity")
    outputs = sglang_forward(model, QwenDiTInputs.random(**INPUTS))
    for name, module in list(model.named_modules()):
        wrapped = wrap_with_lora_layer(module, lora_rank=RANK, lora_alpha=ALPHA)
        if wrapped is not None:
            replace_submodule(model, name, wrapped)
    names = [name for name, _ in model.named_modules()]
    torch.save({"outputs": outputs, "names": names}, out)


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory, tiny_qwen_image):
    tmp = tmp_path_factory.mktemp("sglang_dit")
    model_dir = tiny_qwen_image
    out = tmp / "sglang.pt"
    code = (
        "import sys; from pathlib import Path; "
        "from tests.test_reference_qwen import run_sglang_dit; "
        "run_sglang_dit(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(model_dir), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


def test_name_map_covers_the_lora_wrapped_sglang_dit(sglang_run):
    names = sglang_run["names"]
    assert any(n.endswith("attn.to_q.base_layer") for n in names), "no LoRA wrappers"
    with_lora = build_reference(
        random_transformer(),
        random_lora_state(random_transformer(), RANK, ALPHA, 0),
        RANK,
        ALPHA,
    )
    lora_names = {n for n, _ in with_lora.named_modules()}
    plain_names = {n for n, _ in random_transformer().named_modules()}
    for name in names:
        pair = sglang_to_diffusers(name)  # KeyError: a module the map does not know
        if pair.diffusers is None:
            assert name.replace(".base_layer", "") not in plain_names, name
            continue
        assert pair.diffusers in lora_names, (name, pair)
        assert sglang_to_diffusers(name, lora=False).diffusers in plain_names, name
    # The map's own entries (the fork's unpacked add_*_proj included) exist in diffusers.
    for key, pair in SGLANG_TO_DIFFUSERS.items():
        if pair.diffusers is not None:
            assert pair.diffusers.replace("*", "0") in plain_names, key


def test_paired_outputs_have_matching_layout(sglang_run):
    """Every pair whose outputs both sides record has the shape (and dtype) its pairing claims; the
    pre-block outputs are already bitwise equal, which pins the input conventions (t / 1000, dtypes).
    """
    model = build_reference(random_transformer())
    _, reference = reference_forward(model, QwenDiTInputs.random(**INPUTS), "cpu")
    compared = set()
    for name, out in sglang_run["outputs"].items():
        pair = sglang_to_diffusers(name)
        if pair.pairing in (Pairing.DIFFERENT, Pairing.SGLANG_ONLY):
            continue
        ref = reference[pair.diffusers]
        if pair.pairing is Pairing.RESHAPED:
            out = out.reshape(ref.shape)
        assert out.shape == ref.shape, name
        assert pair.pairing is Pairing.ROUNDED or out.dtype == ref.dtype, name
        compared.add(name)
    assert {"", "rotary_emb", "transformer_blocks.1.attn.norm_q"} <= compared
    for name in ("img_in", "time_text_embed", "rotary_emb"):
        assert torch.equal(
            sglang_run["outputs"][name],
            reference[name.replace("rotary_emb", "pos_embed")],
        ), name
