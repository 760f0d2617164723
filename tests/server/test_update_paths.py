"""Every weight update is checked whole before anything is written (issue 42, items 1, 3
and 4), against a real `--numerics train_parity` server on CPU with an adapter loaded (its
Linears are LoRA-wrapped: `img_in.weight` is served as `img_in.base_layer.weight`):

- refused, on the disk path and the full-weight tensor path: a tensor no parameter takes, a
  wrong shape, an integer or bool dtype, NaN / Inf (also once cast to bf16), adapter tensors
  without the LoRA mode, a LoRA scale lora_alpha / rank out of range. Each is a 400 naming
  the tensor and the problem; the policy checksum is unchanged and the next rollout is
  bitwise the trainer's recompute.
- accepted: the trainer's (and the checkpoint's) names on both paths and in the checker,
  changing exactly the parameters named: the served policy is then the checksum the
  trainer computes with the new weights, and rollouts are bitwise its recompute.
- the fingerprints' adapter checksum is `/get_policy_checksum`'s after every update."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_train_parity import rollout_demo as demo

from tests.server.test_bad_input import assert_serves_with_parity
from tests.server.test_served_policy import assert_policy_kept

pytestmark = pytest.mark.slow

RANK, ALPHA = demo.LORA_RANK, demo.LORA_ALPHA
NORM = "txt_norm.weight"  # a norm weight: never LoRA-wrapped
LINEAR = "img_in.weight"  # a Linear: served as img_in.base_layer.weight once wrapped
LORA_LAYER = "transformer_blocks.0.attn.to_q"
REFUSED = "Weight update refused, served weights unchanged"


@pytest.fixture(scope="module")
def checkpoint(model_dir) -> dict[str, torch.Tensor]:
    """The served DiT's checkpoint (bf16), by the trainer's names."""
    return load_file(model_dir / "transformer" / "diffusion_pytorch_model.safetensors")


def from_tensors(server, named_tensors, **fields):
    return server.post(
        "/update_weights_from_tensor",
        serialized_named_tensors=[demo.encode_tensors(list(named_tensors))],
        target_modules=["transformer"],
        **fields,
    )


def from_disk(server, folder, named_tensors):
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.contiguous() for name, t in named_tensors},
        str(folder / "transformer" / "model.safetensors"),
    )
    return server.post(
        "/update_weights_from_disk",
        model_path=str(folder),
        target_modules=["transformer"],
    )


def update(path, server, tmp_path, named_tensors):
    if path == "tensor":
        return from_tensors(server, named_tensors)
    return from_disk(server, tmp_path, named_tensors)


def assert_fingerprints_name_the_served_adapter(server):
    rollout = demo.request_rollout(
        server, num_inference_steps=1, rollout_debug_mode=False
    )
    served = demo.policy_checksum(server)["adapter"]
    assert [s["adapter"] for s in rollout["rollout_fingerprints"]["steps"]] == [served]


def _poisoned(value, dtype=torch.float32):
    def make(checkpoint):
        tensor = checkpoint[LINEAR].to(dtype)
        tensor[0, 0] = value
        return tensor

    return make


# (id, the last tensor's name, make(checkpoint) -> the last tensor, fragments of the error).
# The first tensor of each update is a valid norm weight: written first, it would move the
# checksum if the update were not checked whole.
BAD_LAST_TENSORS = [
    (
        "unknown name",
        "transformer_blocks.0.attn.to_nowhere.weight",
        lambda c: torch.ones(256, 256),
        [
            "1 tensor(s) match no parameter of transformer: "
            "transformer_blocks.0.attn.to_nowhere.weight"
        ],
    ),
    (
        "shape",
        LINEAR,
        lambda c: torch.ones(3, 3),
        [f"{LINEAR}: shape (3, 3); the parameter is (256, 64)"],
    ),
    (
        "longer",  # a tensor-parallel loader would cut it to the parameter's rows
        LINEAR,
        lambda c: torch.ones(300, 64),
        [f"{LINEAR}: shape (300, 64); the parameter is (256, 64)"],
    ),
    (
        "shape, wrapper's name",
        "img_in.base_layer.weight",
        lambda c: torch.ones(3, 3),
        ["img_in.base_layer.weight: shape (3, 3); the parameter is (256, 64)"],
    ),
    (
        "int64",
        LINEAR,
        lambda c: torch.ones(256, 64, dtype=torch.int64),
        [f"{LINEAR}: dtype torch.int64"],
    ),
    (
        "bool",
        LINEAR,
        lambda c: torch.ones(256, 64, dtype=torch.bool),
        [f"{LINEAR}: dtype torch.bool"],
    ),
    ("NaN", LINEAR, _poisoned(math.nan), [f"{LINEAR}: contains NaN or Inf"]),
    ("Inf", LINEAR, _poisoned(-math.inf), [f"{LINEAR}: contains NaN or Inf"]),
    (
        "bf16 overflow",  # finite in fp32
        LINEAR,
        _poisoned(3.4e38),
        [f"{LINEAR}: contains NaN or Inf (as torch.bfloat16"],
    ),
    (
        "lora_A, server's name",
        f"{LORA_LAYER}.lora_A",
        lambda c: torch.zeros(RANK, 256),
        [
            f"1 LoRA adapter tensor(s) ({LORA_LAYER}.lora_A)",
            "LoRA A/B tensors need weight_update_mode='lora_merge'",
        ],
    ),
    (
        "lora_B.weight",
        f"{LORA_LAYER}.lora_B.weight",
        lambda c: torch.zeros(256, RANK),
        ["LoRA A/B tensors need weight_update_mode='lora_merge'"],
    ),
]


@pytest.mark.parametrize("path", ["tensor", "disk"])
@pytest.mark.parametrize(
    "name, make, fragments",
    [case[1:] for case in BAD_LAST_TENSORS],
    ids=[case[0] for case in BAD_LAST_TENSORS],
)
def test_an_update_with_a_bad_tensor_is_refused_whole(
    server, served, checkpoint, tmp_path, path, name, make, fragments
):
    before = demo.policy_checksum(server)
    response = update(
        path,
        server,
        tmp_path,
        [(NORM, checkpoint[NORM] + 1), (name, make(checkpoint))],
    )
    assert_policy_kept(server, served, before, response, 400, REFUSED, *fragments)
    assert_fingerprints_name_the_served_adapter(server)


@pytest.mark.parametrize(
    "alpha, scale_b, named",
    [
        (1e300, 1, "lora_alpha / rank = 1e+300 / 4 must be a finite, nonzero fp32"),
        (10**400, 1, "must be a finite, nonzero fp32 number (the adapter's scale)"),
        (1e-60, 1, "lora_alpha / rank = 1e-60 / 4 must be a finite, nonzero fp32"),
        (3e38, 1e3, f"{LORA_LAYER}.lora_B times the scale lora_alpha / rank = 7.5e+37"),
    ],
    ids=["1e300", "huge int", "scale 0 in fp32", "B times the scale overflows"],
)
def test_a_lora_scale_out_of_range_is_refused(
    server, served, adapters, alpha, scale_b, named
):
    """lora_alpha=1e300 was served: every output NaN."""
    before = demo.policy_checksum(server)
    state = dict(adapters[1])
    state[f"{LORA_LAYER}.lora_B.weight"] = (
        state[f"{LORA_LAYER}.lora_B.weight"] * scale_b
    )
    response = demo.push_lora(server, state, RANK, alpha)
    assert_policy_kept(
        server, served, before, response, 400, "LoRA update refused", named
    )


def _trainer_with(model_dir, adapter, named_tensors):
    """The trainer's model with `named_tensors` as its new base weights."""
    from diffusers import QwenImageTransformer2DModel
    from sglang_train_parity.reference import build_reference

    model = QwenImageTransformer2DModel.from_pretrained(
        model_dir / "transformer", torch_dtype=torch.float32
    )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in named_tensors:
            params[name].copy_(tensor.float())
    return build_reference(model, adapter, RANK, ALPHA)


def _trainer_checksum(model):
    from sglang_train_parity.families import family_of
    from sglang_train_parity.policy import trainer_policy_checksum

    mapping = family_of("QwenImageTransformer2DModel").param_names_mapping
    return trainer_policy_checksum(model, param_names_mapping=mapping)


@pytest.mark.parametrize("path", ["tensor", "disk"])
def test_the_trainers_names_update_a_lora_wrapped_dit(
    server, served, model_dir, adapters, checkpoint, tmp_path, path
):
    """After an adapter push the disk path skipped every Linear ("Updated 1 modules", the
    norm alone changed) and the tensor path refused `img_in.weight`."""
    before = demo.policy_checksum(server)
    new = [(NORM, checkpoint[NORM] + 1), (LINEAR, checkpoint[LINEAR] * 2)]
    response = update(path, server, tmp_path, new)
    assert response.status_code == 200, response.text
    counted = {"tensor": "Updated 1 modules from tensor", "disk": "Updated 1 modules"}
    assert response.json()["message"] == f"{counted[path]} (transformer): 2 tensors."

    trainer = _trainer_with(model_dir, adapters[0], new)
    after = demo.policy_checksum(server)
    assert after == _trainer_checksum(trainer)
    assert after["base"] != before["base"] and after["adapter"] == before["adapter"]
    assert_serves_with_parity(server, trainer)
    assert_fingerprints_name_the_served_adapter(server)

    # the whole original checkpoint, by its names, brings the served policy back
    response = server.post(
        "/update_weights_from_disk",
        model_path=str(model_dir),
        target_modules=["transformer"],
    )
    assert response.status_code == 200, response.text
    assert response.json()["message"] == (
        f"Updated 1 modules (transformer): {len(checkpoint)} tensors."
    )
    assert demo.policy_checksum(server) == before
    assert_serves_with_parity(server, served)


def test_the_checker_takes_the_trainers_names(server, served, checkpoint):
    from sglang.multimodal_gen.runtime.post_training.tensor_update_checker import (
        compute_tensor_sha256,
    )

    expected = {
        name: compute_tensor_sha256(checkpoint[name]) for name in (NORM, LINEAR)
    }
    response = server.post(
        "/update_weights_from_tensor_checker",
        target_module="transformer",
        expected_named_tensors_sha256=expected,
    )
    assert response.status_code == 200, response.text
    assert "Verified module 'transformer' update for 2 tensor(s)" in response.text
