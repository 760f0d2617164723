"""One `--numerics train_parity` server on CPU for the tests of this package, started once and
stopped when the package's tests are done."""

from __future__ import annotations

import contextlib

import pytest
from sglang_train_parity import rollout_demo as demo

RANK, ALPHA = demo.LORA_RANK, demo.LORA_ALPHA


@pytest.fixture(scope="package")
def model_dir(tiny_qwen_image):
    return tiny_qwen_image


@pytest.fixture(scope="package")
def adapters(model_dir):
    """The served adapter, and another one the malformed updates are made from (so that
    a partially applied update would change the checksum)."""
    return demo.random_adapters(model_dir, 2, RANK, ALPHA)


@pytest.fixture(scope="package")
def server(model_dir, tmp_path_factory):
    """The server runs two intra-op threads where the tests' processes run one, so every
    parity check here also checks that the trainer's recompute runs with the rollout's
    thread count (`sglang_train_parity.fingerprints.rollout_threads`)."""
    with contextlib.ExitStack() as serving:
        with pytest.MonkeyPatch.context() as env:  # read when the server starts
            env.setenv("OMP_NUM_THREADS", "2")
            logs = tmp_path_factory.mktemp("logs")
            server = serving.enter_context(demo.serve(model_dir, "train_parity", logs))
        yield server


@pytest.fixture(scope="package")
def served(server, model_dir, adapters):
    """The server with the first adapter pushed, and the trainer's model for it."""
    from sglang_train_parity.reference import build_reference

    response = demo.push_lora(server, adapters[0])
    assert response.json()["success"], response.text
    return build_reference(model_dir / "transformer", adapters[0], RANK, ALPHA)
