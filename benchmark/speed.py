"""Per-denoising-step latency of the full Qwen-Image DiT (60 blocks, 1024x1024 image = 4096 image
tokens, batch 1, CFG as two forwards, LoRA r64 unmerged on all 12 targets of every block):

* `train_parity`: the fork, numerics="train_parity" (attention torch_sdpa, LoRA dynamic), loaded
  through sglang's real transformer loader (weights generated on the device and fed through the
  loader's own `weights_iterator` argument: a 41 GB checkpoint would not fit the lease);
* `default`: the fork with upstream's numerics, the closest default path that runs on this machine
  (benchmark/gpu_common.DefaultPathHarness: every fallback is recorded), request quality "lossless"
  mounted, LoRA unmerged (dynamic, bf16 A/B), attention torch_sdpa (FA3 needs sgl_kernel);
* `diffusers`: plain eager diffusers + PEFT under torch.autocast("cuda", bf16), `_native_flash`.

One process, the variants one after another (each ~41 GB of weights; the first variant's model was
seen to stay resident after it was dropped, so later variants record `leftover_gib_before_build`).
Per variant: median / p10 / p90 of `--steps` timed steps after `--warmup` steps (CUDA events), peak
GPU memory, then one profiled step (torch.profiler) broken down by kernel family and by module class.
`train_parity_eager` also gets a floor replay (`floor_replay`): its step's GEMM and attention calls
alone, replayed as one CUDA graph per step, which every train_parity variant is compared with.

    python benchmark/speed.py [--device cuda|cpu] [--tiny] [--layers 60] [--steps 20] [--out PATH]

`--family qwen-image-2.1`: the same for Qwen-Image 2.1's DiT (32 blocks, 1024x1024 = 4096 target
tokens after the 211- / 77-token prompt, LoRA r64 on the seven projections of every block); its
default variant caches the prompt's K/V after the first step, as it does within a request, and its
diffusers variant runs the native attention backend with no KV cache, as the trainer does.

`--family ltx-2`: the same for LTX-2 (19B)'s DiT (48 blocks, 121 frames at 512x768 = 6144 video
tokens + 126 audio tokens, 1024 text tokens, one unguided forward per step as miles trains it, LoRA
r64 on miles' targets): train_parity runs both streams without the audio-video cross-attention,
the default variant as the default server calls it (cross-attention on, the prompt K/V projected
once), the `ltx-core` variant is the trainer's forward (ltx-core + PEFT under autocast, SDPA math,
the video stream alone).

`--family wan`: the same for Wan2.1-T2V-14B's DiT (40 blocks, 81 frames at 480x832 = 32760 video
tokens, T5 text zero-padded to 512 tokens, LoRA r64 on self-/cross-attention and FFN), the default
variant with Wan's fused q/k norm-RoPE predicate guarded by the harness. The variants share their
weights and LoRA (same generator draws), so one CFG step's outputs are also compared bitwise.
"""

from __future__ import annotations

import argparse
import gc
import math
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark import gpu_common, gpu_standins  # noqa: E402

LORA_RANK, LORA_ALPHA = 64, 128
CFG_SCALE = 4.0
TXT_LEN = {"cond": 211, "uncond": 77}
TXT_LEN_TINY = {"cond": 13, "uncond": 7}
# Wan: T5 tokens before the zero padding to 512
WAN_TEXT_LEN = {"cond": 35, "uncond": 120}
WAN_CLIP, WAN_CLIP_TINY = (81, 480, 832), (5, 48, 64)
FAMILY_SPECS = {
    "qwen-image": {
        "model_cls": "QwenImageTransformer2DModel",
        "targets": None,  # filled in main (sglang_train_parity.reference.LORA_TARGETS)
        "default_layers": 60,
    },
    "qwen-image-2.1": {
        "model_cls": "QwenImage21Transformer2DModel",
        "targets": None,  # sglang_train_parity.qwen_image21.LORA_TARGETS
        "default_layers": 32,
        "model_id": "Qwen-Image-2.1",
        "model_index": {
            "_class_name": "QwenImage21Pipeline",
            "_diffusers_version": "0.42.1",
            "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
        },
    },
    "ltx-2": {
        "model_cls": "LTX2VideoTransformer3DModel",
        "targets": None,  # sglang_train_parity.ltx2.LORA_TARGETS
        "default_layers": 48,
        "model_id": "LTX-2",
        "model_index": {
            "_class_name": "LTX2Pipeline",
            "_diffusers_version": "0.42.1",
            "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
        },
    },
    "wan": {
        "model_cls": "WanTransformer3DModel",
        "targets": None,  # sglang_train_parity.wan.LORA_TARGETS
        "default_layers": 40,
        "model_id": "Wan2.1-T2V-14B-Diffusers",
        "model_index": {
            "_class_name": "WanPipeline",
            "_diffusers_version": "0.42.1",
            "transformer": ["diffusers", "WanTransformer3DModel"],
        },
    },
}

# kernel name -> family (first match wins)
KERNEL_FAMILIES = (
    # train_parity's LoRA-B GEMM with its scale-and-add epilogue (outside the floor)
    ("LoRA-B GEMM + epilogue", r"lora_b_scale_add"),
    ("attention (flash/sdpa)", r"flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|sm90_xmma|xmma|cublas|matmul|splitK|s16816|wgmma"),
    ("triton (compiled/fused)", r"^triton_|triton"),
    ("layer_norm", r"layer_norm|LayerNorm"),
    ("reduce (rms/mean/norm)", r"reduce_kernel|norm_kernel|Reduce"),
    (
        "cat/copy/cast",
        r"CatArray|copy_kernel|direct_copy|Memcpy|memcpy|contiguous|cast",
    ),
    ("elementwise", r"elementwise|vectorized|unrolled|Functor|mul|add"),
)
ANNOTATED_CLASSES = (
    "BaseLayerWithLoRA",
    "RMSNorm",
    "LayerNormScaleShift",
    "ScaleResidualLayerNormScaleShift",
    "MulAdd",
    "QwenImageCrossAttention",
    "QwenImageFeedForward",
    # diffusers / PEFT
    "LoraLayer",
    "Attention",
    "FeedForward",
    "LayerNorm",
)


def family(name: str) -> str:
    for fam, pattern in KERNEL_FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def gpu_lora_state(
    config: dict,
    rank: int,
    alpha: float,
    device,
    seed: int = 0,
    family: str = "qwen-image",
) -> dict:
    """train_parity.reference.random_lora_state's distribution, generated on the device."""
    import diffusers
    import torch
    from sglang_train_parity.reference import _LORA_DELTA_GAIN, is_lora_target
    from torch import nn

    spec = FAMILY_SPECS[family]
    with torch.device("meta"):
        meta = getattr(diffusers, spec["model_cls"])(**config)
    g = torch.Generator(device=device).manual_seed(seed)
    scaling = alpha / rank
    state = {}
    for name, module in meta.named_modules():
        if is_lora_target(name, spec["targets"]) and isinstance(module, nn.Linear):
            a = torch.randn(rank, module.in_features, generator=g, device=device)
            b = torch.randn(module.out_features, rank, generator=g, device=device)
            state[f"{name}.lora_A.weight"] = a / math.sqrt(module.in_features)
            state[f"{name}.lora_B.weight"] = b * (_LORA_DELTA_GAIN / (rank * scaling))
    return state


def make_inputs(config: dict, grid: tuple[int, int], txt: dict, device, batch: int = 1):
    import torch

    g = torch.Generator(device=device).manual_seed(7)
    h, w = grid
    latents = torch.randn(
        batch, h * w, config["in_channels"], generator=g, device=device
    )
    text = {
        k: torch.randn(
            batch, n, config["joint_attention_dim"], generator=g, device=device
        ).bfloat16()
        for k, n in txt.items()
    }
    return latents, text, [[(1, h, w)]] * batch


class Annotator:
    """record_function ranges around modules of the classes in ANNOTATED_CLASSES (by MRO name), so
    the profile can attribute device time per module class."""

    def __init__(self, model):
        import torch

        self.handles = []
        self.stack = []
        for _, module in model.named_modules():
            names = [c.__name__ for c in type(module).__mro__]
            match = next((c for c in ANNOTATED_CLASSES if c in names), None)
            if match is None:
                continue
            label = f"mod::{match}"

            def pre(mod, args, label=label):
                rf = torch.profiler.record_function(label)
                rf.__enter__()
                self.stack.append(rf)

            def post(mod, args, out):
                self.stack.pop().__exit__(None, None, None)

            self.handles.append(module.register_forward_pre_hook(pre))
            self.handles.append(module.register_forward_hook(post))

    def remove(self):
        for h in self.handles:
            h.remove()


def profile_step(step_fn, model, device: str, annotate: bool = True) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return {"skipped": "cpu"}
    annot = Annotator(model if annotate else torch.nn.Module())
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            _, clocks = clocks_while(lambda: (step_fn(0), torch.cuda.synchronize()))
            profiled_wall_ms = (time.perf_counter() - t0) * 1e3
    finally:
        annot.remove()
    timeline = device_timeline(prof.events())
    events = prof.key_averages()
    fams: dict = defaultdict(float)
    kernels = []
    modules = {}
    aten = []
    cpu_rows = []
    total = 0.0
    for e in events:
        dev_self = getattr(e, "self_device_time_total", None)
        if dev_self is None:
            dev_self = getattr(e, "self_cuda_time_total", 0.0)
        dev_total = getattr(e, "device_time_total", None)
        if dev_total is None:
            dev_total = getattr(e, "cuda_time_total", 0.0)
        is_kernel = str(getattr(e, "device_type", "")).endswith("CUDA")
        if e.key.startswith("mod::") and is_kernel:
            continue  # the GPU-side copy of a record_function range, not a kernel
        cpu_rows.append((getattr(e, "self_cpu_time_total", 0.0), e.count, e.key))
        if is_kernel and dev_self > 0:
            fams[family(e.key)] += dev_self
            total += dev_self
            kernels.append((dev_self, e.count, e.key))
        elif e.key.startswith("mod::"):
            modules[e.key[5:]] = {
                "device_ms": round(dev_total / 1e3, 3),
                "calls": e.count,
            }
        elif e.key.startswith("aten::") and dev_total > 0:
            aten.append((dev_total, e.count, e.key))
    kernels.sort(reverse=True)
    aten.sort(reverse=True)
    cpu_rows.sort(reverse=True)
    return {
        "profiled_step_wall_ms": round(profiled_wall_ms, 1),
        "gpu_clocks": clocks,
        "kernel_time_ms": round(total / 1e3, 3),
        "families_ms": {
            k: round(v / 1e3, 3) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])
        },
        "families_share": (
            {
                k: round(v / total, 4)
                for k, v in sorted(fams.items(), key=lambda kv: -kv[1])
            }
            if total
            else {}
        ),
        "top_kernels": [
            {"ms": round(t / 1e3, 3), "calls": c, "family": family(k), "name": k[:160]}
            for t, c, k in kernels[:25]
        ],
        "top_aten_ops_inclusive": [
            {"ms": round(t / 1e3, 3), "calls": c, "op": k} for t, c, k in aten[:25]
        ],
        "module_classes_inclusive": modules,
        "top_cpu_self_ms": [
            {"ms": round(t / 1e3, 3), "calls": c, "name": k[:120]}
            for t, c, k in cpu_rows[:20]
        ],
        "kernel_launches": sum(c for _, c, _ in kernels),
        # what the contract's arithmetic cannot avoid: its GEMMs and attention
        "contract_floor_ms": round(
            (fams.get("gemm", 0.0) + fams.get("attention (flash/sdpa)", 0.0)) / 1e3, 3
        ),
        "device_timeline": timeline,
        "note": "one CFG step (two forwards); families from kernel names; module classes inclusive of their children",
    }


def device_timeline(events, top: int = 8) -> dict:
    """Where the profiled step's wall time goes besides kernels: the span from the
    first host op to the last device activity, the device's idle time inside
    its own span (gaps between kernels), the time before its first activity
    (host work, graph launch) and the largest gaps with their neighbours."""
    device, host_starts, by_stream = [], [], {}
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            if end > start and not e.key.startswith("mod::"):
                device.append((start, end, e.key))
                by_stream.setdefault(getattr(e, "device_resource_id", None), []).append(
                    (start, end, e.key)
                )
        else:
            host_starts.append(start)
    if not device:
        return {}
    device.sort()
    gaps, busy_end = [], device[0][1]
    for (_, _, prev), (start, end, name) in zip(device, device[1:]):
        if start > busy_end:
            gaps.append((start - busy_end, prev, name))
        busy_end = max(busy_end, end)
    gaps.sort(reverse=True)
    idle = sum(g for g, _, _ in gaps)
    first = device[0][0]
    return {
        "host_lead_ms": round((first - min(host_starts, default=first)) / 1e3, 3),
        "device_span_ms": round((busy_end - first) / 1e3, 3),
        "device_idle_in_span_ms": round(idle / 1e3, 3),
        "gaps": len(gaps),
        "gaps_over_10us_ms": round(sum(g for g, _, _ in gaps if g > 10) / 1e3, 3),
        "largest_gaps": [
            {"us": round(g, 1), "after": a[:80], "before": b[:80]}
            for g, a, b in gaps[:top]
        ],
        "streams": [stream_busy(str(s), k) for s, k in by_stream.items()],
    }


def stream_busy(stream: str, kernels: list[tuple], top: int = 10) -> dict:
    """One stream's busy time (kernels may overlap other streams', not their own) and
    its kernels by total time: with a second stream, what the first one's critical path
    is made of."""
    per_name: dict[str, list[float]] = {}
    for start, end, name in kernels:
        entry = per_name.setdefault(name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {
        "stream": stream,
        "busy_ms": round(sum(end - start for start, end, _ in kernels) / 1e3, 3),
        "kernels": len(kernels),
        "top": [
            {"ms": round(us / 1e3, 3), "calls": n, "name": name[:90]}
            for name, (us, n) in ranked[:top]
        ],
    }


def time_steps(step_fn, warmup: int, steps: int, device: str) -> list[float]:
    import torch

    for i in range(warmup):
        step_fn(i)
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for i in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True
            )
            start.record()
            step_fn(warmup + i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step_fn(warmup + i)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_pipelined(step_fn, first: int, steps: int) -> float:
    """The mean step time of ``steps`` CUDA steps issued back to back, the device
    waited for once at the end, as a denoising loop that does not wait between steps
    runs them: each step's host work overlaps the previous step's kernels."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True
    )
    start.record()
    for i in range(steps):
        step_fn(first + i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


class GpuClocks:
    """``nvidia-smi``'s SM clock and power draw every 100 ms while the script runs,
    so that each timing says at which clocks it ran: a power-capped GPU clocks
    lower under denser work, and the floor comes from another variant's profile."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.proc = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=timestamp,clocks.sm,power.draw",
                "--format=csv,noheader,nounits",
                "-lms",
                "100",
                "-i",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                stamp, mhz, watts = (f.strip() for f in line.split(","))
                when = time.mktime(time.strptime(stamp[:19], "%Y/%m/%d %H:%M:%S"))
                when += float("0" + stamp[19:])
                self.samples.append((when, float(mhz), float(watts)))
            except ValueError:
                continue

    def window(self, start: float, end: float) -> dict | None:
        """Median SM clock (MHz) and power (W) of the samples from ``start`` to
        ``end`` (``time.time()``)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return None
        return {
            "sm_mhz": statistics.median(s[1] for s in inside),
            "power_w": round(statistics.median(s[2] for s in inside), 1),
            "samples": len(inside),
        }

    def stop(self) -> None:
        self.proc.terminate()


# set by main() on CUDA where nvidia-smi runs
CLOCKS: GpuClocks | None = None


def clocks_while(fn):
    """``fn()`` and the GPU clocks while it ran (None without a sampler)."""
    start = time.time()
    result = fn()
    return result, CLOCKS.window(start, time.time()) if CLOCKS else None


def timed(step, args) -> dict:
    """``args.rounds`` timed runs of ``args.steps`` steps (the first after ``args.warmup``
    warm-up steps, the others after one), each step waited for: the median, p10 and p90
    over all steps and each run's median. On CUDA also, per round, the mean step of
    ``args.steps`` steps issued without waiting in between (``time_pipelined``)."""
    # the warm-up (a graph capture's host time among it) outside the clocks' window
    time_steps(step, args.warmup, 0, args.device)
    rounds, clocks = clocks_while(
        lambda: [
            time_steps(step, 0 if r == 0 else 1, args.steps, args.device)
            for r in range(args.rounds)
        ]
    )
    times = [t for run in rounds for t in run]
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    entry = {
        "step_ms_median": round(statistics.median(times), 2),
        "step_ms_p10": round(q[0], 2),
        "step_ms_p90": round(q[-1], 2),
        "round_medians_ms": [round(statistics.median(run), 2) for run in rounds],
        "step_ms_all": [round(t, 2) for t in times],
        "gpu_clocks": clocks,
    }
    if args.device == "cuda":
        pipelined, clocks = clocks_while(
            lambda: [time_pipelined(step, 0, args.steps) for _ in range(args.rounds)]
        )
        entry["pipelined_gpu_clocks"] = clocks
        entry["pipelined_step_ms_median"] = round(statistics.median(pipelined), 2)
        entry["pipelined_round_means_ms"] = [round(t, 2) for t in pipelined]
    return entry


@dataclass(frozen=True)
class TensorSpec:
    size: tuple
    stride: tuple
    dtype: object


def record_floor_ops(step_fn, model) -> tuple[list[tuple], dict]:
    """The aten GEMM and attention calls of one step, the ops whose kernels make the
    contract floor (KERNEL_FAMILIES' "gemm" and "attention"), in issue order: (op, args,
    kwargs) with each tensor argument either the model's own (a weight, or a view of one)
    or a `TensorSpec`; and, per spec, a copy of the first tensor the step passed with it."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    aten = torch.ops.aten
    floor_ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,  # --device cpu
    }
    own = {
        t.untyped_storage().data_ptr()
        for t in (*model.parameters(), *model.buffers())
    }
    examples: dict = {}

    def spec(a):
        if not isinstance(a, torch.Tensor) or a.untyped_storage().data_ptr() in own:
            return a
        key = TensorSpec(tuple(a.shape), a.stride(), a.dtype)
        if key not in examples:
            examples[key] = torch.empty_strided(
                a.shape, a.stride(), dtype=a.dtype, device=a.device
            ).copy_(a)
        return key

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in floor_ops:
                calls.append((func, tree_map(spec, args), tree_map(spec, kwargs)))
            return func(*args, **kwargs)

    with Record():
        step_fn(0)
    return calls, examples


def floor_replay(step_fn, model, args) -> dict:
    """The contract floor run as a step would run it: ``record_floor_ops``' calls alone
    (each activation argument the step's first of its shape, stride and dtype), replayed
    as one CUDA graph per step, waited for and back to back as ``timed`` runs steps; and
    its kernel time. The profile's floor sums these kernels as they ran between the step's
    other kernels, at that step's SM clock; a GPU held at its power limit clocks lower
    under a denser stream of GEMMs, so this is the floor at the clocks a step of nothing
    else gets. On the CPU the calls run eagerly (a dry run of the recording)."""
    import torch
    from torch.utils._pytree import tree_map

    calls, examples = record_floor_ops(step_fn, model)

    def fill(a):
        return examples[a] if isinstance(a, TensorSpec) else a

    calls = [(op, tree_map(fill, a), tree_map(fill, k)) for op, a, k in calls]

    def run(_=None):
        for op, a, k in calls:
            op(*a, **k)

    replay = run
    if args.device == "cuda":
        graph = gpu_common.captured(run)
        replay = lambda _=None: graph.replay()  # noqa: E731
    profile = profile_step(replay, torch.nn.Module(), args.device, annotate=False)
    return {
        "ops": len(calls),
        "distinct_activation_inputs": len(examples),
        **timed(replay, args),
        "profile": {
            k: profile.get(k)
            for k in ("gpu_clocks", "kernel_time_ms", "families_ms", "contract_floor_ms")
        },
    }


def add_floor_ratio(entry: dict, floor_entry: dict | None = None) -> None:
    """The median step over the contract floor of ``floor_entry``'s profile (default:
    the entry's own), where both exist; and, waited for and back to back, over its
    floor replay, where it has one."""
    floor = ((floor_entry or entry).get("profile") or {}).get("contract_floor_ms")
    if floor and entry.get("step_ms_median"):
        entry["contract_floor_ms"] = floor
        entry["wall_over_contract_floor"] = round(entry["step_ms_median"] / floor, 3)
        if entry.get("pipelined_step_ms_median"):
            entry["pipelined_over_contract_floor"] = round(
                entry["pipelined_step_ms_median"] / floor, 3
            )
    replayed = (floor_entry or entry).get("floor_replay") or {}
    for key in ("step_ms_median", "pipelined_step_ms_median"):
        if replayed.get(key) and entry.get(key):
            entry[f"{key}_over_floor_replay"] = round(entry[key] / replayed[key], 3)


def add_floor_ratios(variants: dict) -> None:
    """Every variant's and extra shape's wall / contract floor. The fused train_parity
    variants run the LoRA-B GEMMs inside a fused kernel, so their floor is the one
    measured where cuBLAS runs every GEMM: train_parity_eager's, when it ran."""
    eager = variants.get("train_parity_eager") or {}
    for name, entry in variants.items():
        floor_entry = eager if name.startswith("train_parity") and eager else entry
        add_floor_ratio(entry, floor_entry)
        for shape, shape_entry in (entry.get("extra_shapes") or {}).items():
            eager_shape = (floor_entry.get("extra_shapes") or {}).get(shape)
            add_floor_ratio(shape_entry, eager_shape)


def timesteps_for(n: int, device):
    import torch

    # a scheduler's descending fp32 timesteps on sglang's 0..1000 scale, one tensor per step
    return [torch.tensor([1000.0 * (1 - i / (n + 1))], device=device) for i in range(n)]


def build_fork(
    numerics: str,
    config: dict,
    model_dir: Path,
    device: str,
    harness=None,
    family: str = "qwen-image",
):
    import importlib

    import torch
    from sglang_train_parity.sglang_dit import push_lora, wrap_linears_for_lora

    spec = FAMILY_SPECS[family]
    kwargs = {"numerics": numerics}
    if "model_id" in spec:
        kwargs["model_id"] = spec["model_id"]
    if numerics == "default" and device == "cuda":
        kwargs["attention_backend"] = "torch_sdpa"
    with gpu_common.generated_weights(config, 0, device, spec["model_cls"]):
        model, _ = gpu_common.load_fork_dit(model_dir, **kwargs)
    wrap_linears_for_lora(model, numerics)
    state = gpu_lora_state(config, LORA_RANK, LORA_ALPHA, device, family=family)
    info = {"server_args": kwargs}
    if numerics == "train_parity":
        push_lora(model, state, LORA_RANK, LORA_ALPHA, merge=False)
    elif family != "qwen-image":  # no fused LoRA targets in these default DiTs
        bf16 = {name: t.to(torch.bfloat16) for name, t in state.items()}
        push_lora(model, bf16, LORA_RANK, LORA_ALPHA, merge=False)
    else:
        info["lora_layers_set"] = gpu_common.push_lora_any(
            model, state, LORA_RANK, LORA_ALPHA, merge=False, dtype=torch.bfloat16
        )
    if numerics == "default":
        gpu_common.mount_default_quality(model)
        dit_module = importlib.import_module(type(model).__module__)
        harness.install(model, dit_module)
    del state
    info["dispatch"] = gpu_common.dispatch_table(model)
    return model, info


def fork_step_fn(model, config, grid, txt, device, batch=1):
    """One CFG step of the fork's DiT, its cond and uncond forwards run as the
    denoising stage runs them (``run_cfg_branches``: at once on two streams where
    the DiT replays CUDA graphs)."""
    import functools

    import torch
    from sglang.multimodal_gen.runtime.utils import train_parity_graphs

    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
        QwenImagePipelineConfig,
    )
    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    latents, text, img_shapes = make_inputs(config, grid, txt, device, batch)
    latents = latents.bfloat16()
    freqs = {
        k: QwenImagePipelineConfig.get_freqs_cis(
            img_shapes,
            [t.shape[1]] * batch,
            model.rotary_emb,
            torch.device(device),
            torch.bfloat16,
        )
        for k, t in text.items()
    }
    ts = timesteps_for(64, device)

    def forward(k, t):
        return model(
            hidden_states=latents,
            encoder_hidden_states=text[k],
            encoder_hidden_states_mask=None,
            timestep=t,
            img_shapes=img_shapes,
            txt_seq_lens=[text[k].shape[1]] * batch,
            freqs_cis=freqs[k][0],
            freqs_complex=freqs[k][1],
        )

    def step(i):
        t = ts[i % len(ts)].expand(batch).contiguous()
        with torch.no_grad(), set_forward_context(
            current_timestep=i, attn_metadata=None, forward_batch=None
        ):
            cond, uncond = train_parity_graphs.run_cfg_branches(
                model, [functools.partial(forward, k, t) for k in ("cond", "uncond")]
            )
        return uncond + CFG_SCALE * (cond - uncond)

    return step


def build_diffusers(config: dict, device: str):
    import torch
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from sglang_train_parity.reference import (
        ADAPTER,
        LORA_TARGETS,
        _rebuild_rope_tables,
    )

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    gpu_common.randomize_(model, 0, device)
    _rebuild_rope_tables(model.pos_embed, torch.device(device))
    lora_config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        init_lora_weights="gaussian",
    )
    inject_adapter_in_model(lora_config, model, adapter_name=ADAPTER)
    state = gpu_lora_state(config, LORA_RANK, LORA_ALPHA, device)
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    del state
    model = model.to(dtype=torch.bfloat16).eval()
    model.set_attention_backend("_native_flash" if device == "cuda" else "native")
    return model, {
        "attention_backend": "_native_flash" if device == "cuda" else "native"
    }


def diffusers_step_fn(model, config, grid, txt, device, batch=1):
    import torch
    from sglang_train_parity.autocast_emulation import cuda_autocast

    latents, text, img_shapes = make_inputs(config, grid, txt, device, batch)
    ts = timesteps_for(64, device)

    def step(i):
        t = (ts[i % len(ts)] / 1000.0).expand(batch)
        outs = {}
        with torch.no_grad(), cuda_autocast(device):
            for k in ("cond", "uncond"):
                (outs[k],) = model(
                    hidden_states=latents,
                    encoder_hidden_states=text[k],
                    encoder_hidden_states_mask=None,
                    timestep=t,
                    img_shapes=img_shapes,
                    return_dict=False,
                )
            return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def wan_inputs(config: dict, clip: tuple[int, int, int], device):
    """Latents [1, C, F', H', W'] (VAE stride 4 in time, 8 in space) and per-branch T5 embeds
    [1, 512, text_dim] bf16, zero-padded after WAN_TEXT_LEN tokens."""
    import torch

    g = torch.Generator(device=device).manual_seed(7)
    frames, height, width = clip
    latents = torch.randn(
        1,
        config["in_channels"],
        (frames - 1) // 4 + 1,
        height // 8,
        width // 8,
        generator=g,
        device=device,
    )
    text = {}
    for branch, length in WAN_TEXT_LEN.items():
        t = torch.randn(1, 512, config["text_dim"], generator=g, device=device)
        t[:, length:] = 0
        text[branch] = t.bfloat16()
    return latents, text


def wan_fork_step_fn(model, config, clip, device):
    import torch

    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    latents, text = wan_inputs(config, clip, device)
    latents = latents.bfloat16()
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), set_forward_context(
            current_timestep=i, attn_metadata=None, forward_batch=None
        ):
            outs = {
                k: model(
                    hidden_states=latents, encoder_hidden_states=t, timestep=ts[i % 64]
                )
                for k, t in text.items()
            }
        return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def build_wan_diffusers(config: dict, device: str):
    """diffusers' Wan DiT + PEFT with the fork variants' weights and LoRA (same draws), every
    parameter bf16, the RoPE buffers fp32 as diffusers builds them."""
    import torch
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
    from sglang_train_parity import wan
    from sglang_train_parity.reference import inject_lora

    with torch.device("meta"):
        model = WanTransformer3DModel(**config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    gpu_common.randomize_(model, 0, device)
    model.rope = WanRotaryPosEmbed(
        config["attention_head_dim"], config["patch_size"], config["rope_max_seq_len"]
    ).to(device)
    state = gpu_lora_state(config, LORA_RANK, LORA_ALPHA, device, family="wan")
    inject_lora(model, state, LORA_RANK, LORA_ALPHA, wan.LORA_TARGETS)
    del state
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    backend = "_native_flash" if device == "cuda" else "native"
    model.eval().set_attention_backend(backend)
    return model, {"attention_backend": backend}


def wan_diffusers_step_fn(model, config, clip, device):
    import torch
    from sglang_train_parity.autocast_emulation import cuda_autocast

    latents, text = wan_inputs(config, clip, device)
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), cuda_autocast(device):
            outs = {
                k: model(
                    hidden_states=latents,
                    encoder_hidden_states=t,
                    timestep=ts[i % 64],
                    return_dict=False,
                )[0]
                for k, t in text.items()
            }
            return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def qwen21_inputs(config: dict, grid: tuple[int, int], device):
    """Latents [1, H*W, C] and per-branch text embeds [1, TXT_LEN, D] bf16."""
    import torch

    g = torch.Generator(device=device).manual_seed(7)
    h, w = grid
    latents = torch.randn(1, h * w, config["in_channels"], generator=g, device=device)
    text = {
        k: torch.randn(
            1, n, config["context_in_dim"], generator=g, device=device
        ).bfloat16()
        for k, n in TXT_LEN.items()
    }
    return latents, text


def qwen21_fork_step_fn(model, config, grid, device):
    import torch

    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )
    from sglang.multimodal_gen.runtime.models.dits.qwen_image21 import build_layout

    latents, text = qwen21_inputs(config, grid, device)
    latents = latents.bfloat16()
    layouts = {
        k: [
            build_layout(
                [False] * t.shape[1], [(1, *grid)], config["axes_dims_rope"], device
            )
        ]
        for k, t in text.items()
    }
    # the default path fills its prefix K/V at the first step and reuses them for the request
    caches = {
        k: None if model.train_parity else [[{} for _ in range(config["num_layers"])]]
        for k in text
    }
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), set_forward_context(
            current_timestep=i, attn_metadata=None, forward_batch=None
        ):
            outs = {
                k: model(
                    hidden_states=latents,
                    encoder_hidden_states=t,
                    timestep=ts[i % 64],
                    layouts=layouts[k],
                    prefix_caches=caches[k],
                )
                for k, t in text.items()
            }
        return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def build_qwen21_diffusers(config: dict, device: str):
    """diffusers' Qwen-Image 2.1 DiT + PEFT with the fork variants' weights and LoRA (same draws),
    every parameter bf16; RoPE tables built on the device (as the fork's default), the timestep
    frequencies on the CPU (as diffusers' __init__)."""
    import torch
    from diffusers import QwenImage21Transformer2DModel
    from sglang_train_parity import qwen_image21
    from sglang_train_parity.reference import inject_lora

    with torch.device("meta"):
        model = QwenImage21Transformer2DModel(**config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    gpu_common.randomize_(model, 0, device)
    qwen_image21._rebuild_rope_tables(model.pos_embed, torch.device(device))
    time_proj = model.time_text_embed.time_proj
    half = time_proj.freqs.numel()
    steps = torch.arange(start=0, end=half, dtype=torch.float32)
    time_proj.freqs = torch.exp(-math.log(10000) * steps / half).to(device)
    state = gpu_lora_state(
        config, LORA_RANK, LORA_ALPHA, device, family="qwen-image-2.1"
    )
    inject_lora(model, state, LORA_RANK, LORA_ALPHA, qwen_image21.LORA_TARGETS)
    del state
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    model.eval().set_attention_backend("native")
    return model, {"attention_backend": "native"}


def qwen21_diffusers_step_fn(model, config, grid, device):
    import torch
    from sglang_train_parity.autocast_emulation import cuda_autocast

    latents, text = qwen21_inputs(config, grid, device)
    n = latents.shape[1]
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), cuda_autocast(device):
            outs = {}
            for k, t in text.items():
                img_mask = torch.zeros(
                    1, t.shape[1] + n // 4, dtype=torch.bool, device=device
                )
                img_mask[:, t.shape[1] :] = True
                outs[k] = model(
                    hidden_states=latents,
                    encoder_hidden_states=t,
                    timestep=ts[i % 64] / 1000,
                    img_shapes=[[(1, *grid)]],
                    img_mask=img_mask,
                    return_dict=False,
                )[0][:, -n:]
            return outs["uncond"] + CFG_SCALE * (outs["cond"] - outs["uncond"])

    return step


def ltx2_inputs(config: dict, clip: tuple[int, int, int], device):
    from benchmark.gpu_parity_ltx2 import TEXT_TOKENS
    from sglang_train_parity.ltx2 import LTX2DiTInputs, audio_tokens, latent_grid

    frames, height, width = clip
    inputs = LTX2DiTInputs.random(
        1, latent_grid(*clip), audio_tokens(frames), TEXT_TOKENS, config, 999.0, seed=7
    )
    for field in ("latents", "audio_latents", "text"):
        setattr(inputs, field, getattr(inputs, field).to(device))
    return inputs


def ltx2_fork_step_fn(model, config, clip, device):
    """One unguided forward per step, as the denoising stage calls the DiT: under train_parity
    without the audio-video cross-attention, the default path with it and the prompt K/V
    projected once per request."""
    import torch
    from sglang_train_parity.ltx2 import FPS

    from sglang.multimodal_gen.runtime.managers.forward_context import (
        set_forward_context,
    )

    inputs = ltx2_inputs(config, clip, device)
    frames, height, width = inputs.grid
    call = dict(
        hidden_states=inputs.latents.bfloat16(),
        audio_hidden_states=inputs.audio_latents.bfloat16(),
        encoder_hidden_states=inputs.text,
        audio_encoder_hidden_states=inputs.text,
        num_frames=frames,
        height=height,
        width=width,
        fps=FPS,
        audio_num_frames=inputs.audio_latents.shape[1],
        return_latents=False,
    )
    if model.train_parity:
        call.update(disable_a2v_cross_attn=True, disable_v2a_cross_attn=True)
    else:
        key = model.prepare_prompt_kv(inputs.text, inputs.text)
        call.update(
            encoder_hidden_states=None,
            audio_encoder_hidden_states=None,
            cached_prompt_kv=key,
        )
    ts = timesteps_for(64, device)

    def step(i):
        with torch.no_grad(), set_forward_context(
            current_timestep=i, attn_metadata=None, forward_batch=None
        ):
            return model(**call, timestep=ts[i % 64])[0]

    return step


def build_ltx2_reference(config: dict, device: str):
    """ltx-core's LTXModel + PEFT with the fork variants' weights and LoRA (same draws), every
    parameter bf16."""
    import diffusers
    import torch
    from sglang_train_parity import ltx2
    from sglang_train_parity.reference import inject_lora

    with torch.device("meta"):
        full_config = dict(diffusers.LTX2VideoTransformer3DModel(**config).config)
        model = ltx2.ltx_core_model(full_config).to(torch.bfloat16)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in gpu_common.random_weights_iterator(
            config, 0, device, "LTX2VideoTransformer3DModel"
        ):
            params.pop(ltx2.ltx_core_name(name)).copy_(tensor)
    if params:
        raise RuntimeError(
            f"ltx-core parameters without a weight: {sorted(params)[:4]}"
        )
    state = gpu_lora_state(config, LORA_RANK, LORA_ALPHA, device, family="ltx-2")
    inject_lora(model, state, LORA_RANK, LORA_ALPHA, ltx2.LORA_TARGETS)
    del state
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return model.eval(), {"attention": "SDPA math"}


def ltx2_reference_step_fn(model, config, clip, device):
    """The trainer's step: the video stream alone, under CUDA autocast, SDPA math."""
    import torch
    from sglang_train_parity.autocast_emulation import cuda_autocast
    from sglang_train_parity.ltx2 import trainer_modalities
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inputs = ltx2_inputs(config, clip, device)
    ts = timesteps_for(64, device)

    def step(i):
        inputs.timestep = ts[i % 64]
        video, _ = trainer_modalities(inputs, device)
        with torch.no_grad(), cuda_autocast(device), sdpa_kernel(SDPBackend.MATH):
            return model(video=video, audio=None, perturbations=None)[0]

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--family", default="qwen-image", choices=FAMILY_SPECS)
    parser.add_argument("--layers", type=int, help="blocks (default: the real model's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=1, help="timed runs of --steps steps per variant"
    )
    parser.add_argument(
        "--image", type=int, default=1024, help="Qwen-Image: image side in pixels"
    )
    parser.add_argument("--batch", type=int, default=1, help="Qwen-Image: batch size")
    parser.add_argument(
        "--extra-shapes",
        default="",
        help="Qwen-Image: more 'SIDExBATCH' shapes timed on every variant but default "
        "with the same model, e.g. 512x1,1024x2",
    )
    parser.add_argument(
        "--variants",
        default="train_parity,diffusers,default",
        help="train_parity (fused kernels and CUDA-graph replay, as the loader sets it "
        "up), train_parity_no_graph (the same model, fused kernels launched eagerly), "
        "train_parity_eager (the same model, eager op chains and launches), default, "
        "diffusers, ltx-core",
    )
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--jit", default="off", choices=("off", "compile"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/speed"))
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark/results/speed.json"
    )
    args = parser.parse_args()
    t_start = time.monotonic()
    gpu_common.setup(args.device, args.jit)
    global CLOCKS
    if args.device == "cuda" and shutil.which("nvidia-smi"):
        CLOCKS = GpuClocks()
    import torch
    from sglang_train_parity import ltx2, qwen_image21, reference, wan

    FAMILY_SPECS["ltx-2"]["targets"] = ltx2.LORA_TARGETS
    FAMILY_SPECS["qwen-image"]["targets"] = reference.LORA_TARGETS
    FAMILY_SPECS["qwen-image-2.1"]["targets"] = qwen_image21.LORA_TARGETS
    FAMILY_SPECS["wan"]["targets"] = wan.LORA_TARGETS
    spec = FAMILY_SPECS[args.family]
    layers = args.layers or spec["default_layers"]
    if args.family == "qwen-image-2.1":
        from benchmark.gpu_parity_qwen21 import QWEN_IMAGE_21

        config = dict(QWEN_IMAGE_21, num_layers=layers)
        if args.tiny:
            config.update(
                attention_head_dim=32, num_attention_heads=2, context_in_dim=48
            )
            config.update(axes_dims_rope=(8, 12, 12))
        grid = (8, 8) if args.tiny else (64, 64)
        shape = {
            "image": f"{grid[0] * 16}x{grid[1] * 16}",
            "image_tokens": grid[0] * grid[1],
            "text_tokens": TXT_LEN,
        }
        model_dir = gpu_common.write_config_only_model_dir(
            args.workdir / "qwen-image-2.1-speed",
            config,
            spec["model_cls"],
            spec["model_index"],
        )
    elif args.family == "ltx-2":
        from benchmark.gpu_parity_ltx2 import LTX2_19B

        config = dict(LTX2_19B, num_layers=layers)
        if args.tiny:
            config.update(ltx2.TINY_DIT_CONFIG, num_layers=layers)
        clip = (9, 64, 96) if args.tiny else (121, 512, 768)
        shape = {"video": "x".join(map(str, clip)), "text_tokens": 1024}
        model_dir = gpu_common.write_config_only_model_dir(
            args.workdir / "LTX-2-speed", config, spec["model_cls"], spec["model_index"]
        )
    elif args.family == "wan":
        from benchmark.gpu_parity_wan import WAN_14B

        config = dict(WAN_14B, num_layers=layers)
        if args.tiny:
            config.update(
                num_attention_heads=2, attention_head_dim=24, text_dim=32, ffn_dim=96
            )
        clip = WAN_CLIP_TINY if args.tiny else WAN_CLIP
        shape = {"video": "x".join(map(str, clip)), "text_tokens": WAN_TEXT_LEN}
        model_dir = gpu_common.write_config_only_model_dir(
            args.workdir / "wan-speed", config, spec["model_cls"], spec["model_index"]
        )
    else:
        config = dict(
            gpu_common.TINY_CONFIG if args.tiny else gpu_common.REAL_CONFIG,
            num_layers=layers,
        )
        grid = (8, 8) if args.tiny else (args.image // 16, args.image // 16)
        txt = TXT_LEN_TINY if args.tiny else TXT_LEN
        shape = {
            "image": f"{grid[0] * 16}x{grid[1] * 16}",
            "image_tokens": grid[0] * grid[1],
            "text_tokens": txt,
        }
        model_dir = gpu_common.write_config_only_model_dir(
            args.workdir / "qwen-image-speed", config
        )
    result = {
        "script": "benchmark/speed.py",
        "argv": sys.argv[1:],
        "family": args.family,
        "config": config,
        **shape,
        "batch": args.batch,
        "cfg": (
            "none: one forward per step"
            if args.family == "ltx-2"
            else "two forwards per step (cond, uncond) + combine"
        ),
        "lora": {
            "rank": LORA_RANK,
            "alpha": LORA_ALPHA,
            "targets": list(spec["targets"]),
            "merged": False,
        },
        "steps_timed": args.steps,
        "warmup_steps": args.warmup,
        "variants": {},
        "errors": {},
    }

    def save():
        result["versions"] = gpu_common.versions()
        result["standin_calls"] = gpu_standins.calls()
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        gpu_common.write_json(args.out, result)

    from sglang.multimodal_gen.runtime.layers import train_parity_kernels

    step_outputs = {}
    variants = args.variants.split(",")
    train_parity_variants = [v for v in variants if v.startswith("train_parity")]
    kept = (
        None  # (model, step, info, graphed forward) shared by the train_parity variants
    )
    for variant in variants:
        t0 = time.monotonic()
        entry: dict = {}
        result["variants"][variant] = entry
        harness = gpu_common.DefaultPathHarness() if variant == "default" else None
        model = step = None
        train_parity_kernels.FUSED_KERNELS = variant != "train_parity_eager"
        # the variant whose profile gives the train_parity variants' floor
        replays_floor = variant == "train_parity_eager" and not args.no_profile
        try:
            if args.device == "cuda":
                torch.cuda.empty_cache()
                entry["leftover_gib_before_build"] = round(
                    torch.cuda.memory_allocated() / 2**30, 2
                )
                torch.cuda.reset_peak_memory_stats()
            if variant == "ltx-core":
                model, info = build_ltx2_reference(config, args.device)
                step = ltx2_reference_step_fn(model, config, clip, args.device)
            elif variant == "diffusers" and args.family == "wan":
                model, info = build_wan_diffusers(config, args.device)
                step = wan_diffusers_step_fn(model, config, clip, args.device)
            elif variant == "diffusers" and args.family == "qwen-image-2.1":
                model, info = build_qwen21_diffusers(config, args.device)
                step = qwen21_diffusers_step_fn(model, config, grid, args.device)
            elif variant == "diffusers":
                model, info = build_diffusers(config, args.device)
                step = diffusers_step_fn(
                    model, config, grid, txt, args.device, args.batch
                )
            elif variant in train_parity_variants and kept is not None:
                model, step, info, graphed = kept
                info = dict(info, shares_model_with=train_parity_variants[0])
            else:
                numerics = (
                    "train_parity" if variant.startswith("train_parity") else variant
                )
                model, info = build_fork(
                    numerics, config, model_dir, args.device, harness, args.family
                )
                if args.family == "ltx-2":
                    step = ltx2_fork_step_fn(model, config, clip, args.device)
                elif args.family == "wan":
                    step = wan_fork_step_fn(model, config, clip, args.device)
                elif args.family == "qwen-image-2.1":
                    step = qwen21_fork_step_fn(model, config, grid, args.device)
                else:
                    step = fork_step_fn(
                        model, config, grid, txt, args.device, args.batch
                    )
                if variant in train_parity_variants:
                    graphed = model.__dict__.get("forward")  # the loader's graph replay
                    kept = (model, step, info, graphed)
            if variant in train_parity_variants:
                # only train_parity replays graphs; the other two launch eagerly
                model.__dict__.pop("forward", None)
                if variant == "train_parity" and graphed is not None:
                    model.forward = graphed
                entry["cuda_graphs"] = "forward" in model.__dict__
            entry.update(info)
            if args.device == "cuda":
                entry["weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
                entry["build_peak_gib"] = round(
                    torch.cuda.max_memory_allocated() / 2**30, 2
                )
                torch.cuda.reset_peak_memory_stats()
            entry["build_s"] = round(time.monotonic() - t0, 1)
            t1 = time.monotonic()
            entry.update(timed(step, args))
            entry["warmup_and_timing_s"] = round(time.monotonic() - t1, 1)
            if entry.get("cuda_graphs"):
                # the host work each replayed forward waits for: reading the DiT's state
                reads = []
                for _ in range(10):
                    t2 = time.perf_counter()
                    model.forward._state()
                    reads.append((time.perf_counter() - t2) * 1e3)
                entry["graph_state_read_ms"] = round(statistics.median(reads), 3)
            if args.device == "cuda":
                # peak while stepping (weights + activations), build transients excluded
                entry["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                entry["peak_reserved_gib"] = round(
                    torch.cuda.max_memory_reserved() / 2**30, 2
                )
            if not args.no_profile:
                # module hooks would make graph replay fall back to eager
                entry["profile"] = profile_step(
                    step, model, args.device, annotate=not entry.get("cuda_graphs")
                )
            if replays_floor:
                entry["floor_replay"] = floor_replay(step, model, args)
            # one step's CFG output, for the bitwise comparison of the variants
            step_outputs[variant] = step(0).detach().cpu()
            if (
                args.extra_shapes
                and args.family == "qwen-image"
                and variant != "default"
            ):
                entry["extra_shapes"] = {}
                for extra in args.extra_shapes.split(","):
                    side, batch = (int(v) for v in extra.split("x"))
                    shape_step = (
                        diffusers_step_fn if variant == "diffusers" else fork_step_fn
                    )(model, config, (side // 16, side // 16), txt, args.device, batch)
                    shape_entry = timed(shape_step, args)
                    if not args.no_profile:
                        shape_entry["profile"] = profile_step(
                            shape_step, model, args.device, annotate=False
                        )
                    if replays_floor:
                        shape_entry["floor_replay"] = floor_replay(
                            shape_step, model, args
                        )
                    entry["extra_shapes"][f"{side}x{side} batch {batch}"] = shape_entry
                    step_outputs[(variant, extra)] = shape_step(0).detach().cpu()
                    save()
            if variant.startswith("train_parity"):
                entry["fused_kernels"] = (
                    train_parity_kernels.gate_states()
                    if train_parity_kernels.FUSED_KERNELS
                    else "off"
                )
            if train_parity_variants and variant == train_parity_variants[-1]:
                kept = None
        except Exception:  # noqa: BLE001
            result["errors"][variant] = gpu_common.format_exc()
        if harness is not None:
            entry["fallbacks"] = harness.report()
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        model = step = harness = (
            None  # the step closure and the harness wrappers hold the model
        )
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        save()
        print(
            f"{variant}: median {entry.get('step_ms_median')} ms/step, peak {entry.get('peak_gib')} GiB, wall {entry['wall_s']} s",
            flush=True,
        )

    v = result["variants"]
    # the trainer's forward: ltx-core for LTX-2, diffusers for the others
    trainer = "ltx-core" if args.family == "ltx-2" else "diffusers"
    if trainer in step_outputs:
        from sglang_train_parity.compare import ulp_distance

        theirs = step_outputs[trainer]
        result[f"step_output_vs_{trainer}"] = {
            k: {"equal": torch.equal(out, theirs), "max_ulp": ulp_distance(out, theirs)}
            for k, out in step_outputs.items()
            if isinstance(k, str) and k != trainer
        }
        result[f"extra_shapes_step_output_vs_{trainer}"] = {
            f"{k[0]} {k[1]}": {
                "equal": torch.equal(out, step_outputs[(trainer, k[1])]),
                "max_ulp": ulp_distance(out, step_outputs[(trainer, k[1])]),
            }
            for k, out in step_outputs.items()
            if isinstance(k, tuple)
            and k[0] != trainer
            and (trainer, k[1]) in step_outputs
        }
    med = {k: e.get("step_ms_median") for k, e in v.items()}
    add_floor_ratios(v)
    if med.get("train_parity") and med.get("default"):
        result["train_parity_over_default"] = round(
            med["train_parity"] / med["default"], 3
        )
    if med.get("train_parity") and med.get(trainer):
        result[f"train_parity_over_{trainer}"] = round(
            med["train_parity"] / med[trainer], 3
        )
    # family-level gap: where train_parity spends more kernel time than the default path
    kt = {k: ((e.get("profile") or {}).get("kernel_time_ms")) for k, e in v.items()}
    result["kernel_time_ms_per_step"] = kt
    if kt.get("train_parity") and kt.get("default"):
        result["train_parity_over_default_kernel_time"] = round(
            kt["train_parity"] / kt["default"], 3
        )
    prof_tp = (v.get("train_parity") or {}).get("profile") or {}
    prof_df = (v.get("default") or {}).get("profile") or {}
    if prof_tp.get("families_ms") and prof_df.get("families_ms"):
        fams = set(prof_tp["families_ms"]) | set(prof_df["families_ms"])
        gap = {
            f: round(
                prof_tp["families_ms"].get(f, 0) - prof_df["families_ms"].get(f, 0), 3
            )
            for f in fams
        }
        result["family_gap_ms_train_parity_minus_default"] = dict(
            sorted(gap.items(), key=lambda kv: -kv[1])
        )
    save()
    print(f"wrote {args.out}")
    print(
        f"{'variant':19s} {'median ms/step':>15s} {'p10':>9s} {'p90':>9s} {'peak GiB':>9s} "
        f"{'kernel ms':>9s} {'launches':>9s} {'floor ms':>9s} {'/floor':>7s}  round medians"
    )
    for k, e in v.items():
        p = e.get("profile") or {}
        print(
            f"{k:19s} {e.get('step_ms_median')!s:>15s} {e.get('step_ms_p10')!s:>9s} {e.get('step_ms_p90')!s:>9s} "
            f"{e.get('peak_gib')!s:>9s} {p.get('kernel_time_ms')!s:>9s} {p.get('kernel_launches')!s:>9s} "
            f"{e.get('contract_floor_ms')!s:>9s} {e.get('wall_over_contract_floor')!s:>7s}  {e.get('round_medians_ms')}"
        )
    for k, e in v.items():
        if e.get("pipelined_step_ms_median"):
            print(
                f"{k:19s} pipelined (no wait between steps) {e['pipelined_step_ms_median']} "
                f"ms/step, /floor {e.get('pipelined_over_contract_floor')}, "
                f"rounds {e['pipelined_round_means_ms']}"
            )
    for k, e in v.items():
        clocks = {
            "waited for": e.get("gpu_clocks"),
            "back to back": e.get("pipelined_gpu_clocks"),
            "profiled step": (e.get("profile") or {}).get("gpu_clocks"),
        }
        if any(clocks.values()):
            print(
                f"{k:19s} GPU clocks "
                + ", ".join(
                    f"{when} {c['sm_mhz']} MHz {c['power_w']} W" if c else f"{when} -"
                    for when, c in clocks.items()
                )
            )
    for k, e in v.items():
        for shape, x in {"": e, **(e.get("extra_shapes") or {})}.items():
            r = x.get("floor_replay")
            if r:
                c, pc = r.get("gpu_clocks") or {}, r.get("pipelined_gpu_clocks") or {}
                print(
                    f"{k:19s} {shape + ' ' if shape else ''}floor replay ({r['ops']} GEMM and "
                    f"attention calls): waited for {r['step_ms_median']} ms at "
                    f"{c.get('sm_mhz')} MHz, back to back {r.get('pipelined_step_ms_median')} "
                    f"ms at {pc.get('sm_mhz')} MHz {pc.get('power_w')} W, kernel "
                    f"{r['profile'].get('kernel_time_ms')} ms"
                )
    for k, e in v.items():
        for shape, x in {"": e, **(e.get("extra_shapes") or {})}.items():
            if x.get("step_ms_median_over_floor_replay"):
                print(
                    f"{k:19s} {shape + ' ' if shape else ''}/floor replay: waited for "
                    f"{x['step_ms_median_over_floor_replay']}, back to back "
                    f"{x.get('pipelined_step_ms_median_over_floor_replay')}"
                )
    for k, e in v.items():
        t = (e.get("profile") or {}).get("device_timeline")
        if t:
            print(
                f"{k:19s} host lead {t['host_lead_ms']} ms, device span {t['device_span_ms']} ms, "
                f"idle in span {t['device_idle_in_span_ms']} ms over {t['gaps']} gaps "
                f"({t['gaps_over_10us_ms']} ms in gaps over 10 us), "
                f"graph state read {e.get('graph_state_read_ms')} ms"
            )
            for st in t.get("streams", []):
                print(
                    f"{'':19s} stream {st['stream']}: busy {st['busy_ms']} ms in {st['kernels']} kernels; "
                    + ", ".join(f"{x['name'][:40]} {x['ms']}" for x in st["top"][:6])
                )
    for k, e in v.items():
        for shape, x in (e.get("extra_shapes") or {}).items():
            p = x.get("profile") or {}
            print(
                f"{k:19s} {shape:16s} median {x['step_ms_median']} ms p10 {x['step_ms_p10']} "
                f"p90 {x['step_ms_p90']} kernel {p.get('kernel_time_ms')} ms launches "
                f"{p.get('kernel_launches')} floor {x.get('contract_floor_ms')} ms "
                f"/floor {x.get('wall_over_contract_floor')} rounds {x['round_medians_ms']} "
                f"pipelined {x.get('pipelined_step_ms_median')} ms "
                f"/floor {x.get('pipelined_over_contract_floor')}"
            )
    for k in (
        f"step_output_vs_{trainer}",
        f"extra_shapes_step_output_vs_{trainer}",
        "train_parity_over_default",
        f"train_parity_over_{trainer}",
        "kernel_time_ms_per_step",
        "train_parity_over_default_kernel_time",
        "family_gap_ms_train_parity_minus_default",
    ):
        if k in result:
            print(k, result[k])
    for k, err in result["errors"].items():
        print(f"ERROR in {k}:\n{err}")
    if CLOCKS:
        CLOCKS.stop()
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
