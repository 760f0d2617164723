"""Per-denoising-step latency of the full Qwen-Image DiT (60 blocks, 1024x1024 image = 4096 image
tokens, batch 1, CFG as two forwards, LoRA r64 unmerged on all 12 targets of every block):

* `train_parity`: the fork, numerics="train_parity" (attention torch_sdpa, LoRA dynamic), loaded
  through sglang's real transformer loader (weights generated on the device and fed through the
  loader's own `weights_iterator` argument: a 41 GB checkpoint would not fit the lease);
* `default`: the fork with upstream's numerics, the closest default path that runs on this machine
  (benchmark/default_path.DefaultPathHarness: every fallback is recorded), request quality "lossless"
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

The models and step functions are in speed_families.py (Qwen-Image, Qwen-Image 2.1) and
speed_video.py (Wan, LTX-2), the timing, profiling and floor replay in speed_timing.py.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark import default_path, gpu_common, gpu_standins, speed_timing  # noqa: E402
from benchmark.speed_families import (  # noqa: E402
    FAMILY_SPECS,
    LORA_ALPHA,
    LORA_RANK,
    TXT_LEN,
    TXT_LEN_TINY,
    WAN_CLIP,
    WAN_CLIP_TINY,
    WAN_TEXT_LEN,
    build_diffusers,
    build_fork,
    build_qwen21_diffusers,
    diffusers_step_fn,
    fork_step_fn,
    qwen21_diffusers_step_fn,
    qwen21_fork_step_fn,
)
from benchmark.speed_timing import (  # noqa: E402
    GpuClocks,
    add_floor_ratios,
    floor_replay,
    profile_step,
    timed,
)
from benchmark.speed_video import (  # noqa: E402
    build_ltx2_reference,
    build_wan_diffusers,
    ltx2_fork_step_fn,
    ltx2_reference_step_fn,
    wan_diffusers_step_fn,
    wan_fork_step_fn,
)


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
    if args.device == "cuda" and shutil.which("nvidia-smi"):
        speed_timing.CLOCKS = GpuClocks()
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
        harness = default_path.DefaultPathHarness() if variant == "default" else None
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
    if speed_timing.CLOCKS:
        speed_timing.CLOCKS.stop()
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
