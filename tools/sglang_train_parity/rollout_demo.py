# SPDX-License-Identifier: Apache-2.0
"""``sglang-train-parity demo``: an RL rollout loop against a real sglang diffusion server,
checked the way a trainer would check it.

On a tiny random Qwen-Image pipeline built locally, it starts ``sglang serve`` on CPU with
``--numerics train_parity --lora-merge-mode dynamic``, then for each of N "optimizer steps" pushes
a fresh random LoRA adapter (fp32 masters, all 12 PEFT targets of every block) through
``/update_weights_from_tensor``, requests a rollout with true CFG through ``/rollout/generate``
and recomputes every returned step's post-CFG model output with diffusers + PEFT under CUDA's
autocast policy (emulated on CPU). The same loop against a ``--numerics default`` server shows the
difference train_parity removes. The helpers here (server, push, rollout, recompute) are also the
tests' client.

Upstream's default numerics calls three sgl_kernel CPU ops on CPU that no installable package
provides. To run a ``--numerics default`` server on CPU (as this demo does), put a directory on
its PYTHONPATH holding a ``sitecustomize.py`` with::

    from sglang_train_parity.cpu_kernels import register_cpu_kernels
    register_cpu_kernels()

so that every server process registers plain-PyTorch versions of them.
"""

from __future__ import annotations

import argparse
import base64
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "sglang-train-parity" / "tiny-qwen-image"
LORA_RANK = 4
# alpha / rank = 3: not a power of two, so the LoRA scaling rounds in bf16 as it does in training.
LORA_ALPHA = 12
ROLLOUT_REQUEST = dict(
    prompt="a photo of a red cat on a tree",
    negative_prompt="blurry low quality",
    seed=42,
    generator_device="cpu",
    width=64,
    height=64,
    num_inference_steps=4,
    true_cfg_scale=4.0,
    rollout=True,
    rollout_debug_mode=True,  # returns the per-step model outputs
    rollout_return_denoising_env=True,  # the text embeds and image shapes the DiT saw
    rollout_return_dit_trajectory=True,  # the latents and timesteps of every step
)
SERVER_START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 300
# See the module docstring: how a default-numerics server runs on CPU.
_CPU_KERNELS_SITECUSTOMIZE = (
    "from sglang_train_parity.cpu_kernels import register_cpu_kernels\n"
    "register_cpu_kernels()\n"
)


# Started by `serve` and not yet stopped: what a Ctrl-C must stop.
_LIVE_SERVERS: set[subprocess.Popen] = set()


def _log(message: str) -> None:
    print(message, flush=True)


def _free_port_pair() -> int:
    """A free port whose successor is free too (the server binds port + 1 for its ZMQ broker)."""
    for _ in range(50):
        port = _free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("found no two consecutive free ports on 127.0.0.1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``sglang serve`` process group on loopback; `url` once healthy."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path):
        self.process = process
        self.url = url
        self.log_path = log_path

    def post(self, path: str, timeout: float = REQUEST_TIMEOUT_S, **body):
        import requests

        return requests.post(self.url + path, json=body, timeout=timeout)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@contextmanager
def serve(
    model_dir: Path,
    numerics: str,
    log_dir: Path,
    port: int | None = None,
    start_timeout: float = SERVER_START_TIMEOUT_S,
) -> Iterator[Server]:
    """Start the server in its own process group, wait until healthy, and kill the whole
    group on exit, whatever happens (its workers are subprocesses)."""
    import requests

    port = port or _free_port_pair()
    env = dict(os.environ)
    if numerics == "default":
        site_dir = log_dir / "cpu-kernels-site"
        site_dir.mkdir(exist_ok=True)
        (site_dir / "sitecustomize.py").write_text(_CPU_KERNELS_SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site_dir), env.get("PYTHONPATH")) if p
        )
    command = [
        # the `sglang` entry point of this environment
        *(str(Path(sys.executable).with_name("sglang")), "serve"),
        *("--model-path", str(model_dir), "--model-id", "Qwen-Image"),
        *("--numerics", numerics, "--lora-merge-mode", "dynamic"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--master-port", str(_free_port())),
        *("--num-gpus", "1", "--warmup-mode", "off"),
    ]
    log_path = log_dir / f"server-{numerics}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    _LIVE_SERVERS.add(process)
    server = Server(process, f"http://127.0.0.1:{port}", log_path)
    # The idle server's worker spins on a core; several torch threads here would contend
    # with it (a tiny-model recompute takes 30x longer on two cores). One is plenty.
    client_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the {numerics} server exited with status {process.returncode}; "
                    f"log {log_path}:\n{server.log_tail()}"
                )
            try:
                if requests.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the {numerics} server was not healthy after {start_timeout:.0f} s; "
                    f"log {log_path}:\n{server.log_tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        _stop(process)
        _LIVE_SERVERS.discard(process)
        torch.set_num_threads(client_threads)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left of it: its workers
    may outlive the leader."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass


def encode_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """The server's tensor payload, self-contained: plain pickle (storages as bytes), base64.
    The server unpickles with sglang's allow-listed SafeUnpickler."""
    return base64.b64encode(pickle.dumps(named_tensors)).decode()


def push_lora(
    server: Server,
    lora_state: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]],
    rank: Any = LORA_RANK,
    alpha: Any = LORA_ALPHA,
):
    """POST the adapter as an RL trainer does after an optimizer step; returns the response."""
    named = lora_state.items() if isinstance(lora_state, dict) else lora_state
    return server.post(
        "/update_weights_from_tensor",
        serialized_named_tensors=[encode_tensors([(k, v) for k, v in named])],
        weight_update_mode="lora_merge",  # the LoRA path; dynamic mode keeps it unmerged
        target_modules=["transformer"],
        lora_rank=rank,
        lora_alpha=alpha,
    )


def weights_checksum(server: Server) -> str:
    response = server.post("/get_weights_checksum", module_names=["transformer"])
    response.raise_for_status()
    return response.json()["transformer"]


def policy_checksum(server: Server) -> dict[str, str]:
    """The served DiT's base weights and adapter state (sglang_train_parity.policy)."""
    response = server.post("/get_policy_checksum", module_names=["transformer"])
    response.raise_for_status()
    return response.json()["transformer"]


def _decode(obj: Any) -> Any:
    """msgpack response -> python, tensors (safetensors bytes) -> torch."""
    from safetensors.torch import load

    if isinstance(obj, dict):
        if obj.get("__tensor__"):
            return load(obj["data"])["t"]
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def request_rollout(server: Server, **overrides) -> dict[str, Any]:
    """One rollout (one image); raises with the server's message on an error status."""
    import msgspec

    response = server.post("/rollout/generate", **{**ROLLOUT_REQUEST, **overrides})
    if response.status_code != 200:
        raise RuntimeError(f"rollout failed ({response.status_code}): {response.text}")
    return _decode(msgspec.msgpack.decode(response.content))[0]


def rollout_model_outputs(rollout: dict[str, Any]) -> torch.Tensor:
    """[steps, tokens, channels] post-CFG model outputs the server used for each step."""
    return rollout["rollout_debug_tensors"]["rollout_model_outputs"]


def trainer_model_outputs(
    model: torch.nn.Module, rollout: dict[str, Any], cfg_scale: float
) -> torch.Tensor:
    """Every step's post-CFG model output as the trainer recomputes it from the rollout's
    returned inputs (docs/numerics-contract.md): two DiT forwards under autocast, then
    ``neg + s * (pos - neg)`` rescaled to the conditional norm with fp32 norms."""
    from sglang_train_parity.autocast_emulation import cuda_autocast
    from sglang_train_parity.reference import ATTENTION_BACKEND

    model.set_attention_backend(ATTENTION_BACKEND["cpu"])
    env, trajectory = rollout["denoising_env"], rollout["dit_trajectory"]
    text = {
        branch: env[f"{branch}_cond_kwargs"]["encoder_hidden_states"][0][None]
        for branch in ("pos", "neg")
    }
    img_shapes = [[tuple(s) for s in env["pos_cond_kwargs"]["img_shapes"][0]]]
    outputs = []
    # the trajectory holds each step's DiT input, then the final latent
    for step in range(len(trajectory["timesteps"]) - 1):
        inputs = dict(
            hidden_states=trajectory["latents"][step][None],
            timestep=trajectory["timesteps"][step].reshape(1).float() / 1000.0,
            encoder_hidden_states_mask=None,
            img_shapes=img_shapes,
            return_dict=False,
        )
        with torch.no_grad(), cuda_autocast("cpu"):
            pos = model(encoder_hidden_states=text["pos"], **inputs)[0]
            neg = model(encoder_hidden_states=text["neg"], **inputs)[0]
            combined = neg + cfg_scale * (pos - neg)
            combined = combined * (
                torch.norm(pos, dim=-1, keepdim=True)
                / torch.norm(combined, dim=-1, keepdim=True).clamp_min(1e-12)
            )
        outputs.append(combined[0])
    return torch.stack(outputs)


def random_adapters(
    model_dir: Path, count: int, rank: int, alpha: float
) -> list[dict[str, torch.Tensor]]:
    """One fp32 master adapter per update, as after successive optimizer steps."""
    from diffusers import QwenImageTransformer2DModel
    from sglang_train_parity.reference import random_lora_state

    model = QwenImageTransformer2DModel.from_pretrained(model_dir / "transformer")
    return [random_lora_state(model, rank, alpha, seed=step) for step in range(count)]


def parity_of_update(
    server: Server,
    model_dir: Path,
    adapter: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    **rollout_overrides,
) -> tuple[float, float, bool]:
    """Push `adapter`, roll out, recompute as the trainer: (max, mean) |rollout - trainer|,
    and whether the server's policy checksum is the trainer's."""
    from sglang_train_parity.policy import trainer_policy_checksum
    from sglang_train_parity.reference import build_reference

    response = push_lora(server, adapter, rank, alpha)
    if not response.json().get("success"):
        raise RuntimeError(f"adapter update refused: {response.text}")
    trainer = build_reference(model_dir / "transformer", adapter, rank, alpha)
    same_policy = policy_checksum(server) == trainer_policy_checksum(trainer)
    rollout = request_rollout(server, **rollout_overrides)
    cfg_scale = rollout_overrides.get(
        "true_cfg_scale", ROLLOUT_REQUEST["true_cfg_scale"]
    )
    expected = trainer_model_outputs(trainer, rollout, cfg_scale)
    diff = (rollout_model_outputs(rollout).float() - expected.float()).abs()
    return diff.max().item(), diff.mean().item(), same_policy


def _run_mode(
    numerics: str,
    args: argparse.Namespace,
    adapters: list[dict[str, torch.Tensor]],
    log_dir: Path,
) -> list[tuple[float, float]]:
    _log(f"[{numerics}] starting sglang serve --numerics {numerics} on CPU ...")
    started = time.monotonic()
    results = []
    with serve(args.model_dir, numerics, log_dir, port=args.port) as server:
        _log(
            f"[{numerics}] server healthy at {server.url} after "
            f"{time.monotonic() - started:.0f} s"
        )
        for update, adapter in enumerate(adapters, 1):
            t0 = time.monotonic()
            max_diff, mean_diff, same_policy = parity_of_update(
                server,
                args.model_dir,
                adapter,
                args.lora_rank,
                args.lora_alpha,
                seed=update,
                num_inference_steps=args.steps,
            )
            _log(
                f"[{numerics}] update {update}: adapter pushed, {args.steps}-step "
                f"rollout recomputed ({time.monotonic() - t0:.1f} s): "
                f"model_output_max_abs_diff={max_diff!r} "
                f"model_output_mean_abs_diff={mean_diff!r} "
                f"policy_checksum={'equal' if same_policy else 'differs'}"
            )
            results.append((max_diff, mean_diff, same_policy))
    _log(f"[{numerics}] server stopped")
    return results


def _table(
    parity: list[tuple[float, float, bool]], default: list[tuple[float, float, bool]]
) -> str:
    rows = [
        ("update", "train_parity max / mean", "policy checksum", "default max / mean")
    ]
    for update, (tp_max, tp_mean, same_policy) in enumerate(parity, 1):
        other = (
            f"{default[update - 1][0]:.3e} / {default[update - 1][1]:.3e}"
            if default
            else "skipped"
        )
        checksum = "equal" if same_policy else "DIFFERS"
        rows.append((str(update), f"{tp_max!r} / {tp_mean!r}", checksum, other))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in rows
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sglang-train-parity demo",
        description=(
            "End-to-end RL rollout check of --numerics train_parity on CPU: start the sglang "
            "diffusion server on a tiny local Qwen-Image model, push a new random LoRA adapter "
            "(fp32 masters) per update through /update_weights_from_tensor, request a true-CFG "
            "rollout through /rollout/generate, and recompute every step as the trainer does "
            "(diffusers + PEFT under CUDA's autocast policy). Then the same with "
            "--numerics default. Exit status 0 only if train_parity is bitwise equal "
            "(difference 0.0) on every update and default is not."
        ),
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="tiny Qwen-Image pipeline folder; built there (about 11 MB, a few seconds) "
        "unless it already holds one (default: %(default)s)",
    )
    parser.add_argument(
        "--updates",
        type=int,
        default=3,
        help="adapter updates, each followed by a rollout (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=ROLLOUT_REQUEST["num_inference_steps"],
        help="denoising steps per rollout (default: %(default)s)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=LORA_RANK, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--lora-alpha", type=float, default=LORA_ALPHA, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--skip-default",
        action="store_true",
        help="run only the train_parity server (no --numerics default comparison)",
    )
    parser.add_argument(
        "--port",
        type=int,
        help="server port (it also binds PORT+1); default: a free one",
    )
    args = parser.parse_args(argv)
    if args.updates < 1 or args.steps < 1:
        parser.error("--updates and --steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of `sglang-train-parity demo`; exits with the demo's status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    log_dir = Path(tempfile.mkdtemp(prefix="sglang-train-parity-demo-"))

    def interrupted(signum: int, _frame: Any) -> None:
        # Stop here rather than raise KeyboardInterrupt: raised inside a finalizer, Python
        # ignores it, and the demo would run on.
        for process in list(_LIVE_SERVERS):
            _stop(process)
        _log("interrupted; the servers started are stopped")
        shutil.rmtree(log_dir, ignore_errors=True)
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    keep_logs = True  # for a failure's post-mortem
    try:
        passed = _demo(args, log_dir)
        keep_logs = not passed
    finally:
        if keep_logs:
            _log(f"server logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    sys.exit(0 if passed else 1)


def _demo(args: argparse.Namespace, log_dir: Path) -> bool:
    from diffusers.utils import logging as diffusers_logging
    from sglang_train_parity.tiny_model import build_tiny_qwen_image

    # diffusers' dtype and experimental-API notices would drown the progress lines
    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()

    action = (
        "reusing" if (args.model_dir / "model_index.json").is_file() else "building"
    )
    _log(f"{action} the tiny Qwen-Image pipeline in {args.model_dir}")
    build_tiny_qwen_image(args.model_dir)
    adapters = random_adapters(
        args.model_dir, args.updates, args.lora_rank, args.lora_alpha
    )
    _log(
        f"{args.updates} random LoRA adapters (one per optimizer step): rank "
        f"{args.lora_rank}, alpha {args.lora_alpha:g}, {len(adapters[0])} fp32 "
        "tensors each (A and B of 12 targets in every block)"
    )
    parity = _run_mode("train_parity", args, adapters, log_dir)
    default = [] if args.skip_default else _run_mode("default", args, adapters, log_dir)
    _log("\n" + _table(parity, default) + "\n")
    parity_exact = all(result == (0.0, 0.0, True) for result in parity)
    default_differs = all(max_diff > 0.0 for max_diff, _, _ in default)
    _log(
        "train_parity: "
        + (
            "bitwise equal to the trainer's recompute on every update, serving the "
            "trainer's policy checksum"
            if parity_exact
            else "DIFFERS from the trainer's recompute or policy checksum"
        )
    )
    if default:
        _log(
            "default: "
            + (
                "differs from the trainer's recompute, as expected"
                if default_differs
                else "UNEXPECTEDLY equal to the trainer's recompute"
            )
        )
    return parity_exact and default_differs
