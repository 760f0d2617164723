# SPDX-License-Identifier: Apache-2.0
"""``sglang-train-parity demo``: an RL rollout loop against a real sglang diffusion server,
checked the way a trainer would check it.

On a tiny random pipeline built locally (``--model-id``: Qwen-Image by default, Qwen-Image 2.1:
`QwenImage21Demo`, or a Wan text-to-video variant: `WanDemo`), it starts ``sglang serve`` on CPU
(or the GPU with ``--device cuda``) with ``--numerics train_parity --lora-merge-mode dynamic``,
then for each of N "optimizer
steps" pushes a fresh random LoRA adapter (every PEFT target of every block; one per expert for
Wan2.2 A14B) through ``/update_weights_from_tensor``, sent as the fp32 masters or as their bf16
copies (``--push-dtypes``, fp32 and bf16 in turn by default), requests a CFG rollout through
``/rollout/generate`` as a production trainer does (per-step fingerprints, no debug tensors),
recomputes every step with diffusers + PEFT under CUDA's autocast policy (emulated on CPU; real
``torch.autocast("cuda", bf16)`` with the ``_native_flash`` attention backend on the GPU) and checks
the rollout's fingerprints against the recompute. The same loop against a ``--numerics default``
server shows the difference train_parity removes: its fingerprints differ, and the same rollout
requested again with its debug tensors shows by how much (a Wan default server gets the bf16
copies: upstream's Wan LoRA forward fails on fp32 adapters). On the CPU the default server
starts together with the train_parity one (its start-up, mostly imports, runs on another core
while train_parity's is checked); on the GPU or with ``--port``, one after the other. The
helpers here (server, push, rollout, recompute) are also the tests' client.

Upstream's default numerics calls three sgl_kernel CPU ops on CPU that no installable package
provides. To run a ``--numerics default`` server on CPU (as this demo does), put a directory on
its PYTHONPATH holding a ``sitecustomize.py`` with::

    from sglang_train_parity.cpu_kernels import register_cpu_kernels
    register_cpu_kernels()

so that every server process registers plain-PyTorch versions of them.

On a GPU machine that lacks kernels sglang imports (sgl_kernel), ``--server-site DIR`` puts a
folder holding such a ``sitecustomize.py`` first on every server's PYTHONPATH instead; the
repository's ``benchmark/demo_site`` is the one the H200 run uses (docs/results.md).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from sglang_train_parity import ltx2, qwen_image21, wan
from sglang_train_parity.tiny_model import default_model_dir

if TYPE_CHECKING:
    from sglang_train_parity.families import Family
    from sglang_train_parity.fingerprints import Verdict

    # (max and mean |rollout - trainer|, None when the fingerprints are equal; policy
    # checksum equal; the fingerprints' verdict)
    UpdateResult = tuple[float | None, float | None, bool, Verdict]

LORA_RANK = 4
# alpha / rank = 3: not a power of two, so the LoRA scaling rounds in bf16 as it does in training.
LORA_ALPHA = 12
# What every rollout asks for; each family adds its sizes and CFG fields.
ROLLOUT_COMMON = dict(
    prompt="a photo of a red cat on a tree",
    negative_prompt="blurry low quality",
    seed=42,
    generator_device="cpu",
    num_inference_steps=4,
    rollout=True,
    rollout_debug_mode=True,  # returns the per-step model outputs
    rollout_return_denoising_env=True,  # the text embeds and image shapes the DiT saw
    rollout_return_dit_trajectory=True,  # the latents and timesteps of every step
    rollout_return_fingerprints=True,  # per-step output hashes (on by default under train_parity)
)
# Qwen-Image's rollout, the client's default
ROLLOUT_REQUEST = dict(ROLLOUT_COMMON, width=64, height=64, true_cfg_scale=4.0)
SERVER_START_TIMEOUT_S = 240
# a server whose picked port was taken before it bound it starts again, this often at most
PORT_CLASH_RESTARTS = 3
REQUEST_TIMEOUT_S = 300
# See the module docstring: how a default-numerics server runs on CPU.
_CPU_KERNELS_SITECUSTOMIZE = (
    "from sglang_train_parity.cpu_kernels import register_cpu_kernels\n"
    "register_cpu_kernels()\n"
)


DEVICES = ("cpu", "cuda")
# The request's `generator_device` per demo device. On the GPU the SDE rollout draws its variance
# noise with the request's generator into a buffer on the GPU (flow_rollout_controller), which a
# CPU generator cannot fill; the trainer's recompute reads the returned latents either way.
GENERATOR_DEVICE = {"cpu": ROLLOUT_COMMON["generator_device"], "cuda": "cuda"}
PUSH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_PUSH_DTYPES = "fp32,bf16"  # cycled over the updates: fp32, bf16, fp32, ...


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
    """A ``sglang serve`` process group on loopback; `url` once healthy.

    `launch`: starts the process group and returns it with its URL; a server whose ports were
    picked here (free at pick time) calls it again, on new ports, when it lost one of them to
    another process before binding it (`restart_after_port_clash`)."""

    def __init__(
        self,
        launch: Callable[[], tuple[subprocess.Popen, str]],
        log_path: Path,
        numerics: str = "train_parity",
        ports_picked_here: bool = True,
    ):
        self._launch = launch
        self.log_path = log_path
        self.numerics = numerics
        self._port_clash_restarts = PORT_CLASH_RESTARTS if ports_picked_here else 0
        self.process, self.url = launch()
        _LIVE_SERVERS.add(self.process)
        self.started_at = time.monotonic()

    def stop(self) -> None:
        """Stop its process group (idempotent)."""
        _stop(self.process)
        _LIVE_SERVERS.discard(self.process)

    def restart_after_port_clash(self) -> bool:
        """Stop a failed server and start it again on new ports if its log says a port was
        taken; False (and nothing done) otherwise, or once the restarts are spent."""
        clash = next(
            (
                line
                for line in self.log_path.read_text(errors="replace").splitlines()
                if "address already in use" in line.lower()
            ),
            None,
        )
        if clash is None or self._port_clash_restarts == 0:
            return False
        self._port_clash_restarts -= 1
        _log(
            f"[{self.numerics}] a port was taken before the server bound it "
            f"({clash.strip()}); starting it again on new ports"
        )
        self.stop()
        self.process, self.url = self._launch()
        _LIVE_SERVERS.add(self.process)
        return True

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
    **options: Any,
) -> Iterator[Server]:
    """Start the server in its own process group, wait until healthy, and kill the whole
    group on exit, whatever happens (its workers are subprocesses). `options`: those of
    `started_server`."""
    with started_server(model_dir, numerics, log_dir, port, **options) as server:
        wait_until_healthy(server, start_timeout)
        yield server


@contextmanager
def started_server(
    model_dir: Path,
    numerics: str,
    log_dir: Path,
    port: int | None = None,
    *,
    model_id: str = "Qwen-Image",
    device: str = "cpu",
    site_dir: Path | None = None,
    cpu_site_code: str = "",
    extra_args: tuple[str, ...] | list[str] = (),
) -> Iterator[Server]:
    """The server started in its own process group, not waited for (`wait_until_healthy`);
    the whole group killed on exit, whatever happens (its workers are subprocesses).

    `model_id`: sglang's model id for `model_dir` (which pipeline serves it). `site_dir`: a
    folder holding a ``sitecustomize.py``, put first on the server's PYTHONPATH (every server
    process runs it); without one, a server on `device` "cpu" gets one running
    `cpu_site_code` (what the family needs there), and for ``--numerics default`` the CPU
    kernels' (module docstring). `extra_args`: appended to the ``sglang serve`` command.
    The server uses the GPU where torch sees one: `device` only says which the caller
    expects (and on "cpu" the server waits for requests instead of polling: --sleep-on-idle).
    """
    env = dict(os.environ)
    site_code = cpu_site_code if device == "cpu" else ""
    if numerics == "default" and device == "cpu":
        site_code += _CPU_KERNELS_SITECUSTOMIZE
    if site_dir is None and site_code:
        site_dir = log_dir / f"cpu-site-{numerics}"
        site_dir.mkdir(exist_ok=True)
        (site_dir / "sitecustomize.py").write_text(site_code)
    if site_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(site_dir).resolve()), env.get("PYTHONPATH")) if p
        )
    log_path = log_dir / f"server-{numerics}.log"

    def launch() -> tuple[subprocess.Popen, str]:
        server_port = port or _free_port_pair()
        command = [
            *_sglang_command(),
            "serve",
            *("--model-path", str(model_dir), "--model-id", model_id),
            *("--numerics", numerics, "--lora-merge-mode", "dynamic"),
            *("--host", "127.0.0.1", "--port", str(server_port)),
            *("--master-port", str(_free_port())),
            *("--num-gpus", "1", "--warmup-mode", "off"),
            # on the CPU an idle scheduler would spin a core that the client's recompute needs
            *(["--sleep-on-idle"] if device == "cpu" else []),
            *extra_args,
        ]
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        return process, f"http://127.0.0.1:{server_port}"

    server = Server(launch, log_path, numerics, ports_picked_here=port is None)
    # The server's processes share the cores (on the GPU its idle scheduler spins on one);
    # several torch threads here would contend with them (a tiny-model recompute took 30x
    # longer on two cores). One is plenty.
    client_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield server
    finally:
        server.stop()
        torch.set_num_threads(client_threads)


def wait_until_healthy(
    server: Server, start_timeout: float = SERVER_START_TIMEOUT_S
) -> None:
    """Wait up to `start_timeout` seconds from now for `server` to answer /health; raises
    with its log's tail if it exits, reports itself unhealthy (a failed part, such as its
    request broker) or does not answer in time. A server that lost a port is started again
    first (`Server.restart_after_port_clash`)."""
    import requests

    deadline = time.monotonic() + start_timeout
    while True:
        failure = None
        if server.process.poll() is not None:
            failure = f"exited with status {server.process.returncode}"
        else:
            try:
                response = requests.get(server.url + "/health", timeout=2)
                if response.status_code == 200:
                    return
                failure = _unhealthy_reason(response)
            except requests.RequestException:
                pass
        if failure is not None:
            if server.restart_after_port_clash():
                deadline = time.monotonic() + start_timeout
                continue
            raise RuntimeError(
                f"the {server.numerics} server {failure}; log {server.log_path}:\n"
                f"{server.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the {server.numerics} server was not healthy after {start_timeout:.0f} "
                f"s; log {server.log_path}:\n{server.log_tail()}"
            )
        time.sleep(0.5)


def _unhealthy_reason(response) -> str | None:
    """What a /health answer of ``{"status": "unhealthy", "error": ...}`` says failed; None
    for any other answer (a server still starting answers 503 without a body)."""
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("status") == "unhealthy":
        return f"is unhealthy: {body.get('error')}"
    return None


def _sglang_command() -> list[str]:
    """The `sglang` entry point of this environment: the script beside the interpreter, or,
    where the fork was installed elsewhere (``pip install --target``), its main function run by
    this interpreter."""
    script = Path(sys.executable).with_name("sglang")
    if script.is_file():
        return [str(script)]
    return [
        sys.executable,
        "-c",
        "import sys; from sglang.cli.main import main; sys.argv[0] = 'sglang'; "
        "sys.exit(main())",
    ]


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
    dtype: torch.dtype | None = None,
    module: str = "transformer",
):
    """POST the adapter of the DiT `module` (an expert: ``transformer_2`` is Wan2.2 A14B's
    low-noise one) as an RL trainer does after an optimizer step; returns the response.
    `dtype`: send the tensors cast to it (the trainer's bf16 copies of fp32 masters, say);
    None sends them as they are."""
    named = lora_state.items() if isinstance(lora_state, dict) else lora_state
    if dtype is not None:
        named = [(k, v.to(dtype)) for k, v in named]
    return server.post(
        "/update_weights_from_tensor",
        serialized_named_tensors=[encode_tensors([(k, v) for k, v in named])],
        weight_update_mode="lora_merge",  # the LoRA path; dynamic mode keeps it unmerged
        target_modules=[module],
        lora_rank=rank,
        lora_alpha=alpha,
    )


def weights_checksum(server: Server) -> str:
    response = server.post("/get_weights_checksum", module_names=["transformer"])
    response.raise_for_status()
    return response.json()["transformer"]


def policy_checksum(server: Server, module: str = "transformer") -> dict[str, str]:
    """The served DiT `module`'s base weights and adapter state (sglang_train_parity.policy)."""
    response = server.post("/get_policy_checksum", module_names=[module])
    response.raise_for_status()
    return response.json()[module]


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


def request_rollout(
    server: Server, request: Mapping[str, Any] = ROLLOUT_REQUEST, **overrides
) -> dict[str, Any]:
    """One rollout (one image or video) of `request` updated by `overrides`; raises with the
    server's message on an error status."""
    import msgspec

    response = server.post("/rollout/generate", **{**request, **overrides})
    if response.status_code != 200:
        raise RuntimeError(f"rollout failed ({response.status_code}): {response.text}")
    return _decode(msgspec.msgpack.decode(response.content))[0]


def rollout_model_outputs(rollout: dict[str, Any]) -> torch.Tensor:
    """The post-CFG model outputs the server used, one per step: [steps, tokens, channels]
    (Qwen-Image), [steps, channels, frames, height, width] (Wan)."""
    return rollout["rollout_debug_tensors"]["rollout_model_outputs"]


def trainer_step_outputs(
    model: torch.nn.Module,
    rollout: dict[str, Any],
    cfg_scale: float,
    device: str = "cpu",
) -> dict[int, dict[str, torch.Tensor]]:
    """Every step of a Qwen-Image rollout as the trainer recomputes it from the rollout's
    returned inputs (docs/numerics-contract.md), by step index: ``conditional`` and
    ``unconditional`` (the two DiT forwards under autocast) and ``combined`` (``neg + s * (pos -
    neg)`` rescaled to the conditional norm with fp32 norms), batch dimension dropped, on the
    CPU: what ``sglang_train_parity.fingerprints.verify_rollout`` takes.

    `device` "cpu": CUDA's autocast policy emulated on the CPU, diffusers' ``native``
    attention; "cuda": real ``torch.autocast("cuda", bf16)`` and ``_native_flash`` (`model`
    on the GPU); on the CPU with the rollout's thread count (`rollout_threads`)."""
    from sglang_train_parity.fingerprints import rollout_threads

    with rollout_threads(rollout.get("rollout_fingerprints")):
        return _trainer_step_outputs(model, rollout, cfg_scale, device)


def _trainer_step_outputs(model, rollout, cfg_scale, device):
    from sglang_train_parity.autocast_emulation import cuda_autocast
    from sglang_train_parity.reference import ATTENTION_BACKEND

    model.set_attention_backend(ATTENTION_BACKEND[device])
    env, trajectory = rollout["denoising_env"], rollout["dit_trajectory"]
    text = {
        branch: env[f"{branch}_cond_kwargs"]["encoder_hidden_states"][0][None].to(
            device
        )
        for branch in ("pos", "neg")
    }
    img_shapes = [[tuple(s) for s in env["pos_cond_kwargs"]["img_shapes"][0]]]
    outputs = {}
    # the trajectory holds each step's DiT input, then the final latent
    for step in range(len(trajectory["timesteps"]) - 1):
        inputs = dict(
            hidden_states=trajectory["latents"][step][None].to(device),
            # as the trainer: t / 1000 in fp32, on the device the model runs on
            timestep=trajectory["timesteps"][step].reshape(1).to(device, torch.float32)
            / 1000.0,
            encoder_hidden_states_mask=None,
            img_shapes=img_shapes,
            return_dict=False,
        )
        with torch.no_grad(), cuda_autocast(device):
            pos = model(encoder_hidden_states=text["pos"], **inputs)[0]
            neg = model(encoder_hidden_states=text["neg"], **inputs)[0]
            combined = neg + cfg_scale * (pos - neg)
            combined = combined * (
                torch.norm(pos, dim=-1, keepdim=True)
                / torch.norm(combined, dim=-1, keepdim=True).clamp_min(1e-12)
            )
        outputs[step] = {
            "conditional": pos[0].cpu(),
            "unconditional": neg[0].cpu(),
            "combined": combined[0].cpu(),
        }
    return outputs


def trainer_model_outputs(
    model: torch.nn.Module,
    rollout: dict[str, Any],
    cfg_scale: float,
    device: str = "cpu",
) -> torch.Tensor:
    """[steps, tokens, channels] post-CFG model outputs as the trainer recomputes them
    (`trainer_step_outputs`), on the CPU."""
    steps = trainer_step_outputs(model, rollout, cfg_scale, device)
    return torch.stack([steps[step]["combined"] for step in sorted(steps)])


def random_adapters(
    model_dir: Path,
    count: int,
    rank: int,
    alpha: float,
    expert: str = "transformer",
    first_seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """One fp32 master adapter of the DiT `expert` per update, as after successive optimizer
    steps, on its family's trainer targets; seeds `first_seed`, `first_seed` + 1, ..."""
    import diffusers
    from sglang_train_parity.families import family_of
    from sglang_train_parity.reference import random_lora_state

    config = json.loads((model_dir / expert / "config.json").read_text())
    family = family_of(config["_class_name"])
    model = getattr(diffusers, family.diffusers_class).from_pretrained(
        model_dir / expert, torch_dtype=torch.float32
    )
    return [
        random_lora_state(model, rank, alpha, first_seed + step, family.lora_targets)
        for step in range(count)
    ]


class DemoError(Exception):
    """A model folder that does not fit --model-id; reported like an argparse error."""


def _family(model_dir: Path, name: str) -> Family:
    """The family named `name` (sglang_train_parity.families), checked to be that of
    `model_dir`'s DiT."""
    from sglang_train_parity.families import family_of

    config = model_dir / "transformer" / "config.json"
    found = (
        family_of(json.loads(config.read_text()).get("_class_name"))
        if config.is_file()
        else None
    )
    if found is None or found.name != name:
        raise DemoError(
            f"{model_dir} holds no {name} pipeline; give --model-dir a new folder (the "
            "tiny model is built there) or one the demo built for this --model-id"
        )
    return found


class QwenImageDemo:
    """What the demo does for Qwen-Image: one DiT, 64x64 images, true CFG rescaled to the
    conditional's norm (`trainer_step_outputs`)."""

    family_name = "Qwen-Image"
    model_ids = ("Qwen-Image",)
    experts = ("transformer",)
    request = ROLLOUT_REQUEST
    # the default server takes the adapters as --push-dtypes sends them
    default_push_dtype: str | None = None
    cpu_site_code = ""
    # the step output the scheduler steps with, by its fingerprint name
    combined = "combined"

    def __init__(self, model_dir: Path, model_id: str) -> None:
        self.model_dir, self.model_id = model_dir, model_id
        self.family = _family(model_dir, self.family_name)

    @staticmethod
    def build_tiny(model_id: str, root: Path) -> Path:
        from sglang_train_parity.tiny_model import build_tiny_qwen_image

        return build_tiny_qwen_image(root)

    def trainer(self, expert, adapter, rank, alpha, device) -> torch.nn.Module:
        from sglang_train_parity.reference import build_reference

        return build_reference(
            self.model_dir / expert, adapter, rank, alpha, device=device
        )

    def step_outputs(self, trainers, rollout, device):
        """`trainer_step_outputs` of the rollout, and the expert of every step."""
        cfg_scale = self.request["true_cfg_scale"]
        steps = trainer_step_outputs(
            trainers["transformer"], rollout, cfg_scale, device
        )
        return steps, dict.fromkeys(steps, "transformer")


class QwenImage21Demo(QwenImageDemo):
    """What the demo does for Qwen-Image 2.1 (text-to-image): as for Qwen-Image (64x64 images,
    here 4x4 latent tokens), true CFG without a rescale, every step recomputed over the whole
    joint sequence, as its trainer does (no prefix K/V cache)."""

    family_name = "Qwen-Image 2.1 (text-to-image)"
    model_ids = (qwen_image21.MODEL_ID,)
    # its Qwen3-VL text encoder cannot be built on a CPU host without it (cpu_kernels)
    cpu_site_code = (
        "from sglang_train_parity.cpu_kernels import stand_in_vllm_rotary_embedding\n"
        "stand_in_vllm_rotary_embedding()\n"
    )

    @staticmethod
    def build_tiny(model_id: str, root: Path) -> Path:
        from sglang_train_parity.tiny_qwen21 import build_tiny_qwen_image21

        return build_tiny_qwen_image21(root)

    def trainer(self, expert, adapter, rank, alpha, device) -> torch.nn.Module:
        from diffusers import QwenImage21Transformer2DModel

        masters = QwenImage21Transformer2DModel.from_pretrained(
            self.model_dir / expert, torch_dtype=torch.float32
        )
        return qwen_image21.build_reference(masters, adapter, rank, alpha, device)

    def step_outputs(self, trainers, rollout, device):
        """Every step recomputed as the trainer calls the DiT (`qwen_image21.reference_forward`:
        the rollout's latents and text embeds, `t / 1000` in fp32), by step index, and the
        expert of every step; ``neg + s * (pos - neg)``."""
        env, trajectory = rollout["denoising_env"], rollout["dit_trajectory"]
        text = {
            branch: env[f"{branch}_cond_kwargs"]["encoder_hidden_states"][0][None]
            for branch in ("pos", "neg")
        }
        grid = tuple(env["pos_cond_kwargs"]["layouts"][0]["target_shape"])
        scale = self.request["true_cfg_scale"]
        steps = {}
        for step in range(len(trajectory["timesteps"]) - 1):
            latents = trajectory["latents"][step][None]
            timestep = trajectory["timesteps"][step].reshape(1).float()
            pos, neg = (
                qwen_image21.reference_forward(
                    trainers["transformer"],
                    qwen_image21.QwenImage21DiTInputs(
                        latents, text[b], (text[b].shape[1],), timestep, grid
                    ),
                    device,
                )[0]
                for b in ("pos", "neg")
            )
            combined = neg + scale * (pos - neg)
            steps[step] = {
                "conditional": pos[0].cpu(),
                "unconditional": neg[0].cpu(),
                "combined": combined[0].cpu(),
            }
        return steps, dict.fromkeys(steps, "transformer")


class WanDemo:
    """What the demo does for Wan text-to-video: 5-frame videos of 2x2 tokens a latent frame,
    CFG without a rescale, one adapter per expert. Wan2.2 A14B runs ``transformer`` with
    ``guidance_scale`` while t >= its boundary, then ``transformer_2`` with
    ``guidance_scale_2``: with 4 steps the rollout switches experts after the second."""

    family_name = "Wan (text-to-video)"
    model_ids = tuple(wan.TINY_VARIANTS)
    # upstream's LoRA GEMM (lora/linear.py, _add_lora_delta_in_gemm) takes fp32 A and B next
    # to bf16 activations, and the rollout fails ("self and mat2 must have the same dtype"):
    # the default server gets the bf16 copies
    default_push_dtype: str | None = "bf16"
    cpu_site_code = ""
    combined = "combined"

    def __init__(self, model_dir: Path, model_id: str) -> None:
        self.model_dir, self.model_id = model_dir, model_id
        self.family = _family(model_dir, self.family_name)
        layout = wan.WanLayout.of(model_dir)
        if layout.model_id != model_id:
            raise DemoError(
                f"{model_dir} holds a {layout.model_id} pipeline, not {model_id}; give "
                "--model-dir a new folder (the tiny model is built there) or one built for "
                "this --model-id"
            )
        self.experts = layout.experts
        # diffusers' WanPipeline: one timestep per token where it expands them (TI2V-5B),
        # the expert boundary on the scheduler's timestep scale
        self.per_token = layout.per_token_timesteps
        scheduler = json.loads(
            (model_dir / "scheduler" / "scheduler_config.json").read_text()
        )
        ratio = layout.boundary_ratio
        self.boundary = (
            None if ratio is None else ratio * scheduler["num_train_timesteps"]
        )
        self.request = dict(
            ROLLOUT_COMMON,
            # 2x2 tokens a latent frame
            width=2 * layout.pixels_per_patch,
            height=2 * layout.pixels_per_patch,
            num_frames=5,  # 2 latent frames
            # Wan's CFG field; sent always: a default would be one the trainer does not know
            guidance_scale=4.0,
        )
        if len(self.experts) > 1:
            # train_parity refuses unknown top-level fields: the low-noise expert's scale
            # goes in extra_sampling_params
            self.request["extra_sampling_params"] = {"guidance_scale_2": 3.0}

    @staticmethod
    def build_tiny(model_id: str, root: Path) -> Path:
        from sglang_train_parity.tiny_model import build_tiny_wan

        return build_tiny_wan(root, model_id)

    def trainer(self, expert, adapter, rank, alpha, device) -> torch.nn.Module:
        from diffusers import WanTransformer3DModel

        masters = WanTransformer3DModel.from_pretrained(
            self.model_dir / expert, torch_dtype=torch.float32
        )
        return wan.build_reference(masters, adapter, rank, alpha, device)

    def step_outputs(self, trainers, rollout, device):
        """Every step recomputed as diffusers' WanPipeline calls its DiTs, by step index (as
        `trainer_step_outputs`), and the expert of every step: the text embeds in the DiT's
        dtype (bf16), the timestep raw on the 0..1000 scale (per token for TI2V-5B), the
        expert and its scale by the boundary, ``neg + s * (pos - neg)``."""
        env, trajectory = rollout["denoising_env"], rollout["dit_trajectory"]
        text = {
            branch: env[f"{branch}_cond_kwargs"]["encoder_hidden_states"][None].to(
                torch.bfloat16
            )
            for branch in ("pos", "neg")
        }
        steps, experts = {}, {}
        for step in range(len(trajectory["timesteps"]) - 1):
            latents = trajectory["latents"][step][None]
            timestep = trajectory["timesteps"][step].reshape(1).float()
            high_noise = self.boundary is None or timestep.item() >= self.boundary
            expert = wan.EXPERTS[0 if high_noise else 1]
            scale = (
                self.request["guidance_scale"]
                if high_noise
                else self.request["extra_sampling_params"]["guidance_scale_2"]
            )
            model = trainers[expert]
            if self.per_token:
                p_t, p_h, p_w = model.config.patch_size
                _, _, frames, height, width = latents.shape
                tokens = (frames // p_t) * (height // p_h) * (width // p_w)
                timestep = timestep.expand(1, tokens)
            pos, neg = (
                wan.reference_forward(
                    model, wan.WanDiTInputs(latents, text[branch], timestep), device
                )[0]
                for branch in ("pos", "neg")
            )
            combined = neg + scale * (pos - neg)
            steps[step] = {
                "conditional": pos[0].cpu(),
                "unconditional": neg[0].cpu(),
                "combined": combined[0].cpu(),
            }
            experts[step] = expert
        return steps, experts


class LTX2Demo:
    """What the demo does for LTX-2 text-to-video: 9-frame 64x64 clips with their audio (2 x 2 x
    2 video tokens), no CFG (miles trains LTX-2 unguided), the video stream recomputed as the
    trainer runs it, alone; the audio stream the server generates beside it is not the
    trainer's and is not checked."""

    family_name = "LTX-2 (text-to-video)"
    model_ids = (ltx2.MODEL_ID,)
    experts = ("transformer",)
    request = dict(
        {k: v for k, v in ROLLOUT_COMMON.items() if k != "negative_prompt"},
        width=64,
        height=64,
        num_frames=9,
        guidance_scale=1.0,  # sent always: the contract refuses a request without it
    )
    # upstream's LoRA GEMM takes fp32 A and B next to bf16 activations (as Wan's)
    default_push_dtype: str | None = "bf16"
    cpu_site_code = ""
    # the DiT returns (video, audio): the video's fingerprints are ".0"
    combined = "combined.0"

    def __init__(self, model_dir: Path, model_id: str) -> None:
        self.model_dir, self.model_id = model_dir, model_id
        self.family = _family(model_dir, self.family_name)

    @staticmethod
    def build_tiny(model_id: str, root: Path) -> Path:
        from sglang_train_parity.tiny_ltx2 import build_tiny_ltx2

        return build_tiny_ltx2(root)

    def trainer(self, expert, adapter, rank, alpha, device) -> torch.nn.Module:
        from diffusers import LTX2VideoTransformer3DModel

        masters = LTX2VideoTransformer3DModel.from_pretrained(
            self.model_dir / expert, torch_dtype=torch.float32
        )
        return ltx2.build_reference(masters, adapter, rank, alpha, device)

    def step_outputs(self, trainers, rollout, device):
        """Every step's video output recomputed as miles' trainer calls ltx-core
        (`ltx2.trainer_forward`: the rollout's latents and video text embeds, sigma = the
        timestep in bf16 / 1000), by step index: the DiT's video output (``conditional.0``)
        and the fp32 copy the scheduler steps with (``combined.0``)."""
        env, trajectory = rollout["denoising_env"], rollout["dit_trajectory"]
        text = env["pos_cond_kwargs"]["encoder_hidden_states"][None]
        grid = ltx2.latent_grid(
            self.request["num_frames"], self.request["height"], self.request["width"]
        )
        steps = {}
        for step in range(len(trajectory["timesteps"]) - 1):
            inputs = ltx2.LTX2DiTInputs(
                trajectory["latents"][step][None],
                None,
                text,
                trajectory["timesteps"][step].reshape(1).float(),
                grid,
            )
            video = ltx2.trainer_forward(trainers["transformer"], inputs, device)
            steps[step] = {
                "conditional.0": video[0].cpu(),
                "combined.0": video[0].float().cpu(),
            }
        return steps, dict.fromkeys(steps, "transformer")


# family name (families.FAMILIES) -> what the demo does for it
Demo = QwenImageDemo | QwenImage21Demo | WanDemo | LTX2Demo
FAMILY_DEMOS = {
    demo.family_name: demo
    for demo in (QwenImageDemo, QwenImage21Demo, WanDemo, LTX2Demo)
}
DEMO_MODEL_IDS = tuple(i for demo in FAMILY_DEMOS.values() for i in demo.model_ids)


def demo_for(model_id: str) -> type[Demo]:
    """The demo of the family `model_id` (one of DEMO_MODEL_IDS) belongs to."""
    return next(d for d in FAMILY_DEMOS.values() if model_id in d.model_ids)


def parity_of_update(
    server: Server,
    demo: Demo,
    adapters: Mapping[str, dict[str, torch.Tensor]],
    rank: int,
    alpha: float,
    *,
    device: str = "cpu",
    push_dtype: torch.dtype | None = None,
    per_step: list[tuple[float, float]] | None = None,
    experts_by_step: dict[int, str] | None = None,
    **rollout_overrides,
) -> UpdateResult:
    """Push every expert's adapter of `adapters` (cast to `push_dtype` if given; the trainer
    keeps the fp32 masters), roll out `demo.request` (updated by `rollout_overrides`) as in
    production (fingerprints, no debug tensors), recompute as the trainer on `device` and
    verify the rollout's fingerprints, each step against the adapter of the expert that ran
    it. Returns the max and mean |rollout - trainer| of the post-CFG outputs (None when the
    fingerprints are equal: then every step is bitwise equal), whether the server's policy
    checksum of every expert is the trainer's, and the fingerprints' verdict. When the
    fingerprints differ, the same rollout is requested again with its debug tensors to
    measure how far apart they are; `per_step`, if given, gets each step's (max, mean)
    appended, `experts_by_step` which expert ran each step."""
    from sglang_train_parity.fingerprints import rollout_threads, verify_rollout
    from sglang_train_parity.policy import trainer_policy_checksum

    for expert, adapter in adapters.items():
        response = push_lora(
            server, adapter, rank, alpha, dtype=push_dtype, module=expert
        )
        if not response.json().get("success"):
            raise RuntimeError(f"{expert} adapter update refused: {response.text}")
    trainers = {
        expert: demo.trainer(expert, adapter, rank, alpha, device)
        for expert, adapter in adapters.items()
    }
    checksums = {
        expert: trainer_policy_checksum(
            model, param_names_mapping=demo.family.param_names_mapping
        )
        for expert, model in trainers.items()
    }
    same_policy = all(policy_checksum(server, e) == checksums[e] for e in trainers)
    request = {**demo.request, **rollout_overrides}
    rollout = request_rollout(server, request, rollout_debug_mode=False)
    with rollout_threads(rollout["rollout_fingerprints"]):
        steps, experts = demo.step_outputs(trainers, rollout, device)
    if experts_by_step is not None:
        experts_by_step.update(experts)
    verdict = verify_rollout(
        rollout["rollout_fingerprints"],
        steps,
        {step: checksums[expert]["adapter"] for step, expert in experts.items()},
    )
    if verdict.ok:
        return None, None, same_policy, verdict
    # the explanation: the same rollout, with the tensors the fingerprints summarize
    rollout = request_rollout(server, request, rollout_debug_mode=True)
    with rollout_threads(rollout["rollout_fingerprints"]):
        steps, _ = demo.step_outputs(trainers, rollout, device)
    expected = torch.stack([steps[step][demo.combined] for step in sorted(steps)])
    diff = (rollout_model_outputs(rollout).float() - expected.float()).abs()
    if per_step is not None:
        per_step.extend((d.max().item(), d.mean().item()) for d in diff)
    return diff.max().item(), diff.mean().item(), same_policy, verdict


def _push_dtype_names(args: argparse.Namespace) -> list[str]:
    """The dtype each update is sent as: `--push-dtypes` cycled over the updates."""
    names = args.push_dtypes.split(",")
    return [names[i % len(names)] for i in range(args.updates)]


def _mode_push_dtypes(
    args: argparse.Namespace, demo: Demo, numerics: str
) -> list[str]:
    """What each update is sent as to the `numerics` server: `_push_dtype_names`, but
    the family's `default_push_dtype` to the default server if it has one."""
    if numerics == "default" and demo.default_push_dtype is not None:
        return [demo.default_push_dtype] * args.updates
    return _push_dtype_names(args)


def _route(experts_by_step: Mapping[int, str]) -> str:
    """Which expert ran which steps: "steps 0-1 transformer, 2-3 transformer_2"."""
    runs: list[list] = []  # [first step, last step, expert]
    for step in sorted(experts_by_step):
        expert = experts_by_step[step]
        if runs and runs[-1][2] == expert and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step, expert])
    return "steps " + ", ".join(
        f"{first}-{last} {expert}" if first != last else f"{first} {expert}"
        for first, last, expert in runs
    )


def _start_server(
    numerics: str,
    args: argparse.Namespace,
    demo: Demo,
    log_dir: Path,
    stack: ExitStack,
) -> Server:
    """The `numerics` server of the demo, started (not yet healthy) and stopped when `stack`
    closes, whatever happens."""
    _log(
        f"[{numerics}] starting sglang serve --numerics {numerics} on "
        f"{args.device.upper()} ..."
    )
    extra_args = list(args.server_arg or [])
    if numerics == "default":
        extra_args += args.default_server_arg or []
    if extra_args:
        _log(f"[{numerics}] extra server arguments: {' '.join(extra_args)}")
    return stack.enter_context(
        started_server(
            demo.model_dir,
            numerics,
            log_dir,
            port=args.port,
            model_id=args.model_id,
            device=args.device,
            site_dir=args.server_site,
            cpu_site_code=demo.cpu_site_code,
            extra_args=extra_args,
        )
    )


def _run_mode(
    server: Server,
    args: argparse.Namespace,
    demo: Demo,
    adapters: list[dict[str, dict[str, torch.Tensor]]],
) -> list[UpdateResult]:
    """Every update against `server` (started by `_start_server`), which is stopped at the
    end, whatever happens."""
    numerics, device = server.numerics, args.device
    results = []
    step_diffs = args.step_diffs.setdefault(numerics, [])
    step_experts = args.step_experts.setdefault(numerics, [])
    dtypes = _mode_push_dtypes(args, demo, numerics)
    if dtypes != _push_dtype_names(args):
        _log(
            f"[{numerics}] adapters pushed as {demo.default_push_dtype} whatever "
            f"--push-dtypes says: with fp32 ones, upstream's {args.model_id} LoRA forward "
            "fails (its LoRA GEMM mixes them with bf16 activations)"
        )
    try:
        wait_until_healthy(server)
        _log(
            f"[{numerics}] server healthy at {server.url} after "
            f"{time.monotonic() - server.started_at:.0f} s"
        )
        for update, update_adapters in enumerate(adapters, 1):
            t0 = time.monotonic()
            dtype = dtypes[update - 1]
            steps: list[tuple[float, float]] = []
            experts: dict[int, str] = {}
            max_diff, mean_diff, same_policy, verdict = parity_of_update(
                server,
                demo,
                update_adapters,
                args.lora_rank,
                args.lora_alpha,
                device=device,
                push_dtype=PUSH_DTYPES[dtype],
                per_step=steps,
                experts_by_step=experts,
                generator_device=GENERATOR_DEVICE[device],
                seed=update,
                num_inference_steps=args.steps,
            )
            route = f", {_route(experts)}" if len(demo.experts) > 1 else ""
            per_expert = ", one per expert" if len(demo.experts) > 1 else ""
            _log(
                f"[{numerics}] update {update}: adapter pushed as {dtype}{per_expert}, "
                f"{args.steps}-step rollout checked ({time.monotonic() - t0:.1f} s"
                f"{route}): fingerprints={'equal' if verdict.ok else 'differ'} "
                f"policy_checksum={'equal' if same_policy else 'differs'}"
            )
            _log(f"[{numerics}] update {update}: fingerprints: {verdict.explain()}")
            if max_diff is not None:
                _log(
                    f"[{numerics}] update {update}: the same rollout with its debug "
                    f"tensors: model_output_max_abs_diff={max_diff!r} "
                    f"model_output_mean_abs_diff={mean_diff!r}"
                )
            results.append((max_diff, mean_diff, same_policy, verdict))
            step_diffs.append(steps)
            step_experts.append([experts[step] for step in sorted(experts)])
    finally:
        server.stop()
    _log(f"[{numerics}] server stopped")
    return results


def _table(parity: list[UpdateResult], default: list[UpdateResult]) -> str:
    rows = [
        (
            "update",
            "train_parity fingerprints",
            "policy checksum",
            "default fingerprints",
            "default max / mean (debug tensors)",
        )
    ]
    for update, (_, _, same_policy, verdict) in enumerate(parity, 1):
        other_fingerprints, other = "skipped", "skipped"
        if default:
            d_max, d_mean, _, d_verdict = default[update - 1]
            other_fingerprints = _fingerprint_cell(d_verdict)
            other = "-" if d_max is None else f"{d_max:.3e} / {d_mean:.3e}"
        rows.append(
            (
                str(update),
                _fingerprint_cell(verdict),
                "equal" if same_policy else "DIFFERS",
                other_fingerprints,
                other,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        " | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in rows
    )


def _fingerprint_cell(verdict: Verdict) -> str:
    if verdict.ok:
        return f"bitwise equal on {len(verdict.steps)} steps"
    bad = sum(not step.equal for step in verdict.steps)
    return f"differ on {bad} of {len(verdict.steps)} steps"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sglang-train-parity demo",
        description=(
            "End-to-end RL rollout check of --numerics train_parity: start the sglang "
            "diffusion server on a tiny local model (Qwen-Image, Qwen-Image 2.1, or a Wan "
            "text-to-video variant: --model-id) on the CPU, or the GPU with --device cuda, push a new "
            "random LoRA adapter per update (per expert) through "
            "/update_weights_from_tensor (fp32 masters or their bf16 copies), request a "
            "CFG rollout through /rollout/generate, recompute every step as the "
            "trainer does (diffusers + PEFT under CUDA's autocast policy: emulated on the CPU, "
            "real torch.autocast on the GPU) and check the rollout's per-step fingerprints "
            "against it. Then the same with --numerics default. Exit status 0 only if "
            "train_parity is bitwise equal on every step of every update and default is not."
        ),
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the servers and the trainer's recompute run: cpu (CUDA's autocast "
        "policy emulated) or cuda (real torch.autocast('cuda', bf16), diffusers "
        "_native_flash attention) (default: %(default)s)",
    )
    parser.add_argument(
        "--model-id",
        choices=DEMO_MODEL_IDS,
        default="Qwen-Image",
        help="the tiny model: Qwen-Image, Qwen-Image-2.1, or a Wan text-to-video variant (Wan2.2 A14B: two "
        "experts, each with its own adapter, switched inside the rollout) (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="the tiny pipeline's folder; built there (a few MB, seconds) unless it "
        f"already holds one (default: {default_model_dir('<model id in lower case>')})",
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
        "--push-dtypes",
        default=DEFAULT_PUSH_DTYPES,
        help="comma-separated dtypes (fp32: the trainer's masters, bf16: their bf16 "
        "copies) the adapters are sent as, cycled over the updates; the trainer always "
        "holds the fp32 masters (default: %(default)s, so fp32, bf16, fp32, ...). The Wan "
        "--numerics default server gets bf16 only: with fp32 adapters upstream's Wan LoRA "
        "forward fails",
    )
    parser.add_argument(
        "--skip-default",
        action="store_true",
        help="run only the train_parity server (no --numerics default comparison)",
    )
    parser.add_argument(
        "--port",
        type=int,
        help="server port (it also binds PORT+1; the two servers then run one after the "
        "other); default: a free one each",
    )
    parser.add_argument(
        "--server-site",
        type=Path,
        help="a folder holding a sitecustomize.py, put first on every server's PYTHONPATH "
        "(on a GPU machine without sgl_kernel: the repository's benchmark/demo_site); "
        "default: none on cuda, the CPU kernels' for the default server on cpu",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        metavar="ARG",
        help="an extra `sglang serve` argument for both servers (repeatable; "
        "--server-arg=--flag for one that starts with a dash)",
    )
    parser.add_argument(
        "--default-server-arg",
        action="append",
        metavar="ARG",
        help="an extra argument for the --numerics default server only (repeatable), "
        "e.g. --default-server-arg=--attention-backend --default-server-arg=torch_sdpa "
        "where sgl_kernel's flash attention is not installed",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="write the server logs there and keep them (default: a temporary folder, "
        "removed unless the demo fails)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        help="also write the results, versions and command as JSON to this file",
    )
    args = parser.parse_args(argv)
    if args.updates < 1 or args.steps < 1:
        parser.error("--updates and --steps must be at least 1")
    unknown = set(args.push_dtypes.split(",")) - set(PUSH_DTYPES)
    if unknown:
        parser.error(
            f"--push-dtypes: unknown {sorted(unknown)}, use {sorted(PUSH_DTYPES)}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    args.model_dir = args.model_dir or default_model_dir(args.model_id)
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of `sglang-train-parity demo`; exits with the demo's status."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv = list(argv)
    args.step_diffs = {}  # numerics -> per update, per step (max, mean), for --report
    args.step_experts = {}  # numerics -> per update, the expert of every step
    try:
        demo = _load_demo(args)
    except DemoError as e:
        print(f"sglang-train-parity demo: error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="sglang-train-parity-demo-"))

    def interrupted(signum: int, _frame: Any) -> None:
        # Stop here rather than raise KeyboardInterrupt: raised inside a finalizer, Python
        # ignores it, and the demo would run on.
        for process in list(_LIVE_SERVERS):
            _stop(process)
        _log("interrupted; the servers started are stopped")
        if args.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    keep_logs = True  # for a failure's post-mortem
    try:
        passed = _demo(args, demo, log_dir)
        keep_logs = not passed or args.log_dir is not None
    finally:
        if keep_logs:
            _log(f"server logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    sys.exit(0 if passed else 1)


def _versions(device: str) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0], "torch_cuda": torch.version.cuda}
    for package in ("torch", "diffusers", "peft", "transformers", "sglang"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name()
        found["cudnn"] = torch.backends.cudnn.version()
    return found


def _write_report(
    args: argparse.Namespace,
    demo: Demo,
    parity: list[UpdateResult],
    default: list[UpdateResult],
    passed: bool,
    default_error: str | None = None,
) -> None:
    def rows(results, numerics):
        steps = args.step_diffs.get(numerics, [])
        experts = args.step_experts.get(numerics, [])
        dtypes = _mode_push_dtypes(args, demo, numerics)
        return [
            dict(
                update=update,
                pushed_as=dtypes[update - 1],
                experts_by_step=experts[update - 1] if update <= len(experts) else None,
                model_output_max_abs_diff=max_diff,
                model_output_mean_abs_diff=mean_diff,
                policy_checksum_equal=same,
                fingerprints_equal=verdict.ok,
                fingerprints=verdict.explain(),
                per_step_max_mean_abs_diff=(
                    steps[update - 1] if update <= len(steps) else None
                ),
            )
            for update, (max_diff, mean_diff, same, verdict) in enumerate(results, 1)
        ]

    report = dict(
        command=["sglang-train-parity", "demo", *args.argv],
        model_id=args.model_id,
        experts=list(demo.experts),
        device=args.device,
        steps=args.steps,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        rollout_request={
            **demo.request,
            "num_inference_steps": args.steps,
            "generator_device": GENERATOR_DEVICE[args.device],
            "seed": "the update's number (1, 2, ...)",
        },
        trainer=dict(
            autocast=(
                "torch.autocast('cuda', bf16)"
                if args.device == "cuda"
                else "cuda_autocast('cpu') (CUDA's policy emulated)"
            ),
            attention_backend=("_native_flash" if args.device == "cuda" else "native"),
        ),
        server_args=args.server_arg or [],
        default_server_args=args.default_server_arg or [],
        versions=_versions(args.device),
        train_parity=rows(parity, "train_parity"),
        default=rows(default, "default"),
        default_error=default_error,
        passed=passed,
    )
    args.report.write_text(json.dumps(report, indent=1) + "\n")


def _load_demo(args: argparse.Namespace) -> Demo:
    """The demo of --model-id on its tiny model, built in --model-dir unless already there."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # diffusers' dtype and experimental-API notices, and the tiny model's save bars, would
    # drown the progress lines
    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()

    demo_class = demo_for(args.model_id)
    index = args.model_dir / "model_index.json"
    before = index.stat().st_mtime_ns if index.is_file() else None
    demo = demo_class(
        demo_class.build_tiny(args.model_id, args.model_dir), args.model_id
    )
    action = "reused" if index.stat().st_mtime_ns == before else "built"
    _log(f"the tiny {args.model_id} pipeline in {args.model_dir} ({action})")
    return demo


def _demo(
    args: argparse.Namespace, demo: Demo, log_dir: Path
) -> bool:
    # per expert, one adapter per update (its own seeds), then per update, every expert's
    per_expert = {
        expert: random_adapters(
            demo.model_dir,
            args.updates,
            args.lora_rank,
            args.lora_alpha,
            expert,
            first_seed=100 * index,
        )
        for index, expert in enumerate(demo.experts)
    }
    adapters = [
        {e: per_expert[e][u] for e in demo.experts} for u in range(args.updates)
    ]
    _log(
        f"{args.updates} random LoRA adapters (one per optimizer step"
        f"{', for each of ' + ' and '.join(demo.experts) if len(demo.experts) > 1 else ''}"
        f"): rank {args.lora_rank}, alpha {args.lora_alpha:g}, "
        f"{len(adapters[0][demo.experts[0]])} fp32 master tensors each (A and B of "
        f"{len(demo.family.lora_targets)} targets in every block), sent as "
        + ", ".join(_push_dtype_names(args))
    )
    default, default_error = [], None
    with ExitStack() as servers:
        parity_server = _start_server("train_parity", args, demo, log_dir, servers)
        # On the CPU the default server starts at once too: its start-up (mostly imports,
        # most of a tiny model's demo) runs on another core while train_parity's server
        # starts and serves. With --port (one port for both) or on a GPU, one at a time.
        default_server = None
        if not args.skip_default and args.device == "cpu" and args.port is None:
            default_server = _start_server("default", args, demo, log_dir, servers)
        parity = _run_mode(parity_server, args, demo, adapters)
        if not args.skip_default:
            try:
                if default_server is None:
                    default_server = _start_server(
                        "default", args, demo, log_dir, servers
                    )
                default = _run_mode(default_server, args, demo, adapters)
            except Exception as exc:  # noqa: BLE001 - reported, and the demo fails
                # train_parity's results still get their table and report
                default_error = f"{type(exc).__name__}: {exc}"
                _log(f"[default] FAILED: {default_error}")
    _log("\n" + _table(parity, default) + "\n")
    parity_exact = all(same and verdict.ok for _, _, same, verdict in parity)
    # caught by the fingerprints alone; the debug tensors show by how much
    default_differs = all(
        not verdict.ok and max_diff > 0.0 for max_diff, _, _, verdict in default
    )
    _log(
        "train_parity: "
        + (
            "bitwise equal to the trainer's recompute on every step of every update "
            "(fingerprints equal), serving the trainer's policy checksum"
            if parity_exact
            else "DIFFERS from the trainer's recompute or policy checksum"
        )
    )
    if default_error is not None:
        _log("default: FAILED (above); the comparison did not run")
    elif default:
        _log(
            "default: "
            + (
                "its fingerprints differ from the trainer's recompute, as expected "
                "(the debug tensors show by how much)"
                if default_differs
                else "UNEXPECTEDLY equal to the trainer's recompute"
            )
        )
    passed = parity_exact and default_differs and default_error is None
    if args.report is not None:
        _write_report(args, demo, parity, default, passed, default_error)
    return passed
