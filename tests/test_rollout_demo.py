"""The main job end to end: `sglang-train-parity demo` starts real sglang servers on CPU, pushes 3
LoRA updates on Qwen-Image (fp32 masters, their bf16 copies, fp32 masters; the other families 2:
fp32, then bf16, replacing the first), rolls out with CFG, and recomputes
every step as the trainer does: exactly 0.0 under train_parity with the server's policy checksum
equal to the trainer's, nonzero under default, nothing left running. Qwen-Image (true CFG) and
Wan2.2 T2V-A14B (two experts, each with its own adapter, switched inside the rollout). The GPU run
(`--device cuda`) is benchmark/run_h200.sh's `demo` (docs/results.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DEMO = [str(Path(sys.executable).with_name("sglang-train-parity")), "demo"]
UPDATE_LINE = re.compile(
    r"^\[(train_parity|default)\] update (\d): adapter pushed as (fp32|bf16), .* "
    r"fingerprints=(\S+) policy_checksum=(\S+)$",
    re.M,
)
A14B = "Wan2.2-T2V-A14B-Diffusers"
TI2V = "Wan2.2-TI2V-5B-Diffusers"
EXPLANATION_LINE = re.compile(
    r"^\[(train_parity|default)\] update (\d): the same rollout with its debug tensors: "
    r"model_output_max_abs_diff=(\S+) model_output_mean_abs_diff=(\S+)$",
    re.M,
)


@pytest.fixture(scope="module")
def model_dir(tiny_qwen_image):
    return tiny_qwen_image


@pytest.fixture(scope="module")
def wan_model_dir(tmp_path_factory):
    from sglang_train_parity.tiny_model import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("model") / "tiny-wan-a14b", A14B)


def tagged_env(tmp_path: Path) -> tuple[dict[str, str], str]:
    """An environment with a unique tag, which every process the demo starts inherits;
    the demo's temporary files (server logs kept on failure) go to `tmp_path`."""
    tag = uuid.uuid4().hex
    return (
        dict(os.environ, SGLANG_TRAIN_PARITY_DEMO_TEST=tag, TMPDIR=str(tmp_path)),
        tag,
    )


def live_processes(tag: str) -> list[int]:
    """Pids of live processes carrying `tag` in their environment (not killed, only found)."""
    marker = f"SGLANG_TRAIN_PARITY_DEMO_TEST={tag}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # exited meanwhile, or not ours
            pass
    return pids


def run_demo(env: dict[str, str], *args: str, timeout: float = 480):
    """The demo in its own process, as a user starts it; fails the test on a non-zero exit."""
    result = subprocess.run(
        [*DEMO, *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result


def test_demo_train_parity_is_exact_and_default_is_not(model_dir, tmp_path):
    env, tag = tagged_env(tmp_path)
    report = tmp_path / "report.json"
    result = run_demo(
        env, "--model-dir", str(model_dir), "--updates", "3", "--report", str(report)
    )
    lines = UPDATE_LINE.findall(result.stdout)
    checks = {
        (mode, int(update)): (fp, checksum) for mode, update, _, fp, checksum in lines
    }
    # fp32 masters and their bf16 copies in turn (the default --push-dtypes)
    assert [(m, int(u), d) for m, u, d, *_ in lines if m == "train_parity"] == [
        ("train_parity", 1, "fp32"),
        ("train_parity", 2, "bf16"),
        ("train_parity", 3, "fp32"),
    ]
    assert [checks[("train_parity", u)] for u in (1, 2, 3)] == [("equal", "equal")] * 3
    assert (
        "[train_parity] update 1: fingerprints: all 4 recomputed steps bitwise equal"
        in (result.stdout)
    )
    # the default server packs the text Q/K/V: other weights, other numerics; its
    # fingerprints catch it, and only then are the debug tensors shipped, to show how far
    assert [checks[("default", u)] for u in (1, 2, 3)] == [("differ", "differs")] * 3
    assert re.search(r"\[default\] update 1: fingerprints: step 0; ", result.stdout)
    explained = {
        (mode, int(update)): float(max_diff)
        for mode, update, max_diff, _ in EXPLANATION_LINE.findall(result.stdout)
    }
    assert sorted(explained) == [("default", 1), ("default", 2), ("default", 3)]
    assert all(max_diff > 0 for max_diff in explained.values())
    assert re.search(
        r"^1 +\| bitwise equal on 4 steps +\| equal +\| differ on 4 of 4 steps +\| \d",
        result.stdout,
        re.M,
    )
    assert live_processes(tag) == []
    written = json.loads(report.read_text())
    assert written["passed"] is True and written["device"] == "cpu"
    assert [
        (r["pushed_as"], r["fingerprints_equal"], r["policy_checksum_equal"])
        for r in written["train_parity"]
    ] == [("fp32", True, True), ("bf16", True, True), ("fp32", True, True)]
    assert not any(r["fingerprints_equal"] for r in written["default"])
    assert all(r["model_output_max_abs_diff"] > 0 for r in written["default"])


def test_wan_a14b_demo_is_exact_on_both_experts_and_default_is_not(
    wan_model_dir, tmp_path
):
    """Each update pushes one adapter per expert; t >= 875 runs `transformer` (guidance_scale),
    after it `transformer_2` (guidance_scale_2): with 4 steps the switch falls inside the
    rollout, and every step's fingerprints carry the adapter of the expert that ran it.
    """
    env, tag = tagged_env(tmp_path)
    report = tmp_path / "report.json"
    result = run_demo(
        env,
        *("--model-id", A14B, "--model-dir", str(wan_model_dir)),
        *("--updates", "2", "--report", str(report)),
    )
    lines = UPDATE_LINE.findall(result.stdout)
    assert [(m, int(u), d, fp, cs) for m, u, d, fp, cs in lines] == [
        ("train_parity", 1, "fp32", "equal", "equal"),
        ("train_parity", 2, "bf16", "equal", "equal"),
        # upstream's Wan LoRA forward fails on fp32 adapters: the default server gets bf16
        ("default", 1, "bf16", "differ", "differs"),
        ("default", 2, "bf16", "differ", "differs"),
    ]
    route = "steps 0-1 transformer, 2-3 transformer_2)"
    assert result.stdout.count(route) == 4
    assert "[default] adapters pushed as bf16 whatever --push-dtypes says" in (
        result.stdout
    )
    assert (
        "[train_parity] update 2: fingerprints: all 4 recomputed steps bitwise equal"
        in result.stdout
    )
    explained = [
        (mode, float(max_diff))
        for mode, _, max_diff, _ in EXPLANATION_LINE.findall(result.stdout)
    ]
    assert [mode for mode, _ in explained] == ["default"] * 2
    assert all(max_diff > 0 for _, max_diff in explained)
    assert live_processes(tag) == []
    written = json.loads(report.read_text())
    assert written["passed"] is True and written["model_id"] == A14B
    assert written["rollout_request"]["extra_sampling_params"] == {
        "guidance_scale_2": 3.0
    }
    assert all(
        r["experts_by_step"] == ["transformer"] * 2 + ["transformer_2"] * 2
        for r in written["train_parity"] + written["default"]
    )
    assert [r["pushed_as"] for r in written["default"]] == ["bf16"] * 2


def test_wan_ti2v_demo_is_exact_with_per_token_timesteps(tmp_path):
    """Wan2.2 TI2V-5B: 48 latent channels, its own VAE, one timestep per token (train_parity
    only: the default comparison runs on A14B above)."""
    env, tag = tagged_env(tmp_path)
    result = run_demo(
        env,
        *("--model-id", TI2V, "--model-dir", str(tmp_path / "tiny-ti2v")),
        *("--updates", "2", "--skip-default"),
        timeout=300,
    )
    assert [
        (m, int(u), d, fp, cs) for m, u, d, fp, cs in UPDATE_LINE.findall(result.stdout)
    ] == [
        ("train_parity", 1, "fp32", "equal", "equal"),
        ("train_parity", 2, "bf16", "equal", "equal"),
    ]
    assert live_processes(tag) == []


def assert_two_updates_exact_and_default_differs(result, tag: str) -> None:
    """A demo of two updates (fp32, then bf16 adapters): train_parity's fingerprints equal
    on every update, the default server's differ on every update; no server left running.
    """
    checks = {
        (m, int(u)): (d, fp) for m, u, d, fp, _ in UPDATE_LINE.findall(result.stdout)
    }
    assert sorted(checks) == [
        (m, u) for m in ("default", "train_parity") for u in (1, 2)
    ]
    assert [checks[("train_parity", u)] for u in (1, 2)] == [
        ("fp32", "equal"),
        ("bf16", "equal"),
    ]
    assert [checks[("default", u)][1] for u in (1, 2)] == ["differ"] * 2
    assert "train_parity: bitwise equal to the trainer's recompute" in result.stdout
    assert live_processes(tag) == []


def test_qwen21_demo_is_exact_and_default_is_not(tmp_path):
    """Qwen-Image 2.1: its own pipeline (Qwen3-VL encoder, RGBA VAE), the whole joint sequence
    recomputed at every step; two updates, then the default server (its prefix K/V cache,
    fused kernels and separate prefix GEMMs) differs on every step."""
    env, tag = tagged_env(tmp_path)
    result = run_demo(
        env,
        *("--model-id", "Qwen-Image-2.1", "--model-dir", str(tmp_path / "tiny-qwen21")),
        *("--updates", "2"),
        timeout=400,
    )
    assert_two_updates_exact_and_default_differs(result, tag)


def test_ltx2_demo_is_exact_and_default_is_not(tmp_path):
    """LTX-2: its own pipeline (Gemma 3 encoder, connectors, video and audio VAEs, vocoder),
    9-frame clips with audio, no CFG; two updates, the video stream of every step bitwise
    the trainer's (ltx-core, video alone), then the default server (audio-video
    cross-attention, fused kernels) differs on every step."""
    env, tag = tagged_env(tmp_path)
    result = run_demo(
        env,
        *("--model-id", "LTX-2", "--model-dir", str(tmp_path / "tiny-ltx-2")),
        *("--updates", "2", "--steps", "2"),
        timeout=400,
    )
    assert_two_updates_exact_and_default_differs(result, tag)


def test_every_family_has_a_demo():
    from sglang_train_parity.families import FAMILIES
    from sglang_train_parity.rollout_demo import FAMILY_DEMOS

    assert set(FAMILY_DEMOS) == {family.name for family in FAMILIES}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--push-dtypes", "fp32,fp16"], "--push-dtypes: unknown ['fp16']"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--updates", "0"], "must be at least 1"),
    ],
)
def test_demo_refuses_bad_options(argv, message, capsys):
    from sglang_train_parity.rollout_demo import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_demo_names_the_model_ids_it_runs(capsys):
    from sglang_train_parity.rollout_demo import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model-id", "Wan2.2-I2V-A14B-Diffusers"])  # image-to-video
    err = capsys.readouterr().err
    assert "invalid choice: 'Wan2.2-I2V-A14B-Diffusers'" in err
    for model_id in (
        "Qwen-Image", "Qwen-Image-2.1", "Wan2.1-T2V-1.3B-Diffusers", A14B, TI2V, "LTX-2"
    ):  # fmt: skip
        assert model_id in err


@pytest.mark.parametrize(
    "model_id, message",
    [
        ("Wan2.1-T2V-1.3B-Diffusers", f"holds a {A14B} pipeline, not Wan2.1-T2V-1.3B"),
        ("Qwen-Image", "holds no Qwen-Image pipeline"),
    ],
)
def test_demo_refuses_a_model_dir_of_another_model(
    wan_model_dir, model_id, message, capsys
):
    from sglang_train_parity.rollout_demo import main

    with pytest.raises(SystemExit) as exit:
        main(["--model-id", model_id, "--model-dir", str(wan_model_dir)])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_options_for_a_gpu_machine(monkeypatch, tmp_path):
    """The options `benchmark/run_h200.sh demo` passes, parsed; the dtypes cycle over updates;
    a site folder goes first on the server's PYTHONPATH and no CPU kernels are added on cuda.
    """
    from sglang_train_parity import rollout_demo

    monkeypatch.setattr(rollout_demo.torch.cuda, "is_available", lambda: True)
    args = rollout_demo.parse_args(
        [
            *("--device", "cuda", "--server-site", str(tmp_path), "--updates", "5"),
            *("--push-dtypes", "bf16,fp32,fp32"),
            "--default-server-arg=--attention-backend",
            "--default-server-arg=torch_sdpa",
        ]
    )
    assert args.device == "cuda" and args.server_site == tmp_path
    assert rollout_demo._push_dtype_names(args) == [
        "bf16",
        "fp32",
        "fp32",
        "bf16",
        "fp32",
    ]
    assert args.default_server_arg == ["--attention-backend", "torch_sdpa"]

    started = []

    class Exited:  # what Popen returns here: a server that exited at once
        pid, returncode = -1, 1

        def __init__(self, command, env, **_):
            started.append((command, env))

        def poll(self):
            return self.returncode

    monkeypatch.setattr(rollout_demo.subprocess, "Popen", Exited)
    monkeypatch.setattr(rollout_demo, "_stop", lambda process: None)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    with pytest.raises(RuntimeError, match="the default server exited with status 1"):
        with rollout_demo.serve(
            tmp_path / "model",
            "default",
            log_dir,
            device="cuda",
            site_dir=args.server_site,
            extra_args=args.default_server_arg,
        ):
            pass
    ((command, env),) = started
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path.resolve())
    assert not (log_dir / "cpu-kernels-site").exists()
    assert command[-2:] == ["--attention-backend", "torch_sdpa"]
    assert command[command.index("--numerics") + 1] == "default"


@pytest.mark.parametrize("exits", [True, False], ids=["server-exits", "broker-fails"])
@pytest.mark.parametrize("port", [None, 30123], ids=["picked", "given"])
def test_server_restarts_on_new_ports_when_one_was_taken(
    monkeypatch, tmp_path, port, exits
):
    """A server whose ports were picked free but taken before it bound them (two servers
    start at once) starts again on new ports, a bounded number of times, whether it exits or
    stays up reporting a failed part (sglang's request broker binds port + 1 and, failing,
    makes /health answer "unhealthy"); one started on a port the caller chose fails at once,
    since that port stays taken."""
    import requests
    from sglang_train_parity import rollout_demo

    started = []

    class PortTaken:  # what Popen returns here: a server that lost a port
        pid = -1
        returncode = 1 if exits else None

        def __init__(self, command, stdout, **_):
            started.append(int(command[command.index("--port") + 1]))
            stdout.write("zmq.error.ZMQError: Address already in use (addr='tcp://x')\n")

        def poll(self):
            return self.returncode

    class Unhealthy:  # sglang's /health answer once its broker task ended
        status_code = 503

        def json(self):
            return {"status": "unhealthy", "error": "Offline request broker exited"}

    monkeypatch.setattr(rollout_demo.subprocess, "Popen", PortTaken)
    monkeypatch.setattr(rollout_demo, "_stop", lambda process: None)
    monkeypatch.setattr(requests, "get", lambda url, timeout: Unhealthy())
    failure = "exited with status 1" if exits else "unhealthy: Offline request broker"
    with pytest.raises(RuntimeError, match=failure):
        with rollout_demo.serve(tmp_path / "model", "train_parity", tmp_path, port):
            pass
    if port is None:
        assert len(started) == 1 + rollout_demo.PORT_CLASH_RESTARTS
        assert len(set(started)) > 1
    else:
        assert started == [port]
    assert rollout_demo._LIVE_SERVERS == set()


def test_demo_stops_its_server_on_ctrl_c(model_dir, tmp_path):
    env, tag = tagged_env(tmp_path)
    demo = subprocess.Popen(
        [
            *DEMO,
            "--model-dir",
            str(model_dir),
            "--skip-default",
            "--updates",
            "30",  # ~40 s of rollouts: Ctrl-C lands mid-run, not after a short run ended
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        for line in demo.stdout:  # bounded by the demo's own server start timeout
            if "server healthy" in line:
                break
        assert len(live_processes(tag)) > 2, "the demo and its server should be up"
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert demo.wait(timeout=60) == 128 + signal.SIGINT
        assert live_processes(tag) == []
    finally:
        # if the test failed: the demo and whatever of its servers is left, by pid
        for pid in live_processes(tag):
            os.kill(pid, signal.SIGKILL)
        demo.wait(timeout=10)
