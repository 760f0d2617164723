# SPDX-License-Identifier: Apache-2.0
"""`sglang-train-parity check`: the sglang DiT against the training forward (diffusers + PEFT under
CUDA bf16 autocast; ltx-core + PEFT for LTX-2), module by module, on the same inputs and weights.

Every combination of the chosen batch sizes, text lengths, image sizes, frame counts (video
families) and timesteps is one case, run on every DiT of the model (both experts of Wan2.2 A14B).
Per case, every module output of both sides is recorded and the pairs compared (dtype, shape,
bitwise equal, max |diff|, max ULP). The report: a terminal table, report.json, and ulp.png (max
ULP distance per module in execution order, first divergence marked). Exit status 1 when any pair
differs, 2 on bad input.

The model: --model-path (a diffusers-layout folder of a family with a train_parity contract), or
an embedded tiny random model built locally: --model-id picks which (Qwen-Image by default).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import torch
from safetensors.torch import load_file
from sglang_train_parity import ltx2, qwen_image21, reference, wan
from sglang_train_parity.compare import compare_modules, first_divergence
from sglang_train_parity.cpu_kernels import register_cpu_kernels
from sglang_train_parity.families import FAMILIES, Family, family_of
from sglang_train_parity.sglang_dit import (
    load_dit,
    push_lora,
    sglang_forward,
    wrap_linears_for_lora,
)
from sglang_train_parity.tiny_model import build_tiny_qwen_image, default_model_dir
from tqdm import tqdm

from sglang.multimodal_gen.runtime.utils.train_parity import (
    NUMERICS_MODES,
    ROPE_TABLE_DEVICES,
)

# pixels per latent patch side: VAE downsampling (8) x patch size (2); Wan2.2 TI2V-5B's VAE
# downsamples by 16 (wan.WanLayout.pixels_per_patch)
LATENT_PIXELS = 16
NO_ULP = "-"  # shown for pairs that are not bf16 (RoPE tables, fp32 projections)
ROTARY_EMB = "rotary_emb"
ROPE_TABLES_HINT = (
    "rotary_emb differs first: the RoPE tables are built on another device than the "
    "trainer's. The server builds them where --train-parity-rope-tables says (device: on "
    "the GPU, as trainers that rebuild them there; cpu: as stock diffusers builds them); "
    "set it to where your trainer builds them."
)


class CheckError(Exception):
    """Bad input found after argument parsing; reported like an argparse error (exit 2)."""


@dataclass(frozen=True)
class Case:
    batch: int
    text_length: int
    height: int  # pixels
    width: int
    timestep: float
    frames: int | None = None  # video frames; None for an image family
    expert: str = "transformer"  # the model's DiT component

    def label(self) -> str:
        size = f"{self.height}x{self.width}"
        if self.frames is not None:
            size = f"{self.frames}x{size}"
        expert = "" if self.expert == "transformer" else f" {self.expert}"
        return f"b{self.batch} txt{self.text_length} {size} t{self.timestep:g}{expert}"


class QwenImageCheck:
    """What the check runs for Qwen-Image: one DiT, images, RoPE tables on either side."""

    video = False
    pixels_per_patch = LATENT_PIXELS
    tiny_model_ids = ("Qwen-Image",)
    trainer_chooses_rope_tables = True

    def __init__(self, model_dir: Path | None, model_id: str) -> None:
        self.model_id = model_id

    @staticmethod
    def model_id_of(model_dir: Path) -> str:
        return "Qwen-Image"

    @staticmethod
    def build_tiny(model_id: str, root: Path) -> Path:
        return build_tiny_qwen_image(root)

    @staticmethod
    def experts(model_dir: Path | None, model_id: str) -> tuple[str, ...]:
        return ("transformer",)

    @staticmethod
    def reference(masters, state, rank, alpha, device, rope_tables):
        return reference.build_reference(
            masters, state, rank, alpha, device=device, rope_tables=rope_tables
        )

    def forwards(self, dit, model, case: Case, seed: int, device: str):
        inputs = reference.QwenDiTInputs.random(
            case.batch,
            case.height // self.pixels_per_patch,
            case.width // self.pixels_per_patch,
            case.text_length,
            model.config.joint_attention_dim,
            case.timestep,
            seed=seed,
        )
        ours = sglang_forward(dit, inputs, device)
        return ours, reference.reference_forward(model, inputs, device)[1]


class QwenImage21Check(QwenImageCheck):
    """What the check runs for Qwen-Image 2.1 (text-to-image): as for Qwen-Image, with images
    in multiples of 32 pixels (its pipeline's; 16 pixels per latent token) and the prompts of
    a batch equally long."""

    pixels_per_patch = 32
    tiny_model_ids = (qwen_image21.MODEL_ID,)

    @staticmethod
    def model_id_of(model_dir: Path) -> str:
        return qwen_image21.MODEL_ID

    @staticmethod
    def build_tiny(model_id: str, root: Path) -> Path:
        if (root / "model_index.json").is_file():
            return root
        return qwen_image21.build_tiny_dit(root)

    @staticmethod
    def reference(masters, state, rank, alpha, device, rope_tables):
        return qwen_image21.build_reference(
            masters, state, rank, alpha, device=device, rope_tables=rope_tables
        )

    def forwards(self, dit, model, case: Case, seed: int, device: str):
        inputs = qwen_image21.QwenImage21DiTInputs.random(
            (case.text_length,) * case.batch,
            case.height // 16,
            case.width // 16,
            dict(model.config),
            case.timestep,
            seed=seed,
        )
        ours = qwen_image21.sglang_forward(dit, inputs, device)
        return ours, qwen_image21.reference_forward(model, inputs, device)[1]


class WanCheck:
    """What the check runs for Wan text-to-video: every expert of the model, video latents,
    per-token timesteps where the pipeline expands them (Wan2.2 TI2V-5B)."""

    video = True
    temporal_downsampling = 4
    tiny_model_ids = tuple(wan.TINY_VARIANTS)
    trainer_chooses_rope_tables = False

    def __init__(self, model_dir: Path, model_id: str) -> None:
        self.model_id = model_id
        layout = wan.WanLayout.of(model_dir)
        self.per_token = layout.per_token_timesteps
        self.pixels_per_patch = layout.pixels_per_patch

    @staticmethod
    def model_id_of(model_dir: Path) -> str:
        return wan.WanLayout.of(model_dir).model_id

    @staticmethod
    def build_tiny(model_id: str, root: Path) -> Path:
        if (root / "model_index.json").is_file():
            return root
        return wan.build_tiny_dits(root, model_id)

    @staticmethod
    def experts(model_dir: Path | None, model_id: str) -> tuple[str, ...]:
        """The folder's DiTs; without a folder, those of the embedded tiny model."""
        if model_dir is None:
            return wan.TINY_VARIANTS[model_id][1]
        return wan.WanLayout.of(model_dir).experts

    @staticmethod
    def reference(masters, state, rank, alpha, device, rope_tables):
        # diffusers' Wan builds its RoPE tables at construction, on the CPU
        return wan.build_reference(masters, state, rank, alpha, device)

    def forwards(self, dit, model, case: Case, seed: int, device: str):
        inputs = wan.WanDiTInputs.random(
            case.batch,
            (case.frames - 1) // self.temporal_downsampling + 1,
            2 * case.height // self.pixels_per_patch,
            2 * case.width // self.pixels_per_patch,
            case.text_length,
            dict(model.config),
            case.timestep,
            per_token=self.per_token,
            seed=seed,
        )
        ours = wan.sglang_forward(dit, inputs, device)
        return ours, wan.reference_forward(model, inputs, device)[1]


class LTX2Check:
    """What the check runs for LTX-2 text-to-video: video latents (the VAE's 8x temporal and 32x
    spatial downsampling), the audio tokens the pipeline pairs with the clip, both streams: the
    trainer's video stream alone and ltx-core's audio stream alone."""

    video = True
    temporal_downsampling = 8
    pixels_per_patch = 32
    tiny_model_ids = (ltx2.MODEL_ID,)
    trainer_chooses_rope_tables = False

    def __init__(self, model_dir: Path | None, model_id: str) -> None:
        self.model_id = model_id

    @staticmethod
    def model_id_of(model_dir: Path) -> str:
        return ltx2.MODEL_ID

    @staticmethod
    def build_tiny(model_id: str, root: Path) -> Path:
        if (root / "model_index.json").is_file():
            return root
        return ltx2.build_tiny_dit(root)

    @staticmethod
    def experts(model_dir: Path | None, model_id: str) -> tuple[str, ...]:
        return ("transformer",)

    @staticmethod
    def reference(masters, state, rank, alpha, device, rope_tables):
        # ltx-core builds its RoPE tables where the positions are, at every forward
        return ltx2.build_reference(masters, state, rank, alpha, device)

    def forwards(self, dit, model, case: Case, seed: int, device: str):
        inputs = ltx2.LTX2DiTInputs.random(
            case.batch,
            ltx2.latent_grid(case.frames, case.height, case.width),
            ltx2.audio_tokens(case.frames),
            case.text_length,
            ltx2.input_dims(model),
            case.timestep,
            seed=seed,
        )
        ours = ltx2.sglang_forward(dit, inputs, device)
        return ours, ltx2.reference_forward(model, inputs, device)[1]


# family name (families.FAMILIES) -> what the check runs for it
FAMILY_CHECKS = {
    "Qwen-Image": QwenImageCheck,
    "Qwen-Image 2.1 (text-to-image)": QwenImage21Check,
    "Wan (text-to-video)": WanCheck,
    "LTX-2 (text-to-video)": LTX2Check,
}
TINY_MODEL_IDS = tuple(
    i for check in FAMILY_CHECKS.values() for i in check.tiny_model_ids
)


def comma_list(convert):
    """argparse type: a comma-separated list of `convert`ed values."""

    def parse(text: str) -> list:
        try:
            values = [convert(item.strip()) for item in text.split(",")]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values

    parse.__name__ = convert.__name__  # argparse names the type in its errors
    return parse


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{text!r} is not a positive integer")
    return int(text)


def image_size(text: str) -> tuple[int, int]:
    """`N` (square) or `HxW`, in pixels; each side a positive multiple of 16."""
    match = re.fullmatch(r"(\d+)(?:x(\d+))?", text.lower())
    if match is None:
        raise ValueError(f"image size {text!r}: expected N or HxW (pixels)")
    size = (int(match[1]), int(match[2] or match[1]))
    if any(side < LATENT_PIXELS or side % LATENT_PIXELS for side in size):
        raise ValueError(
            f"image size {text!r}: each side must be a positive multiple of "
            f"{LATENT_PIXELS} pixels (one latent patch)"
        )
    return size


def video_frames(text: str) -> int:
    """Frames of a video: 4k + 1 (the VAE's temporal downsampling keeps the first frame)."""
    frames = positive_int(text)
    if frames % 4 != 1:
        raise ValueError(f"{text} frames: a video has 4k+1 frames (5, 9, 13, ...)")
    return frames


def timestep(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"timestep {text!r} is not a number") from None
    if not 0 <= value <= 1000:
        raise ValueError(f"timestep {text} is outside the scheduler's 0..1000")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-train-parity check",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: sglang-train-parity check --batch-sizes 1,2 --image-sizes 128,256x128 "
        "--timesteps 999,500\n"
        "negative control (must fail): sglang-train-parity check --numerics default",
    )
    model = parser.add_argument_group("model and adapter")
    model.add_argument(
        "--model-path",
        type=Path,
        metavar="DIR",
        help="diffusers-layout model folder (with transformer/); default: the tiny random "
        f"model of --model-id, built once into {default_model_dir('ID')}",
    )
    model.add_argument(
        "--model-id",
        metavar="ID",
        help="sglang's model id for the folder (default: read from its layout) or, without "
        f"--model-path, the embedded tiny model: {', '.join(TINY_MODEL_IDS)} (default "
        "Qwen-Image)",
    )
    model.add_argument(
        "--lora-rank",
        type=int,
        metavar="R",
        help="rank of a random LoRA adapter on all the family's trainer targets; 0: none "
        "(default 8 under train_parity, 0 under default: its packed Q/K/V projections take "
        "no PEFT adapter)",
    )
    model.add_argument(
        "--lora-alpha",
        type=int,
        metavar="A",
        help="alpha of the random adapter (default 12: scaling 1.5 at rank 8, not a power "
        "of two, so the scaling multiply rounds)",
    )
    model.add_argument(
        "--lora-path",
        type=Path,
        metavar="PATH",
        help="a PEFT adapter instead of a random one: a folder with adapter_config.json and "
        "adapter_model.safetensors, or a .safetensors file next to adapter_config.json",
    )
    model.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random inputs (+ case index) and adapter (default 0)",
    )
    cases = parser.add_argument_group(
        "cases (comma lists; every combination is one case)"
    )
    cases.add_argument(
        "--batch-sizes",
        type=comma_list(positive_int),
        default=[1, 2],
        metavar="LIST",
        help="(default 1,2)",
    )
    cases.add_argument(
        "--text-lengths",
        type=comma_list(positive_int),
        default=[7],
        metavar="LIST",
        help="prompt tokens, unpadded (default 7)",
    )
    cases.add_argument(
        "--image-sizes",
        type=comma_list(image_size),
        default=[(128, 128)],
        metavar="LIST",
        help="pixels, N or HxW, multiples of 16 (latent patch grid = size / 16; default 128)",
    )
    cases.add_argument(
        "--frames",
        type=comma_list(video_frames),
        metavar="LIST",
        help="video frames, 4k+1 (video families only; default 9: 3 latent frames)",
    )
    cases.add_argument(
        "--timesteps",
        type=comma_list(timestep),
        metavar="LIST",
        default=[999.0, 500.0],
        help="scheduler timesteps, 0..1000 (default 999,500)",
    )
    run = parser.add_argument_group("numerics and device")
    run.add_argument(
        "--numerics",
        choices=NUMERICS_MODES,
        default="train_parity",
        help="sglang's numerics mode (default train_parity; default is the negative "
        "control, expected to differ)",
    )
    run.add_argument(
        "--train-parity-rope-tables",
        choices=ROPE_TABLE_DEVICES,
        default=ROPE_TABLE_DEVICES[0],
        help="where the server builds the RoPE tables: device (its default, as trainers "
        "that rebuild them on the GPU do) or cpu (as stock diffusers does); default device",
    )
    run.add_argument(
        "--trainer-rope-tables",
        choices=ROPE_TABLE_DEVICES,
        help="where the trainer builds them (Qwen-Image and 2.1; default: as the server); "
        "a mismatch shows as rotary_emb (2.1: the first attention's to_out.0) differing "
        "first",
    )
    run.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: CUDA's autocast policy emulated; cuda: real autocast, reference "
        "attention _native_flash (default cpu)",
    )
    report = parser.add_argument_group("report")
    report.add_argument(
        "--out-dir",
        type=Path,
        metavar="DIR",
        default=Path("parity-report"),
        help="where report.json and ulp.png go (default parity-report/)",
    )
    report.add_argument(
        "--all-modules",
        action="store_true",
        help="print every paired module, not just the diverging ones",
    )
    report.add_argument(
        "--max-rows",
        type=int,
        metavar="N",
        default=40,
        help="module rows printed at most; 0: no limit (default 40)",
    )
    return parser


def resolve_lora(args, parser) -> None:
    """Fill args.lora_rank / lora_alpha; with --lora-path, from its adapter_config.json."""
    if args.lora_path is None:
        if args.lora_rank is None:
            args.lora_rank = 8 if args.numerics == "train_parity" else 0
        args.lora_alpha = 12 if args.lora_alpha is None else args.lora_alpha
        if args.lora_rank < 0 or (args.lora_rank and args.lora_alpha <= 0):
            parser.error("--lora-rank must be >= 0 and --lora-alpha > 0")
        return
    if args.lora_rank is not None or args.lora_alpha is not None:
        parser.error(
            "--lora-path takes rank and alpha from its adapter_config.json; "
            "drop --lora-rank / --lora-alpha"
        )
    folder = args.lora_path if args.lora_path.is_dir() else args.lora_path.parent
    weights = (
        folder / "adapter_model.safetensors"
        if args.lora_path.is_dir()
        else args.lora_path
    )
    config_file = folder / "adapter_config.json"
    if not (weights.is_file() and weights.suffix == ".safetensors"):
        parser.error(f"--lora-path: no safetensors adapter at {weights}")
    if not config_file.is_file():
        parser.error(f"--lora-path: no {config_file}")
    config = json.loads(config_file.read_text())
    unsupported = [k for k in ("use_dora", "use_rslora") if config.get(k)]
    unsupported += [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
    if unsupported:
        parser.error(
            f"--lora-path: {', '.join(unsupported)} is not covered by train_parity "
            "(docs/numerics-contract.md): plain LoRA only"
        )
    args.lora_path = weights
    args.lora_rank, args.lora_alpha = config["r"], config["lora_alpha"]


def resolve_model(args, parser) -> None:
    """Fill args.family_check (the family's FAMILY_CHECKS entry) and args.model_id, from
    --model-path's layout or the embedded tiny model --model-id names."""
    if args.model_path is None:
        args.model_id = args.model_id or "Qwen-Image"
        check = next(
            (c for c in FAMILY_CHECKS.values() if args.model_id in c.tiny_model_ids),
            None,
        )
        if check is None:
            parser.error(
                f"--model-id {args.model_id!r}: no embedded tiny model; give --model-path, "
                f"or one of: {', '.join(TINY_MODEL_IDS)}"
            )
        args.family_check = check
        return
    config = args.model_path / "transformer" / "config.json"
    if not config.is_file():
        parser.error(
            f"--model-path {args.model_path}: not a diffusers-layout model "
            "(no transformer/config.json)"
        )
    transformer_class = json.loads(config.read_text()).get("_class_name")
    family: Family | None = family_of(transformer_class)
    if family is None:
        parser.error(
            f"--model-path: transformer class {transformer_class!r} is no train_parity "
            f"family's; supported: {', '.join(f.diffusers_class for f in FAMILIES)}"
        )
    args.family_check = FAMILY_CHECKS[family.name]
    args.model_id = args.model_id or args.family_check.model_id_of(args.model_path)


def validate(args, parser) -> None:
    resolve_model(args, parser)
    check = args.family_check
    if args.frames is not None and not check.video:
        parser.error(f"--frames: {args.model_id} is an image model")
    if check.video:
        args.frames = args.frames or [9]
        step = check.temporal_downsampling
        if any((frames - 1) % step for frames in args.frames):
            parser.error(
                f"--frames: {args.model_id}'s VAE keeps the first frame and downsamples the "
                f"rest by {step}: give {step}k+1 frames"
            )
    if args.trainer_rope_tables is not None and not check.trainer_chooses_rope_tables:
        parser.error(
            f"--trainer-rope-tables: {args.model_id}'s trainer builds its RoPE tables in one "
            "place (diffusers' Wan at construction, on the CPU; ltx-core where the positions "
            "are); only Qwen-Image's trainers choose"
        )
    if args.max_rows < 0:
        parser.error("--max-rows must be >= 0")
    if find_spec("matplotlib") is None:  # not an sglang dependency; fail before the run
        parser.error("the ulp.png plot needs matplotlib: pip install matplotlib")
    experts = check.experts(args.model_path, args.model_id)
    if args.lora_path is not None and len(experts) > 1:
        parser.error(
            f"--lora-path: {args.model_id} has {len(experts)} experts, each with its own "
            "adapter; check it with random adapters (--lora-rank)"
        )
    resolve_lora(args, parser)
    if args.lora_rank and args.numerics != "train_parity":
        parser.error(
            "a LoRA adapter needs --numerics train_parity: the default numerics pack "
            "Q/K/V projections into one Linear (Qwen-Image's text to_added_qkv, Wan's "
            "self-attention to_qkv), which PEFT's per-projection adapter does not address; "
            "use --lora-rank 0"
        )
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error(
                "--device cuda: CUDA is not available here (torch sees no GPU)"
            )


def load_lora_file(path: Path) -> dict:
    """A PEFT adapter's tensors, keyed as `get_peft_model_state_dict` names them."""
    # PeftModel.save_pretrained prefixes `base_model.model.`, diffusers' pipelines `transformer.`.
    prefixes = ("base_model.model.", "transformer.")
    state = {}
    for key, tensor in load_file(path).items():
        for prefix in prefixes:
            key = key.removeprefix(prefix)
        state[key] = tensor
    return state


def load_models(args, family, model_dir: Path, expert: str, seed: int):
    """The sglang DiT `expert` of `model_dir` and the trainer's model of the same masters, LoRA
    in both when asked (a random adapter drawn from `seed`)."""
    import diffusers

    if args.numerics == "default" and args.device == "cpu":
        register_cpu_kernels()  # upstream's default norms call sgl_kernel CPU ops
    server_kwargs = {"numerics": args.numerics}
    if args.numerics == "train_parity":  # sglang refuses the option in other modes
        server_kwargs["train_parity_rope_tables"] = args.train_parity_rope_tables
    try:
        dit = load_dit(model_dir, args.model_id, expert, **server_kwargs)
    except ValueError as e:  # sglang's own option and model checks
        raise CheckError(f"sglang refused the model or options: {e}") from e
    spec = family_of(
        json.loads((model_dir / expert / "config.json").read_text())["_class_name"]
    )
    masters = getattr(diffusers, spec.diffusers_class).from_pretrained(
        model_dir / expert, torch_dtype=torch.float32
    )
    state = None
    if args.lora_path is not None:
        state = load_lora_file(args.lora_path)
    elif args.lora_rank:
        state = reference.random_lora_state(
            masters, args.lora_rank, args.lora_alpha, seed, spec.lora_targets
        )
    try:
        # first: it checks the adapter against PEFT's targets, with a clear message
        model = family.reference(
            masters,
            state,
            args.lora_rank,
            args.lora_alpha,
            args.device,
            args.trainer_rope_tables or args.train_parity_rope_tables,
        )
        if state is not None:
            wrap_linears_for_lora(dit, args.numerics)
            push_lora(dit, state, args.lora_rank, args.lora_alpha)
    except (ValueError, AttributeError, KeyError) as e:  # no such module on either side
        raise CheckError(f"LoRA adapter: {e}") from e
    return dit, model, spec.pair_of


def run_cases(args, family, model_dir: Path, cases: list[Case]) -> list[dict]:
    results = []
    progress = tqdm(total=len(cases), desc="parity", unit="case", disable=None)
    for expert_index, expert in enumerate(family.experts(model_dir, args.model_id)):
        seed = args.seed + 100 * expert_index
        dit, model, pair_of = load_models(args, family, model_dir, expert, seed)
        for index, case in enumerate(cases):
            case = replace(case, expert=expert)
            ours, theirs = family.forwards(
                dit, model, case, args.seed + index, args.device
            )
            pairs = compare_modules(ours, theirs, args.lora_rank > 0, pair_of)
            results.append(
                {
                    **asdict(case),
                    "equal": all(p["equal"] for p in pairs),
                    "first_divergence": first_divergence(pairs),
                    "pairs": pairs,
                }
            )
            progress.update()
        del dit, model
    progress.close()
    return results


def summarize_modules(results: list[dict]) -> list[dict]:
    """Per module, in execution order (`index`), over all cases: equal in all, in how many,
    worst |diff| and ULP."""
    modules: dict[str, dict] = {}
    for result in results:
        for pair in result["pairs"]:
            row = modules.setdefault(
                pair["sglang"],
                {
                    "index": len(modules),
                    "sglang": pair["sglang"],
                    "diffusers": pair["diffusers"],
                    "dtype": pair["dtype"],
                    "shape": pair["shape"],  # of the first case
                    "cases_equal": 0,
                    "cases": 0,
                    "max_abs_diff": None,
                    "max_ulp": None,
                },
            )
            row["cases"] += 1
            row["cases_equal"] += pair["equal"]
            for key in ("max_abs_diff", "max_ulp"):
                if pair[key] is not None:
                    row[key] = max(pair[key], row[key] or 0)
    for row in modules.values():
        row["equal"] = row["cases_equal"] == row["cases"]
    return list(modules.values())


def print_report(modules: list[dict], results: list[dict], args) -> None:
    print(f"\n{'case':<36} {'pairs equal':>11}  first divergence")
    for result in results:
        case = Case(**{k: result[k] for k in Case.__dataclass_fields__})
        equal = sum(p["equal"] for p in result["pairs"])
        print(
            f"{case.label():<36} {equal:>5}/{len(result['pairs']):<5}  "
            f"{result['first_divergence'] or '-'}"
        )

    diverging = [m for m in modules if not m["equal"]]
    rows = modules if args.all_modules else diverging
    shown = rows[: args.max_rows or None]
    if shown:
        width = max(len(m["sglang"] or "(output)") for m in shown)
        print(
            f"\n{'#':>4}  {'module':<{width}}  {'dtype':<9} {'shape (1st case)':<18} "
            f"{'equal':>7}  {'max |diff|':>10}  {'max ULP':>7}"
        )
        for m in shown:
            shape = "x".join(map(str, m["shape"]))
            ulp = NO_ULP if m["max_ulp"] is None else m["max_ulp"]
            diff = "-" if m["max_abs_diff"] is None else f"{m['max_abs_diff']:.3g}"
            print(
                f"{m['index']:>4}  {m['sglang'] or '(output)':<{width}}  "
                f"{m['dtype']:<9} {shape:<18} {m['cases_equal']:>3}/{m['cases']:<3}  "
                f"{diff:>10}  {ulp:>7}"
            )
        if len(rows) > len(shown):
            print(f"  ... {len(rows) - len(shown)} more rows in report.json")

    outputs = (
        f"report: {args.out_dir / 'report.json'}, plot: {args.out_dir / 'ulp.png'}"
    )
    if not diverging:
        print(
            f"\nPASS: all {len(modules)} paired modules bitwise equal in all "
            f"{len(results)} cases ({outputs})"
        )
        return
    first = diverging[0]
    print(
        f"\nFAIL: {len(diverging)} of {len(modules)} paired modules differ in "
        f"{sum(not r['equal'] for r in results)} of {len(results)} cases; first divergence: "
        f"{first['sglang'] or '(output)'} (#{first['index']}, max ULP "
        f"{first['max_ulp'] if first['max_ulp'] is not None else NO_ULP}) ({outputs})"
    )
    if first["sglang"] == ROTARY_EMB:
        print(ROPE_TABLES_HINT)


def plot_ulp(modules: list[dict], path: Path, title: str) -> None:
    """Max ULP distance per module in execution order (symlog: 0 stays visible); modules
    that differ without a bf16 ULP (complex RoPE tables, fp32) drawn as crosses at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(modules))
    ulp = [m["max_ulp"] or 0 for m in modules]
    colors = ["tab:red" if u else "tab:green" for u in ulp]
    no_ulp = [m["index"] for m in modules if m["max_ulp"] is None and not m["equal"]]
    fig, ax = plt.subplots(figsize=(min(30, max(10, len(modules) / 6)), 6))
    ax.plot(x, ulp, color="0.7", linewidth=0.8, zorder=1)
    ax.scatter(x, ulp, c=colors, s=14, zorder=2)
    if no_ulp:
        ax.scatter(
            no_ulp,
            [1] * len(no_ulp),
            marker="x",
            color="tab:purple",
            label="differs, not bf16 (no ULP)",
        )
        ax.legend(loc="upper left")
    first = next((m for m in modules if not m["equal"]), None)
    if first is not None:
        ax.axvline(first["index"], color="tab:red", linestyle="--", linewidth=1)
        ax.annotate(
            f"first divergence: {first['sglang'] or '(output)'}",
            (first["index"], 0.5),  # mid-height: clear of the points
            xycoords=("data", "axes fraction"),
            xytext=(4, 0),
            textcoords="offset points",
            color="tab:red",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8},
        )
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(0, max(10, 2 * max(ulp)))  # headroom for the label; a scale when all 0
    step = max(1, len(modules) // 80)  # keep tick labels legible on full-size models
    ax.set_xticks(list(x)[::step])
    ax.set_xticklabels(
        [m["sglang"] or "(output)" for m in modules][::step], rotation=90, fontsize=6
    )
    ax.set_xlabel("module (execution order)")
    ax.set_ylabel("max ULP distance (bf16), over all cases")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: str) -> dict:
    """What the bits depend on: package versions (the fork's own included) and the device."""
    packages = {
        name: version(name) for name in ("sglang", "torch", "diffusers", "peft")
    }
    return {
        **packages,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }


def check(args) -> bool:
    """Run every case, write the report; True when every pair is bitwise equal."""
    if args.numerics == "default" and args.device == "cpu":
        # upstream compiles forward_native on CPU (slow, needs a C++ toolchain). This is what
        # TORCH_COMPILE_DISABLE=1 sets; the variable is read when torch is imported, too late here.
        torch._dynamo.config.disable = True

    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_path
    if model_dir is None:
        model_dir = args.family_check.build_tiny(
            args.model_id, default_model_dir(args.model_id)
        )
    family = args.family_check(model_dir, args.model_id)
    for height, width in args.image_sizes:
        if height % family.pixels_per_patch or width % family.pixels_per_patch:
            raise CheckError(
                f"image size {height}x{width}: {args.model_id}'s sides are multiples of "
                f"{family.pixels_per_patch} pixels (one latent patch)"
            )
    cases = [
        Case(batch, text_length, height, width, t, frames)
        for batch, text_length, (height, width), frames, t in itertools.product(
            args.batch_sizes,
            args.text_lengths,
            args.image_sizes,
            args.frames or [None],
            args.timesteps,
        )
    ]
    results = run_cases(args, family, model_dir, cases)
    modules = summarize_modules(results)
    equal = all(r["equal"] for r in results)
    first = next((m["sglang"] for m in modules if not m["equal"]), None)
    report = {
        "equal": equal,
        "first_divergence": first,
        "model_path": str(model_dir),
        "model_id": args.model_id,
        "experts": list(family.experts(model_dir, args.model_id)),
        "numerics": args.numerics,
        "train_parity_rope_tables": args.train_parity_rope_tables,
        "trainer_rope_tables": args.trainer_rope_tables
        or args.train_parity_rope_tables,
        "first_divergence_hint": ROPE_TABLES_HINT if first == ROTARY_EMB else None,
        "lora": (
            {
                "path": str(args.lora_path) if args.lora_path else None,
                "rank": args.lora_rank,
                "alpha": args.lora_alpha,
            }
            if args.lora_rank
            else None
        ),
        "seed": args.seed,
        "environment": environment(args.device),
        "modules": modules,
        "cases": results,
    }
    (args.out_dir / "report.json").write_text(json.dumps(report, indent=1))
    plot_ulp(
        modules,
        args.out_dir / "ulp.png",
        f"sglang --numerics {args.numerics} vs diffusers + PEFT ({args.device}, "
        f"{len(cases)} cases): {'bitwise equal' if equal else 'differs'}",
    )
    print_report(modules, results, args)
    return equal


def main(argv: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(args, parser)
    try:
        equal = check(args)
    except CheckError as e:
        parser.error(str(e))
    sys.exit(0 if equal else 1)
