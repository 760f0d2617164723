# SPDX-License-Identifier: Apache-2.0
"""A request field of the wrong type, out of range, or given twice with two
values is refused naming the field, before anything runs."""

import types

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
from sglang.multimodal_gen.runtime.entrypoints.post_training import (
    rollout_api,
    weights_api,
)
from sglang.multimodal_gen.runtime.entrypoints.post_training.io_struct import (
    RolloutRequest,
)
from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import LoRAPipeline
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch
from sglang.multimodal_gen.runtime.post_training.rl_dataclasses import (
    RolloutTrajectoryData,
)
from sglang.multimodal_gen.runtime.post_training.weights_updater import WeightsUpdater


@pytest.fixture
def forwarded(monkeypatch):
    """The requests the endpoints forward to the scheduler."""
    sent = []

    async def forward(req):
        sent.append(req)
        return OutputBatch(output={})

    monkeypatch.setattr(weights_api.async_scheduler_client, "forward", forward)
    monkeypatch.setattr(rollout_api.async_scheduler_client, "forward", forward)
    return sent


@pytest.fixture
def client():
    app = FastAPI()
    app.include_router(weights_api.router)
    app.include_router(rollout_api.router)
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", True),
        ("seed", "7"),
        ("num_inference_steps", 4.5),
        ("true_cfg_scale", "4"),
        ("rollout", 1),
        ("rollout_return_step_indices", [True]),
    ],
)
def test_rollout_field_of_another_type_is_a_422_naming_it(
    client, forwarded, field, value
):
    """A bool is not a seed, a string is not a scale: neither is coerced."""
    response = client.post("/rollout/generate", json={"prompt": "p", field: value})
    assert response.status_code == 422, response.text
    assert [e["loc"][:2] for e in response.json()["detail"]] == [["body", field]]
    assert forwarded == []


def test_an_int_is_a_float():
    assert RolloutRequest(prompt="p", true_cfg_scale=4).true_cfg_scale == 4


def _sampling_kwargs(**fields):
    return rollout_api._build_sampling_kwargs(RolloutRequest(prompt="p", **fields))


@pytest.mark.parametrize(
    "fields, named",
    [
        (
            dict(true_cfg_scale=4.0, extra_sampling_params={"true_cfg_scale": 1.0}),
            "true_cfg_scale=4.0 at the top level and 1.0 in extra_sampling_params",
        ),
        (
            dict(extra_sampling_params={"rollout": False}),
            "rollout=True at the top level and False in extra_sampling_params",
        ),
        (
            dict(seed=1, extra_sampling_params={"seed": [1, 2]}),
            "seed=1 at the top level and [1, 2] in extra_sampling_params",
        ),
    ],
    ids=["true_cfg_scale", "rollout", "seed"],
)
def test_field_given_twice_with_two_values_is_refused(fields, named):
    with pytest.raises(ValueError, match="must have one value; set it once") as e:
        _sampling_kwargs(**fields)
    assert named in str(e.value)


def test_field_given_twice_with_one_value_passes():
    kwargs = _sampling_kwargs(
        true_cfg_scale=4.0,
        rollout=False,
        extra_sampling_params={"true_cfg_scale": 4, "rollout": False},
    )
    assert kwargs["true_cfg_scale"] == 4 and kwargs["rollout"] is False


def test_extra_sampling_params_set_what_the_top_level_left_unset():
    kwargs = _sampling_kwargs(
        seed=None, extra_sampling_params={"seed": 3, "rollout_noise_level": 0.5}
    )
    assert kwargs["seed"] == 3 and kwargs["rollout_noise_level"] == 0.5


def test_response_names_the_seed_the_request_ran_with():
    batch = OutputBatch(
        output=torch.zeros(1, 3, 1, 8, 8),
        rollout_trajectory_data=RolloutTrajectoryData(),
    )
    for seed in (42, [3]):
        (response,) = rollout_api._build_response("r", "p", seed, True, batch)
        assert response.seed == seed


@pytest.mark.parametrize(
    "fields",
    [
        dict(seed=2**64),
        dict(seed=2**64 - 2, num_outputs_per_prompt=3),
        dict(seed=2**64 - 1, prompt=["a", "b"]),
        dict(seed=[1, 2**64]),
    ],
    ids=["2**64", "offset by the output", "offset by the prompt", "list"],
)
def test_seed_beyond_a_torch_generator_is_refused(fields):
    with pytest.raises(ValueError, match="must be below 2\\*\\*64"):
        SamplingParams(**fields)


def test_largest_torch_generator_seed_passes():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    torch.Generator().manual_seed(2**64 - 1)


@pytest.mark.parametrize(
    "field, indices, error",
    [
        ("rollout_sde_step_indices", [4], "has [4], outside 0..3"),
        ("rollout_sde_step_indices", [-1, 0], "has [-1], outside 0..3"),
        ("rollout_return_step_indices", [5], "has [5], outside 0..4"),
        ("rollout_return_step_indices", [True], "must be a list of step indices"),
        ("rollout_return_step_indices", 2, "must be a list of step indices"),
    ],
)
def test_step_index_outside_the_loop_is_refused(field, indices, error):
    with pytest.raises(ValueError, match=f"{field} {error}".replace("[", "\\[")):
        SamplingParams(num_inference_steps=4, rollout=True, **{field: indices})


def test_step_indices_of_every_step_and_the_final_latent_pass():
    SamplingParams(
        num_inference_steps=4,
        rollout=True,
        rollout_sde_step_indices=[0, 3],
        rollout_return_step_indices=[0, 4],
    )


@pytest.mark.parametrize("path", ["/get_weights_checksum", "/get_policy_checksum"])
@pytest.mark.parametrize("module_names", ["transformer", 5, [5], [["transformer"]]])
def test_module_names_not_a_list_of_names_is_a_400(
    client, forwarded, path, module_names
):
    response = client.post(path, json={"module_names": module_names})
    assert response.status_code == 400, response.text
    assert "module_names must be a list of module names" in response.text
    assert forwarded == []


def test_include_base_not_a_bool_is_a_400(client, forwarded):
    response = client.post("/get_policy_checksum", json={"include_base": "no"})
    assert response.status_code == 400, response.text
    assert "include_base must be true or false, got 'no'" in response.text
    assert forwarded == []


@pytest.mark.parametrize(
    "body, named",
    [
        (
            {"target_module": ["x"], "expected_named_tensors_sha256": {"w": "0"}},
            "target_module must be one module name",
        ),
        (
            {"target_module": "transformer", "expected_named_tensors_sha256": {"w": 5}},
            "expected_named_tensors_sha256 must map each tensor name",
        ),
    ],
    ids=["target_module", "digest"],
)
def test_checker_field_of_another_type_is_a_400(client, forwarded, body, named):
    response = client.post("/update_weights_from_tensor_checker", json=body)
    assert response.status_code == 400, response.text
    assert named in response.json()["message"]
    assert forwarded == []


class _TestLoRAPipeline(LoRAPipeline):
    def create_pipeline_stages(self, server_args):
        pass


def _pipeline(*dits: str) -> LoRAPipeline:
    pipeline = object.__new__(_TestLoRAPipeline)
    pipeline.modules = {name: torch.nn.Linear(4, 4) for name in dits}
    pipeline.exclude_lora_layers = []
    pipeline.lora_initialized = False
    return pipeline


@pytest.mark.parametrize("mode", [None, "lora_merge"])
def test_update_without_target_modules_on_two_dits_is_refused(mode):
    """Wan2.2 A14B serves two experts: an update that does not name one would
    land on the first."""
    pipeline = _pipeline("transformer", "transformer_2")
    before = {n: m.weight.detach().clone() for n, m in pipeline.modules.items()}
    ok, message = WeightsUpdater(pipeline).update_weights_from_tensor(
        [("weight", torch.ones(4, 4))], weight_update_mode=mode
    )
    assert not ok
    assert message == (
        "target_modules is required: this pipeline has several DiTs "
        "(transformer, transformer_2); name the one the tensors are for, e.g. "
        "target_modules=['transformer']"
    )
    for name, module in pipeline.modules.items():
        assert torch.equal(module.weight, before[name])


def test_update_without_target_modules_on_one_dit_goes_to_it():
    pipeline = _pipeline("transformer")
    ok, message = WeightsUpdater(pipeline).update_weights_from_tensor(
        [("weight", torch.ones(4, 4))]
    )
    assert ok, message
    assert torch.equal(pipeline.modules["transformer"].weight, torch.ones(4, 4))
