"""The rollout server never serves a policy other than the trainer's without an error (issue 9),
against a real `--numerics train_parity` server on CPU. Each defect below was measured on the
server before the fix (the test's docstring says how it answered); each test checks that the
server still serves, that a refused request left the policy checksum as it was, and that the
next rollout is still bitwise equal to the trainer's recompute. The server options that cannot
be served are refused at startup: their `sglang serve` command line is parsed and resolved as the
command does, without starting a server."""

from __future__ import annotations

import base64
import concurrent.futures
import pickle
import time

import pytest
import requests
import torch
from sglang_train_parity import rollout_demo as demo

from tests.server.test_bad_input import assert_serves_with_parity

pytestmark = pytest.mark.slow

RANK, ALPHA = demo.LORA_RANK, demo.LORA_ALPHA


def assert_policy_kept(server, trainer, before, response, status=400, *fragments):
    assert response.status_code == status, response.text[:500]
    for fragment in fragments:
        assert fragment in response.text, response.text[:500]
    assert demo.policy_checksum(server) == before
    assert_serves_with_parity(server, trainer)


def assert_refused_by_train_parity(server, trainer, before, response, refused):
    assert_policy_kept(
        server,
        trainer,
        before,
        response,
        400,
        f"--numerics train_parity does not support {refused}",
    )


def push(server, adapter, **fields):
    body = dict(
        serialized_named_tensors=[demo.encode_tensors(list(adapter.items()))],
        target_modules=["transformer"],
        lora_rank=RANK,
        lora_alpha=ALPHA,
    )
    body.update(fields)
    return server.post(
        "/update_weights_from_tensor",
        **{k: v for k, v in body.items() if v is not None},
    )


# 1. An update whose mode is missing or unknown: 200 "Updated 1 modules", every tensor skipped.
@pytest.mark.parametrize("mode", [None, "lora", "LoRA_merge", "full"])
def test_lora_update_without_the_lora_mode_is_refused(server, served, adapters, mode):
    before = demo.policy_checksum(server)
    response = push(server, adapters[1], weight_update_mode=mode)
    expected = (
        "LoRA A/B tensors need weight_update_mode='lora_merge'"
        if mode is None
        else f"Unknown weight_update_mode {mode!r}"
    )
    assert_policy_kept(server, served, before, response, 400, expected)


# 2. An update without lora_alpha: 200, served with scale 1 (alpha = rank).
@pytest.mark.parametrize(
    "fields, missing",
    [
        (dict(lora_alpha=None), "lora_alpha"),
        (dict(lora_rank=None, lora_alpha=None), "lora_rank and lora_alpha"),
    ],
    ids=["no alpha", "no rank, no alpha"],
)
def test_lora_update_without_rank_or_alpha_is_refused(
    server, served, adapters, fields, missing
):
    before = demo.policy_checksum(server)
    response = push(server, adapters[1], weight_update_mode="lora_merge", **fields)
    assert_refused_by_train_parity(
        server, served, before, response, f"a LoRA update without {missing}"
    )


def test_idempotent_repush_is_allowed(server, served, adapters):
    """The trainer may push the same adapter again (a retried sync): it keeps the policy."""
    before = demo.policy_checksum(server)
    response = demo.push_lora(server, adapters[0])
    assert response.json()["success"], response.text
    assert "Updated 24 LoRA layers" in response.json()["message"]
    assert demo.policy_checksum(server) == before
    assert_serves_with_parity(server, served)


def _raw(server, path, content: bytes):
    return requests.post(
        server.url + path,
        data=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def _pickled(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


# 3. Malformed bodies: a bare "500 Internal Server Error".
MALFORMED = [
    ("/update_weights_from_tensor", b"{not json", 400, "not valid JSON"),
    ("/update_weights_from_tensor", b"[1, 2]", 400, "must be a JSON object, got list"),
    ("/get_policy_checksum", b"[1]", 400, "must be a JSON object, got list"),
    ("/get_weights_checksum", b"{not json", 400, "not valid JSON"),
    ("/rollout/generate", b"{not json", 422, "JSON decode error"),
    ("/v1/set_lora", b"{not json", 422, "JSON decode error"),
]


@pytest.mark.parametrize(
    "path, content, status, named",
    MALFORMED,
    ids=[f"{path} {content.decode()}" for path, content, _, _ in MALFORMED],
)
def test_malformed_body_is_a_4xx(server, served, path, content, status, named):
    before = demo.policy_checksum(server)
    assert_policy_kept(
        server, served, before, _raw(server, path, content), status, named
    )


@pytest.mark.parametrize(
    "payload, named",
    [
        (_pickled(5), "Unsupported module payload type"),
        (_pickled([1, 2]), "entry 0 is not a (name, tensor) pair"),
        (
            _pickled({"vae": []}),
            "Missing tensor payload for module(s): ['transformer']",
        ),
        ("!!!", "Failed to deserialize serialized_named_tensors"),
    ],
    ids=["int", "list of ints", "dict", "not base64"],
)
def test_payload_of_the_wrong_structure_is_a_400(server, served, payload, named):
    before = demo.policy_checksum(server)
    response = server.post(
        "/update_weights_from_tensor",
        serialized_named_tensors=[payload],
        weight_update_mode="lora_merge",
        target_modules=["transformer"],
        lora_rank=RANK,
        lora_alpha=ALPHA,
    )
    assert_policy_kept(server, served, before, response, 400, named)


def test_set_lora_with_a_missing_path_is_a_400(server, served):
    before = demo.policy_checksum(server)
    response = server.post(
        "/v1/set_lora", lora_nickname="other", lora_path="/no/such/adapter"
    )
    assert_policy_kept(
        server, served, before, response, 400, "Weight path does not exist"
    )


# 5. Rollouts refused at admission: each used to fail with 500 (or be served).
ADMISSION = [
    (dict(width=100000, height=100000), "width=100000 height=100000"),
    (dict(true_cfg_scale=None), "a request without true_cfg_scale"),
    (dict(generator_device="bogus"), "generator_device='bogus'"),
    (dict(guidance_rescale=0.7), "the unknown request field(s) guidance_rescale"),
]


@pytest.mark.parametrize(
    "fields, named", ADMISSION, ids=[named for _, named in ADMISSION]
)
def test_rollout_is_checked_at_admission(server, served, fields, named):
    before = demo.policy_checksum(server)
    body = {**demo.ROLLOUT_REQUEST, "num_inference_steps": 1, **fields}
    response = server.post(
        "/rollout/generate", **{k: v for k, v in body.items() if v is not None}
    )
    assert_refused_by_train_parity(server, served, before, response, named)


# Guarantees that hold today and must survive a rebase.
def test_concurrent_rollouts_are_served_one_by_one(server, served):
    """Three rollouts at once: none is batched with another (each is its own forward,
    bitwise equal to the trainer's recompute of it alone)."""
    seeds = (11, 12, 13)
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        rollouts = list(
            pool.map(
                lambda seed: demo.request_rollout(
                    server, seed=seed, num_inference_steps=2
                ),
                seeds,
            )
        )
    cfg = demo.ROLLOUT_REQUEST["true_cfg_scale"]
    for rollout in rollouts:
        expected = demo.trainer_model_outputs(served, rollout, cfg)
        assert torch.equal(demo.rollout_model_outputs(rollout), expected)
    assert len({r["dit_trajectory"]["latents"][0].sum().item() for r in rollouts}) == 3


def test_an_update_waits_for_the_running_rollout(server, served, model_dir, adapters):
    """An adapter pushed while a rollout runs applies after it: that rollout is all the old
    policy, the next one all the new."""
    from sglang_train_parity.reference import build_reference

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(
            demo.request_rollout, server, seed=21, num_inference_steps=8
        )
        # the rollout is queued before the update (one scheduler, first in first out)
        time.sleep(1.0)
        update = pool.submit(demo.push_lora, server, adapters[1])
        old_policy_rollout = running.result()
        assert update.result().json()["success"]
    cfg = demo.ROLLOUT_REQUEST["true_cfg_scale"]
    expected = demo.trainer_model_outputs(served, old_policy_rollout, cfg)
    assert torch.equal(demo.rollout_model_outputs(old_policy_rollout), expected)
    new_trainer = build_reference(model_dir / "transformer", adapters[1], RANK, ALPHA)
    try:
        assert_serves_with_parity(server, new_trainer)
    finally:
        assert demo.push_lora(server, adapters[0]).json()["success"]


# 4 and 6. Server options that break parity: the `sglang serve` command line is refused (parsed
# and resolved as `sglang serve` does, without starting a server).
@pytest.mark.parametrize(
    "options, named",
    [
        (
            ["--batching-max-size", "4", "--batching-delay-ms", "200"],
            "--batching-max-size 4",
        ),
        (["--disable-autocast", "false"], "disable_autocast=False"),
    ],
    ids=["batching", "stage autocast"],
)
def test_server_options_that_break_parity_are_refused_at_startup(
    model_dir, options, named
):
    from sglang.multimodal_gen.runtime.server_args import prepare_server_args

    argv = ["--model-path", str(model_dir), "--model-id", "Qwen-Image"]
    argv += ["--numerics", "train_parity", *options]
    with pytest.raises(ValueError) as refused:
        prepare_server_args(argv)
    assert str(refused.value).startswith(
        f"--numerics train_parity does not support {named}: "
    )
    prepare_server_args(argv[:4] + options)  # the default numerics serves them


def test_trainer_checksums_use_the_served_dits_names():
    """Wan's loader renames diffusers' parameters (sglang_train_parity.families); a rule that
    packs parameters into one is refused: its checksum is not the trainer's to compute.
    """
    from sglang_train_parity.families import family_of
    from sglang_train_parity.policy import served_names

    from sglang.multimodal_gen.configs.models.dits.qwenimage import QwenImageArchConfig

    wan = served_names(family_of("WanTransformer3DModel").param_names_mapping)
    assert wan("blocks.0.attn1.to_q.weight") == "blocks.0.to_q.weight"
    assert wan("blocks.1.ffn.net.0.proj.bias") == "blocks.1.ffn.fc_in.bias"
    assert wan("blocks.0.attn2.to_k.weight") == "blocks.0.attn2.to_k.weight"
    qwen = served_names(family_of("QwenImageTransformer2DModel").param_names_mapping)
    name = "transformer_blocks.0.attn.add_q_proj.weight"
    assert qwen(name) == name
    packing = served_names(QwenImageArchConfig().param_names_mapping)
    with pytest.raises(ValueError, match="sglang packs it into .*to_added_qkv"):
        packing(name)
