# SPDX-License-Identifier: Apache-2.0
"""Malformed control requests get a 4xx naming the problem, never a bare 500."""

import asyncio
import types

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from sglang.multimodal_gen.runtime.entrypoints.openai import common_api
from sglang.multimodal_gen.runtime.entrypoints.post_training import weights_api
from sglang.multimodal_gen.runtime.managers.scheduler import error_output
from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch

ENDPOINTS = [
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_tensor_checker",
    "/get_weights_checksum",
    "/get_policy_checksum",
]


@pytest.fixture
def forwarded(monkeypatch):
    """The requests the endpoints forward; the scheduler answers with `reply`."""
    state = types.SimpleNamespace(requests=[], reply=OutputBatch(output={}))

    async def forward(req):
        state.requests.append(req)
        return state.reply

    monkeypatch.setattr(weights_api.async_scheduler_client, "forward", forward)
    return state


@pytest.fixture
def client():
    app = FastAPI()
    app.include_router(weights_api.router)
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    "body, named",
    [
        (b"{not json", "Request body is not valid JSON"),
        (b"[1, 2]", "Request body must be a JSON object, got list"),
        (b'"text"', "Request body must be a JSON object, got str"),
    ],
    ids=["malformed", "list", "string"],
)
def test_malformed_body_is_a_400(client, forwarded, path, body, named):
    response = client.post(
        path, content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert named in response.json()["detail"]
    assert forwarded.requests == []


@pytest.mark.parametrize(
    "path, body",
    [
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
        (
            "/update_weights_from_tensor_checker",
            {"target_module": "t", "expected_named_tensors_sha256": {"w": "0"}},
        ),
        ("/get_weights_checksum", {}),
        ("/get_policy_checksum", {}),
    ],
)
def test_scheduler_failure_is_reported_with_its_error(client, forwarded, path, body):
    forwarded.reply = OutputBatch(error="worker exploded")
    response = client.post(path, json=body)
    assert response.status_code == 500
    assert "worker exploded" in response.text


@pytest.mark.parametrize(
    "error, status",
    [
        (ValueError("strength must be 1.0"), 400),
        (FileNotFoundError("Weight path does not exist: /x"), 400),
        (RuntimeError("CUDA error"), 500),
    ],
)
def test_lora_request_errors_keep_their_status(monkeypatch, error, status):
    """A handler's exception reaches the LoRA endpoints as an error status: bad
    input is the client's (400), anything else the server's (500)."""
    reply = error_output(error)

    async def forward(req):
        return reply

    monkeypatch.setattr(common_api.async_scheduler_client, "forward", forward)
    with pytest.raises(HTTPException) as raised:
        asyncio.run(common_api._handle_lora_request(object(), "ok", "Failed"))
    assert raised.value.status_code == status
    assert str(error) in raised.value.detail
