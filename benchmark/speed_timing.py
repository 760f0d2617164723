"""How benchmark/speed.py times and profiles a step: CUDA-event step times (waited for and
issued back to back), the SM clock and power while stepping, one profiled step broken down by
kernel family, module class and stream, and the floor replay (the eager step's GEMM and
attention calls alone, replayed as one CUDA graph per step) with the ratios against it.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from benchmark import gpu_common

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
    or a `TensorSpec`; and, per spec, a copy of the first tensor the step passed with it.
    """
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
        t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
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
            for k in (
                "gpu_clocks",
                "kernel_time_ms",
                "families_ms",
                "contract_floor_ms",
            )
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
