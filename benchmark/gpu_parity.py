"""Parity at real Qwen-Image widths on a GPU: the fork's DiT under numerics="train_parity" against
diffusers + PEFT under real torch.autocast("cuda", bf16) with attention backend `_native_flash`.

    python benchmark/gpu_parity.py [--device cuda|cpu] [--tiny] [--layers 4] [--out PATH]

What runs (every case on both sides, every paired module output compared on the device, only the
statistics kept):
* model: QwenImageTransformer2DModel with hidden 3072 (24 heads x 128), text width 3584, MLP 12288,
  in_channels 64, RoPE axes (16, 56, 56), `--layers` blocks, random weights saved in diffusers format
  and loaded into the fork through sglang's real transformer loader (train_parity.sglang_dit.load_dit);
  the reference is the same checkpoint through sglang_train_parity.reference.build_reference (bf16 copies of
  the fp32 masters, PEFT LoRA on all 12 targets per block);
* cases: latent patch grids 32x32 (512x512 image, 1024 tokens) and 64x64 (1024x1024, 4096 tokens);
  text lengths 77 and 211; batch 1 and 2; cond and uncond (different prompt embeddings); 2 timesteps;
* section `train_parity`: LoRA r64 alpha 128. Two fork models, `--train-parity-rope-tables device`
  and `cpu`, against two references, tables rebuilt on the device (as miles
  does) and tables as stock diffusers builds them (CPU, in __init__). Matching pairs must be bitwise
  equal module by module; crossed pairs show the table construction matters;
* section `alpha96`: a second LoRA update into the same fork model, alpha 96 (scale 1.5);
* section `default`: numerics="default", the closest default path that runs on this machine
  (benchmark/default_path.DefaultPathHarness says what that is; the run records every fallback),
  same LoRA unmerged, against the alpha-128 device-table reference: must differ.

Writes benchmark/results/gpu_parity.json (or --out). Exit status 1 if a matching pair differs or the
default path does not.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark import default_path, gpu_common, gpu_standins  # noqa: E402

LORA_RANK = 64
ALPHA_MAIN = 128
ALPHA_SECOND = 96  # scale 1.5
TIMESTEPS = (980.0, 437.0)
BRANCHES = ("cond", "uncond")
BATCHES = (1, 2)
GRID_REAL = {"img": ((32, 32), (64, 64)), "txt": (77, 211)}
GRID_TINY = {"img": ((4, 4), (8, 8)), "txt": (7, 13)}


def cases(grid: dict) -> list[dict]:
    out = []
    for (h, w), txt, batch, branch, t in itertools.product(
        grid["img"], grid["txt"], BATCHES, BRANCHES, TIMESTEPS
    ):
        out.append(
            {
                "img": [h, w],
                "img_tokens": h * w,
                "txt_len": txt,
                "batch": batch,
                "branch": branch,
                "timestep": t,
            }
        )
    for i, case in enumerate(out):
        case["seed"] = 1000 + i
    return out


def make_inputs(case: dict, joint_dim: int):
    from sglang_train_parity.reference import QwenDiTInputs

    # cond and uncond differ by their (seeded) prompt embeddings and latents draw
    return QwenDiTInputs.random(
        case["batch"],
        case["img"][0],
        case["img"][1],
        case["txt_len"],
        joint_dim,
        case["timestep"],
        seed=case["seed"],
    )


def make_reference(masters, state, rank, alpha, device: str, rope: str):
    """build_reference on a copy of the masters, RoPE tables built as `rope` says."""
    from sglang_train_parity.reference import build_reference

    return build_reference(
        copy.deepcopy(masters), state, rank, alpha, device, rope_tables=rope
    )

from benchmark.parity_compare import (  # noqa: E402
    Comparator,
    condense,
    fork_forward,
    fused_kernels_ran,
    strip_compared,
)


def run_grid(
    forks: dict, refs: dict, grid_cases, device, joint_dim, lora=True, deadline=None
) -> list[dict]:
    """For each case: every reference forward once (outputs kept on the device for this case only),
    then every fork forward compared against every reference."""
    import torch
    from sglang_train_parity.reference import reference_forward

    records = []
    for case in grid_cases:
        if deadline is not None and time.monotonic() > deadline:
            records.append({"case": case, "skipped": "time budget"})
            continue
        inputs = make_inputs(case, joint_dim)
        ref_out = {}
        for key, ref in refs.items():
            _, ref_out[key] = reference_forward(ref, inputs, device)
        record = {"case": case, "comparisons": {}}
        for fork_key, fork in forks.items():
            comparator = fork_forward(fork, inputs, device, Comparator(ref_out, lora))
            for ref_key, summary in comparator.summaries().items():
                record["comparisons"][f"{fork_key}~{ref_key}"] = summary
        del ref_out
        if device == "cuda":
            torch.cuda.synchronize()
        records.append(record)
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--tiny", action="store_true", help="small widths (CPU dry run)"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmark/results/gpu_parity.json"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gpu_parity"))
    parser.add_argument("--jit", default="off", choices=("off", "compile"))
    parser.add_argument("--sections", default="train_parity,alpha96,default")
    parser.add_argument(
        "--max-cases", type=int, default=0, help="limit cases per section (0: all)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="stop starting cases after this"
    )
    args = parser.parse_args()
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    gpu_common.setup(args.device, args.jit)

    import torch
    from diffusers import QwenImageTransformer2DModel
    from sglang_train_parity.reference import random_lora_state
    from sglang_train_parity.sglang_dit import push_lora, wrap_linears_for_lora

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available (use --device cpu --tiny for a dry run)")
    config = dict(
        gpu_common.TINY_CONFIG if args.tiny else gpu_common.REAL_CONFIG,
        num_layers=args.layers,
    )
    grid = cases(GRID_TINY if args.tiny else GRID_REAL)
    if args.max_cases:
        grid = grid[: args.max_cases]
    sections = args.sections.split(",")
    result: dict = {
        "script": "benchmark/gpu_parity.py",
        "argv": sys.argv[1:],
        "device": args.device,
        "config": config,
        "lora": {
            "rank": LORA_RANK,
            "alpha_main": ALPHA_MAIN,
            "alpha_second": ALPHA_SECOND,
            "targets_per_block": 12,
        },
        "reference": "diffusers QwenImageTransformer2DModel + PEFT LoRA, bf16 params, "
        + (
            "torch.autocast('cuda', bf16), attention backend _native_flash"
            if args.device == "cuda"
            else "CUDA autocast policy emulated on CPU, attention native"
        ),
        "cases_per_section": len(grid),
        "sections": {},
        "errors": {},
    }
    out_path = args.out

    def save():
        result["versions"] = gpu_common.versions()
        result["standin_calls"] = gpu_standins.calls()
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        gpu_common.write_json(out_path, result)

    t0 = time.monotonic()
    model_dir = gpu_common.write_model_dir(
        args.workdir / "qwen-image-parity", config, seed=0, device=args.device
    )
    masters = QwenImageTransformer2DModel.from_pretrained(
        model_dir / "transformer", torch_dtype=torch.float32
    )
    masters = masters.to(
        args.device
    )  # RoPE tables (plain attributes) stay where diffusers built them: CPU
    joint_dim = masters.config.joint_attention_dim
    state_main = random_lora_state(masters, LORA_RANK, ALPHA_MAIN, seed=0)
    state_second = random_lora_state(masters, LORA_RANK, ALPHA_SECOND, seed=1)
    # the weight updater receives the trainer's tensors on the device (IPC); set_lora_weights does not move them
    state_main = {k: v.to(args.device) for k, v in state_main.items()}
    state_second = {k: v.to(args.device) for k, v in state_second.items()}
    result["setup_s"] = round(time.monotonic() - t0, 1)

    forks, refs = {}, {}
    ok = True
    # ---------------------------------------------------------------- train_parity, alpha 128
    if "train_parity" in sections:
        t0 = time.monotonic()
        try:
            for rope in ("device", "cpu"):
                model, _ = gpu_common.load_fork_dit(
                    model_dir, numerics="train_parity", train_parity_rope_tables=rope
                )
                wrap_linears_for_lora(model, "train_parity")
                push_lora(model, state_main, LORA_RANK, ALPHA_MAIN, merge=False)
                forks[f"tp_rope_{rope}"] = model
                refs[f"ref_rope_{rope}"] = make_reference(
                    masters, state_main, LORA_RANK, ALPHA_MAIN, args.device, rope
                )
            result["dispatch_train_parity"] = gpu_common.dispatch_table(
                forks["tp_rope_device"]
            )
            records = run_grid(
                forks, refs, grid, args.device, joint_dim, deadline=deadline
            )
            equal = {"tp_rope_device~ref_rope_device", "tp_rope_cpu~ref_rope_cpu"}
            # on a GPU the two constructions give different tables; on the CPU they are the same tables
            crossed = {"tp_rope_device~ref_rope_cpu", "tp_rope_cpu~ref_rope_device"}
            differ = crossed if args.device == "cuda" else set()
            summary = condense(records, equal, differ)
            strip_compared(records)
            ok &= all(s["as_expected"] for s in summary.values())
            ok &= fused_kernels_ran(result, args.device)
            result["sections"]["train_parity"] = {
                "what": "numerics=train_parity, LoRA r64 alpha 128 unmerged on all targets; both RoPE table constructions",
                "summary": summary,
                "records": records,
                "wall_s": round(time.monotonic() - t0, 1),
            }
        except Exception:  # noqa: BLE001
            ok = False
            result["errors"]["train_parity"] = gpu_common.format_exc()
        save()
        # the cpu-table pair is done; free it before the next sections
        forks.pop("tp_rope_cpu", None)
        refs.pop("ref_rope_cpu", None)
        if args.device == "cuda":
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------- alpha 96 (scale 1.5)
    if "alpha96" in sections and "tp_rope_device" in forks:
        t0 = time.monotonic()
        try:
            push_lora(
                forks["tp_rope_device"],
                state_second,
                LORA_RANK,
                ALPHA_SECOND,
                merge=False,
            )
            ref96 = make_reference(
                masters, state_second, LORA_RANK, ALPHA_SECOND, args.device, "device"
            )
            records = run_grid(
                {"tp_rope_device_a96": forks["tp_rope_device"]},
                {"ref_rope_device_a96": ref96},
                grid,
                args.device,
                joint_dim,
                deadline=deadline,
            )
            summary = condense(
                records, {"tp_rope_device_a96~ref_rope_device_a96"}, set()
            )
            strip_compared(records)
            ok &= all(s["as_expected"] for s in summary.values())
            result["sections"]["alpha96"] = {
                "what": "second LoRA update into the same fork model: r64 alpha 96 (scale 1.5), RoPE tables on the device",
                "summary": summary,
                "records": records,
                "wall_s": round(time.monotonic() - t0, 1),
            }
            del ref96
        except Exception:  # noqa: BLE001
            ok = False
            result["errors"]["alpha96"] = gpu_common.format_exc()
        save()
    forks.clear()
    if args.device == "cuda":
        torch.cuda.empty_cache()

    # ---------------------------------------------------------------- default numerics (negative control)
    if "default" in sections:
        t0 = time.monotonic()
        harness = default_path.DefaultPathHarness()
        section: dict = {
            "what": "numerics=default (upstream's forwards), LoRA r64 alpha 128 unmerged (dynamic), request quality "
            f"{default_path.DEFAULT_REQUEST_QUALITY!r} mounted, against the alpha-128 device-table reference",
        }
        result["sections"]["default"] = section
        try:
            import sglang.multimodal_gen.runtime.models.dits.qwen_image as qwen_module

            section["attention_default_probe"] = default_path.probe_default_attention(
                args.device
            )
            kwargs = {"numerics": "default"}
            if args.device == "cuda":
                kwargs["attention_backend"] = (
                    "torch_sdpa"  # FA (sgl_kernel FA3) is not installed here
                )
            section["server_args"] = dict(kwargs)
            model, _ = gpu_common.load_fork_dit(model_dir, **kwargs)
            wrap_linears_for_lora(model, "default")
            section["lora_layers_set"] = gpu_common.push_lora_any(
                model,
                state_main,
                LORA_RANK,
                ALPHA_MAIN,
                merge=False,
                dtype=torch.bfloat16,
            )
            default_path.mount_default_quality(model)
            section["dispatch_constructed"] = gpu_common.dispatch_table(model)
            harness.install(model, qwen_module)
            if "ref_rope_device" not in refs:
                refs["ref_rope_device"] = make_reference(
                    masters, state_main, LORA_RANK, ALPHA_MAIN, args.device, "device"
                )
            gpu_standins.reset_calls()
            records = run_grid(
                {"default": model},
                {"ref_rope_device": refs["ref_rope_device"]},
                grid,
                args.device,
                joint_dim,
                deadline=max(deadline, time.monotonic() + 60),
            )
            summary = condense(records, set(), {"default~ref_rope_device"})
            strip_compared(records)
            ok &= all(s["as_expected"] for s in summary.values())
            section.update(summary=summary, records=records)
        except Exception:  # noqa: BLE001
            ok = False
            result["errors"]["default"] = gpu_common.format_exc()
        section["fallbacks"] = harness.report()
        section["standin_calls"] = gpu_standins.calls()
        section["wall_s"] = round(time.monotonic() - t0, 1)
        save()

    result["passed"] = ok and not result["errors"]
    save()
    print(f"wrote {out_path}")
    for name, sec in result["sections"].items():
        for key, s in (sec.get("summary") or {}).items():
            print(
                f"{name:13s} {key:42s} expect={s['expect']:6s} cases={s['cases']:3d} root_bitwise={s['root_bitwise']:3d} "
                f"all_pairs_bitwise={s['all_pairs_bitwise']:3d} max_root_ulp={s['root_max_ulp_max']} "
                f"first_div={s['first_divergences'][:3]} ok={s['as_expected']}"
            )
    default = result["sections"].get("default") or {}
    for f in default.get("fallbacks", []):
        print(
            f"default fallback: {f['op']}.{f['method']} -> {f['fallback']} x{f['instances']}: {f['error'][:120]}"
        )
    print("default attention probe:", default.get("attention_default_probe"))
    print("stand-in calls:", result.get("standin_calls"))
    print("fused kernels:", result.get("fused_kernels"))
    for name, err in result["errors"].items():
        print(f"ERROR in {name}:\n{err}")
    print("passed" if result["passed"] else "FAILED")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
