"""Every malformed request field is a 4xx naming it (issue 42, item 5), against a real
`--numerics train_parity` server on CPU: never a 500, never silently ignored, and a field given
twice with two values is refused. Each refused request leaves the policy checksum as it was,
and the next rollout is still bitwise equal to the trainer's recompute. How each case answered
before is in its id's comment."""

from __future__ import annotations

import pytest
import torch
from sglang_train_parity import rollout_demo as demo
from sglang_train_parity.fingerprints import verify_rollout
from sglang_train_parity.policy import trainer_policy_checksum

from tests.server.test_served_policy import assert_policy_kept

pytestmark = pytest.mark.slow

RANK, ALPHA = demo.LORA_RANK, demo.LORA_ALPHA
ROLLOUT = {**demo.ROLLOUT_REQUEST, "num_inference_steps": 1}

# (id, rollout fields, status, fragments of the answer)
ROLLOUT_FIELDS = [
    # 500 after admission ("Overflow when unpacking long long")
    (
        "seed 2**64",
        dict(seed=2**64),
        400,
        ["seed 18446744073709551616 is out of range", "below 2**64"],
    ),
    # served with seed 1
    ("seed true", dict(seed=True), 422, ['"loc":["body","seed"]']),
    # served with true_cfg_scale 4.0
    ("scale text", dict(true_cfg_scale="4"), 422, ['"loc":["body","true_cfg_scale"]']),
    # 500: "shape '[1, 0, 1, -1]' is invalid"
    (
        "width below a patch",
        dict(width=8),
        400,
        ["width=8", "a width that is a multiple of 16"],
    ),
    # served (Wan: 500, "Rollout SP noise shape mismatch after shard")
    ("height not whole patches", dict(height=24), 400, ["height=24"]),
    # served, guided with the second value
    (
        "true_cfg_scale twice",
        dict(extra_sampling_params={"true_cfg_scale": 1.0}),
        400,
        [
            "true_cfg_scale=4.0 at the top level and 1.0 in extra_sampling_params",
            "set it once",
        ],
    ),
    # served, the second value overwritten by the first
    (
        "rollout twice",
        dict(extra_sampling_params={"rollout": False}),
        400,
        ["rollout=True at the top level and False in extra_sampling_params"],
    ),
    # served, no latent returned
    (
        "return step out of range",
        dict(rollout_return_step_indices=[2]),
        400,
        ["rollout_return_step_indices has [2], outside 0..1"],
    ),
    # served, every step SDE
    (
        "SDE step out of range",
        dict(rollout_sde_step_indices=[1]),
        400,
        ["rollout_sde_step_indices has [1], outside 0..0"],
    ),
    # served, one image
    (
        "frames on an image model",
        dict(num_frames=5),
        400,
        ["num_frames=5 on an image model", "drop the video field(s)"],
    ),
]


@pytest.mark.parametrize(
    "fields, status, fragments",
    [case[1:] for case in ROLLOUT_FIELDS],
    ids=[case[0] for case in ROLLOUT_FIELDS],
)
def test_malformed_rollout_field_is_a_4xx_naming_it(
    server, served, fields, status, fragments
):
    before = demo.policy_checksum(server)
    response = server.post("/rollout/generate", **{**ROLLOUT, **fields})
    assert_policy_kept(server, served, before, response, status, *fragments)


# (path, body, fragment of the answer); each answered 500, or 200 with a wrong answer
CONTROL_FIELDS = [
    # 200: one "not_found" per character
    ("/get_policy_checksum", dict(module_names="transformer"), "module_names"),
    # 500: "'int' object is not iterable"
    ("/get_policy_checksum", dict(module_names=5), "module_names"),
    # 200: the base checksum included
    ("/get_policy_checksum", dict(include_base="no"), "include_base"),
    ("/get_weights_checksum", dict(module_names="transformer"), "module_names"),
    # 500: "unhashable type: 'list'"
    ("/get_weights_checksum", dict(module_names=[["transformer"]]), "module_names"),
    (
        "/update_weights_from_tensor_checker",
        dict(target_module=["x"], expected_named_tensors_sha256={"a": "0"}),
        "target_module must be one module name",
    ),
]


@pytest.mark.parametrize(
    "path, body, named",
    CONTROL_FIELDS,
    ids=[f"{path} {body}" for path, body, _ in CONTROL_FIELDS],
)
def test_malformed_control_field_is_a_400_naming_it(server, served, path, body, named):
    before = demo.policy_checksum(server)
    assert_policy_kept(server, served, before, server.post(path, **body), 400, named)


def test_rollout_without_a_seed_runs_the_default_one(server, served):
    """`"seed": null` (or no seed) used to run the rollout, then answer a bare 500 building
    the response. It is the server's default seed, which the response names."""
    rollout = demo.request_rollout(server, seed=None, num_inference_steps=2)
    assert rollout["seed"] == 42
    expected = demo.trainer_model_outputs(
        served, rollout, demo.ROLLOUT_REQUEST["true_cfg_scale"]
    )
    assert torch.equal(demo.rollout_model_outputs(rollout), expected)


def test_a_field_given_twice_with_one_value_is_served(server, served):
    rollout = demo.request_rollout(
        server, num_inference_steps=2, extra_sampling_params={"true_cfg_scale": 4}
    )
    expected = demo.trainer_model_outputs(
        served, rollout, demo.ROLLOUT_REQUEST["true_cfg_scale"]
    )
    assert torch.equal(demo.rollout_model_outputs(rollout), expected)


A14B = "Wan2.2-T2V-A14B-Diffusers"


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A train_parity server on the tiny Wan2.2 A14B, each expert with its adapter; the
    demo's Wan client, its trainer models and their policy checksums."""
    from sglang_train_parity.tiny_model import build_tiny_wan

    model_dir = build_tiny_wan(tmp_path_factory.mktemp("model") / "tiny-wan-a14b", A14B)
    client = demo.demo_for(A14B)(model_dir, A14B)
    adapters = {
        expert: demo.random_adapters(model_dir, 1, RANK, ALPHA, expert, seed)[0]
        for seed, expert in enumerate(client.experts)
    }
    logs = tmp_path_factory.mktemp("wan-logs")
    with demo.serve(model_dir, "train_parity", logs, model_id=A14B) as server:
        for expert, adapter in adapters.items():
            response = demo.push_lora(server, adapter, module=expert)
            assert response.json()["success"], response.text
        trainers = {
            expert: client.trainer(expert, adapter, RANK, ALPHA, "cpu")
            for expert, adapter in adapters.items()
        }
        checksums = {
            expert: trainer_policy_checksum(
                model, param_names_mapping=client.family.param_names_mapping
            )
            for expert, model in trainers.items()
        }
        yield server, client, trainers, checksums


def test_a14b_lora_push_without_target_modules_is_refused(wan):
    """It used to land on `transformer` with 200, whichever expert it was trained for."""
    server, client, trainers, checksums = wan
    assert all(demo.policy_checksum(server, e) == checksums[e] for e in trainers)
    low_noise = demo.random_adapters(
        client.model_dir, 1, RANK, ALPHA, "transformer_2", 7
    )[0]
    response = server.post(
        "/update_weights_from_tensor",
        serialized_named_tensors=[demo.encode_tensors(list(low_noise.items()))],
        weight_update_mode="lora_merge",
        lora_rank=RANK,
        lora_alpha=ALPHA,
    )
    assert response.status_code == 400, response.text
    assert (
        "target_modules is required: this pipeline has several DiTs (transformer, "
        "transformer_2)" in response.text
    )
    assert all(demo.policy_checksum(server, e) == checksums[e] for e in trainers)
    rollout = demo.request_rollout(server, client.request, rollout_debug_mode=False)
    steps, experts = client.step_outputs(trainers, rollout, "cpu")
    assert set(experts.values()) == set(trainers)  # both experts ran
    verdict = verify_rollout(
        rollout["rollout_fingerprints"],
        steps,
        {step: checksums[expert]["adapter"] for step, expert in experts.items()},
    )
    assert verdict.ok, verdict.explain()
