"""numerics="default": the closest default path that runs on a machine without upstream's
CUDA-only kernels (sgl_kernel's FA3 and rmsnorm, the CuTe DSL norms, flashinfer, nvcc-built JIT
kernels). `DefaultPathHarness` runs upstream's default forwards unchanged and moves a layer to
upstream's own next path only where its forward fails because a kernel is unavailable, recording
every move; used by benchmark/gpu_parity.py, benchmark/speed.py and benchmark/server_harness.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the server harness's sitecustomize appends it instead
    sys.path.insert(0, str(REPO))

from benchmark import gpu_standins  # noqa: E402

# Upstream's default quality tier for a request (pipelines_core/stages/denoising.py mounts its
# fusions per batch); a direct DiT call gets whatever is mounted, so the harness mounts it.
DEFAULT_REQUEST_QUALITY = "lossless"


def _unavailable(exc: BaseException) -> bool:
    """A kernel that is not installed here (stand-in call, missing package, JIT build forbidden),
    anywhere in the exception chain (torch.compile wraps exceptions)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if (
            isinstance(exc, (gpu_standins.StandInCalled, ImportError))
            or "stand-in " in text
            or "SGLANG_CRASH_ON_JIT_COMPILE" in text
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


class DefaultPathHarness:
    """Runs upstream's default-numerics DiT with every op whose kernel is not installed here
    replaced by the closest upstream path, and records each replacement.

    * CustomOp layers (norms, modulation, MulAdd, RoPE, ...): the forward chosen at construction
      (`forward_cuda`) runs; if it fails *because a kernel is unavailable* (a stand-in was called,
      an import failed, a JIT build was refused) the layer switches permanently to upstream's
      `forward_native` (torch.compile'd upstream where upstream compiles it) and the switch is
      logged. Any other exception propagates.
    * `try_fused_*` helpers of the Qwen DiT module: on the same condition they return None, which
      is their documented "not supported here" answer (the caller keeps its unfused path); so do
      the `can_use_*` predicates the Wan DiT module reads from `diffusion_kernels` (None is
      falsy: the caller keeps its unfused path).
    * quality: the request default tier (`lossless`) is mounted as the denoising stage would.
    * JIT kernels: with jit=off the build is refused and upstream's can_use_* predicates already
      pick their unfused branch; the harness only records that the policy was on. Where a DiT
      module (Qwen-Image 2.1's) imports a JIT kernel whose predicate does not check that it can
      be built, the module's `can_use_*_cuda` predicates answer False and its `JIT_EAGER` kernels
      are replaced by the eager formula their own unsupported-layout branch computes; each
      replacement is recorded.
    """

    # JIT kernels a DiT module calls without a fallback of its own -> upstream's eager branch
    JIT_EAGER = {
        "residual_gate_add": lambda residual, update, gate: residual + update * gate
    }

    def __init__(self) -> None:
        self.fallbacks: dict[tuple[str, str, str], dict] = {}

    def _log(
        self, op: str, method: str, exc: BaseException, module: str, fallback: str
    ):
        key = (op, method, _summary(exc))
        entry = self.fallbacks.setdefault(
            key,
            {
                "op": op,
                "method": method,
                "error": key[2],
                "fallback": fallback,
                "instances": 0,
                "first_module": module,
            },
        )
        entry["instances"] += 1

    def install(self, model, dit_module) -> None:
        from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp

        for name, module in model.named_modules():
            if isinstance(module, CustomOp):
                self._wrap_op(name, module)
        for attr in dir(dit_module):
            if attr.startswith("try_fused") and callable(getattr(dit_module, attr)):
                setattr(
                    dit_module, attr, self._wrap_try(attr, getattr(dit_module, attr))
                )
        kernels = getattr(dit_module, "diffusion_kernels", None)
        if kernels is not None:
            dit_module.diffusion_kernels = _KernelsWithGuardedPredicates(kernels, self)
        if os.environ.get("SGLANG_CRASH_ON_JIT_COMPILE") == "1":
            self._skip_jit_kernels(dit_module)

    def _skip_jit_kernels(self, dit_module) -> None:
        refused = RuntimeError("JIT builds refused (SGLANG_CRASH_ON_JIT_COMPILE=1)")
        for attr in dir(dit_module):
            if attr.startswith("can_use_") and attr.endswith("_cuda"):
                setattr(dit_module, attr, lambda *args, **kwargs: False)
                self._log(attr, attr, refused, "", "False (caller's unfused path)")
        for attr, eager in self.JIT_EAGER.items():
            if callable(getattr(dit_module, attr, None)):
                setattr(dit_module, attr, eager)
                self._log(attr, attr, refused, "", "the kernel's eager formula")

    def _wrap_op(self, name: str, module) -> None:
        original = module._forward_method
        method = getattr(original, "__name__", str(original))
        if method in ("forward_train_parity", "forward_native"):
            return
        state = {"native": False}
        harness = self

        def forward(*args, **kwargs):
            if state["native"]:
                return module.forward_native(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            except (
                Exception
            ) as exc:  # noqa: BLE001 - re-raised unless a kernel is missing
                if not _unavailable(exc):
                    raise
                harness._log(type(module).__name__, method, exc, name, "forward_native")
                state["native"] = True
                return module.forward_native(*args, **kwargs)

        forward.__name__ = f"{method}|fallback_native"
        module._forward_method = forward

    def _wrap_try(self, attr: str, fn):
        harness = self
        state = {"unavailable": False}

        def wrapped(*args, **kwargs):
            # once unavailable, always: answer "not supported" without retrying the kernel load
            # (a refused JIT build recomputes its build key on every call: pure CPU overhead)
            if state["unavailable"]:
                return None
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                if not _unavailable(exc):
                    raise
                harness._log(
                    attr,
                    attr,
                    exc,
                    "",
                    "None (caller's unfused path), then short-circuited",
                )
                state["unavailable"] = True
                return None

        wrapped.__name__ = attr
        return wrapped

    def report(self) -> list[dict]:
        return list(self.fallbacks.values())


class _KernelsWithGuardedPredicates:
    """`sglang.kernels.ops.diffusion` with each `can_use_*` predicate guarded by the harness."""

    def __init__(self, kernels, harness: DefaultPathHarness) -> None:
        self._kernels, self._harness = kernels, harness

    def __getattr__(self, name: str):
        if not name.startswith("can_use_"):
            return getattr(self._kernels, name)

        def predicate(*args, **kwargs):
            # resolved on the call: resolving loads the kernel's module, which may be missing
            return getattr(self._kernels, name)(*args, **kwargs)

        guarded = self._harness._wrap_try(name, predicate)
        setattr(self, name, guarded)
        return guarded


def mount_default_quality(model, quality: str = DEFAULT_REQUEST_QUALITY) -> None:
    from sglang.multimodal_gen.runtime.pipelines_core.stages.denoising import (
        toggle_quality_fusions,
    )

    toggle_quality_fusions([model], quality)


def probe_default_attention(device: str) -> dict:
    """What upstream's default attention backend on this GPU (FA, sgl_kernel's FA3) does here."""
    import torch

    result: dict[str, Any] = {
        "backend": "FA (flash_attn_varlen_func, FA3 via sgl_kernel)"
    }
    if device != "cuda":
        result["probe"] = "skipped (cpu)"
        return result
    try:
        from sglang.kernels.ops.attention.flash_attention import flash_attn_varlen_func

        q = torch.randn(16, 2, 128, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 16], device="cuda", dtype=torch.int32)
        flash_attn_varlen_func(
            q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16
        )
        result["probe"] = "ran"
    except Exception as exc:  # noqa: BLE001
        result["probe"] = _summary(exc)
        result["unavailable"] = _unavailable(exc)
    return result
