"""Inside the `sglang serve` processes of the GPU demo (`sglang-train-parity demo --device cuda
--server-site benchmark/demo_site`): what a GPU machine without sgl_kernel needs, and nothing more.

The H200 image cannot install sgl_kernel (no network, 370 MB). `install()`, run from
benchmark/demo_site/sitecustomize.py in every process of both servers and in the demo itself:

* installs the `sgl_kernel` stand-ins (benchmark/gpu_standins.py): imports work, every call raises
  `StandInCalled`, and every call is written to the log before it raises, so a call that some
  caller swallows is still on record;
* sets `SGLANG_CRASH_ON_JIT_COMPILE=1` unless the caller set it: sglang's nvcc-at-first-use JIT
  kernels are not built (a load raises; upstream's `can_use_*` predicates then choose their unfused
  branch);
* hooks `PipelineComponentLoader.load_component`. After a component is loaded:
  - **the DiT under `--numerics train_parity`: untouched.** The hook checks that no op of it
    carries a fallback and logs that it left it alone. The CFG combine, the scheduler and the
    denoising stage are never touched either: the harness wraps nothing outside loaded components.
  - every other module component (text encoder, VAE): each `CustomOp` (sglang.multimodal_gen) and
    `BaseFusedOp` (sglang.srt layers) runs the forward upstream dispatches to; when that forward
    fails *because a kernel is not installed here* (a stand-in was called, an import failed, a JIT
    build was refused) the layer moves, permanently, to upstream's own `forward_native`, and the
    move is logged (one record per layer). Any other exception propagates.
  - the DiT under `--numerics default`: `default_path.DefaultPathHarness`, the closest default path
    that runs here (docs/results.md, "The closest default path"), each move
    logged the same way.
* with JIT builds refused: Qwen-Image 2.1's VAE decoder fast paths (JIT kernels without a
  fallback of their own) are not installed, so upstream's plain decoder runs; logged.

Records go, one JSON object a line, to the file named by `SGLANG_TP_HARNESS_LOG` (when set) and
to the process's log (the server log). Nothing is registered: no torch op, no fake CUDA, no
replacement of any sglang forward; only upstream's own native forwards of the layers above.

CPU dry run only: with `SGLANG_TP_HARNESS_CPU_KERNELS=1` the three CPU sgl_kernel ops upstream's
default CPU path needs are registered too (sglang_train_parity.cpu_kernels), as the demo does on CPU.
"""

from __future__ import annotations

import importlib.abc
import json
import logging
import os
import sys
import threading
import time

from benchmark import default_path, gpu_standins

LOG_ENV = "SGLANG_TP_HARNESS_LOG"
CPU_KERNELS_ENV = "SGLANG_TP_HARNESS_CPU_KERNELS"
COMPONENT_LOADER = (
    "sglang.multimodal_gen.runtime.loader.component_loaders.component_loader"
)
QWEN21_VAE_FAST_PATHS = "sglang.multimodal_gen.runtime.models.vaes.qwen_image21_vae_cuda_opt"
# the pipeline's DiTs: Wan2.2 A14B has a second expert
DIT_COMPONENTS = ("transformer", "transformer_2")

_logger = logging.getLogger("sglang_tp_harness")
_lock = threading.Lock()
_state: dict = {"numerics": None}


def _numerics_from_argv() -> str | None:
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == "--numerics" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--numerics="):
            return arg.split("=", 1)[1]
    return None


def record(event: str, **fields) -> None:
    """One harness record: to $SGLANG_TP_HARNESS_LOG (JSON lines) and to the process's log."""
    entry = {
        "event": event,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "numerics": _state["numerics"] or _numerics_from_argv(),
        "time": round(time.time(), 3),
        **fields,
    }
    line = json.dumps(entry, sort_keys=True, default=str)
    path = os.environ.get(LOG_ENV)
    if path:
        with _lock, open(path, "a") as f:
            f.write(line + "\n")
    print(f"[server_harness] {line}", file=sys.stderr, flush=True)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `hook(module)` right after the module `name` is executed (first import)."""

    def __init__(self, name: str, hook) -> None:
        self.name, self.hook, self._busy = name, hook, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy = False
        if spec.loader is None:
            return spec
        loader, hook = spec.loader, self.hook

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                hook(module)

        spec.loader = _Loader()
        return spec


def install() -> None:
    """Stand-ins, JIT policy and the component-loader hook, in this process (idempotent)."""
    if _state.get("installed"):
        return
    _state["installed"] = True
    gpu_standins.install()
    gpu_standins.on_call(lambda name: record("standin_called", standin=name))
    os.environ.setdefault("SGLANG_CRASH_ON_JIT_COMPILE", "1")
    if os.environ.get(CPU_KERNELS_ENV) == "1":
        from sglang_train_parity.cpu_kernels import register_cpu_kernels

        register_cpu_kernels()
    sys.meta_path.insert(0, _AfterImport(COMPONENT_LOADER, _patch_component_loader))
    if os.environ["SGLANG_CRASH_ON_JIT_COMPILE"] == "1":
        sys.meta_path.insert(0, _AfterImport(QWEN21_VAE_FAST_PATHS, _skip_vae_fast_paths))


def _skip_vae_fast_paths(module) -> None:
    def plain_decoder(vae):
        record(
            "fallback",
            component="vae",
            op="maybe_optimize_qwen_image21_vae",
            error="its fast paths are JIT kernels without a fallback; JIT builds refused",
            to="upstream's plain decoder",
        )
        return vae

    module.maybe_optimize_qwen_image21_vae = plain_decoder


def _patch_component_loader(module) -> None:
    loader_cls = module.PipelineComponentLoader
    original = loader_cls.load_component

    def load_component(component_name, component_model_path, *args, **kwargs):
        result = original(component_name, component_model_path, *args, **kwargs)
        server_args = kwargs.get("server_args")
        if server_args is None and len(args) >= 2:
            server_args = args[1]
        numerics = getattr(server_args, "numerics", None)
        _state["numerics"] = numerics
        component = result[0] if isinstance(result, tuple) else result
        after_load(component_name, component, numerics)
        return result

    loader_cls.load_component = staticmethod(load_component)
    record(
        "installed",
        hooked=f"{COMPONENT_LOADER}.PipelineComponentLoader.load_component",
        crash_on_jit_compile=os.environ.get("SGLANG_CRASH_ON_JIT_COMPILE"),
        cpu_kernels=os.environ.get(CPU_KERNELS_ENV) == "1",
    )


def _ops(model):
    """(name, module) of every CustomOp / BaseFusedOp in `model`."""
    from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp

    bases: tuple[type, ...] = (CustomOp,)
    try:
        from sglang.kernels.fused_op import BaseFusedOp

        bases += (BaseFusedOp,)
    except ImportError:
        pass
    return [(n, m) for n, m in model.named_modules() if isinstance(m, bases)]


def after_load(component_name: str, component, numerics: str | None) -> None:
    import torch

    if not isinstance(component, torch.nn.Module):
        return
    ops = _ops(component)
    if component_name in DIT_COMPONENTS and numerics == "train_parity":
        wrapped = [
            n
            for n, m in ops
            if "fallback_native" in getattr(m._forward_method, "__name__", "")
        ]
        if wrapped:
            raise RuntimeError(f"the train_parity DiT carries fallbacks: {wrapped}")
        record(
            "untouched",
            component=component_name,
            cls=type(component).__name__,
            ops=len(ops),
            why="train_parity DiT: its forwards run as the server built them",
        )
        return
    harness = LoggedHarness(component_name)
    if component_name in DIT_COMPONENTS:
        harness.install(component, sys.modules[type(component).__module__])
        how = "DefaultPathHarness (closest default path that runs here)"
    else:
        for name, op in ops:
            if getattr(op, "_forward_method", None) is None and hasattr(
                op, "_resolve_forward_method"
            ):
                # srt ops resolve their forward at the first call; resolve it now to wrap it
                op._forward_method = op._resolve_forward_method()
            harness._wrap_op(name, op)
        how = "forward_native where a kernel is missing"
    record(
        "watched",
        component=component_name,
        cls=type(component).__name__,
        ops=len(ops),
        how=how,
    )


class LoggedHarness(default_path.DefaultPathHarness):
    """default_path.DefaultPathHarness whose every move is recorded as it happens."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def _log(self, op, method, exc, module, fallback):
        super()._log(op, method, exc, module, fallback)
        record(
            "fallback",
            component=self.component,
            module=module,
            op=op,
            method=method,
            error=default_path._summary(exc),
            to=fallback,
        )
