"""Proof, on an NVIDIA GPU, that the fork's train_parity/autocast_emulation.py policy is CUDA autocast's.

For each op and input dtype combination:

* same device (must hold): real ``torch.autocast("cuda", bf16)`` on CUDA tensors vs the policy's casts
  applied explicitly to the same CUDA tensors with autocast off (``apply_policy``): output dtype equal
  and values bitwise equal (bit distance of the output words reported where not);
* CPU emulation (dtype must hold, values reported only): ``cuda_autocast("cpu")`` on the inputs moved
  to the CPU; reductions and GEMMs may round differently across devices.

Also checks that the policy names exactly the ops this torch registers AutocastCUDA kernels for.
Needs only torch (runs with torch 2.11 as on the H200 image). ``--dry-run`` runs on a CPU machine:
the emulated CPU autocast stands in for real CUDA autocast and the cross-device part is skipped.
Exits non-zero on any dtype mismatch, same-device value mismatch or policy/registration difference.

    python benchmark/autocast_emulation_proof.py [--out PATH] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fork_modules import load_tool  # noqa: E402

# The policy lives in one place, the fork's module; loaded by path: this proof needs only torch.
_emulation = load_tool("autocast_emulation")
CUDA_POLICY, apply_policy, cuda_autocast = (
    _emulation.CUDA_POLICY,
    _emulation.apply_policy,
    _emulation.cuda_autocast,
)

DTYPES = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
    "c64": torch.complex64,
}
# aten/src/ATen/cudnn/AutocastRNN.cpp: a cuDNN-only op with its own cast rule, not modelled.
NOT_MODELLED = {"_cudnn_rnn"}


class Case(NamedTuple):
    op_name: str  # aten overload, as in CUDA_POLICY
    shapes: tuple[tuple[int, ...], ...]  # the tensor inputs
    build: Callable[[list[torch.Tensor]], tuple]  # tensors -> the op's positional args
    combos: tuple[str, ...] = ("bf16", "fp32", "mixed")  # "mixed" only where 2+ tensors
    positive: bool = False  # inputs in [0.5, 1.5) (rsqrt, log, norm weights)
    kwargs: dict[str, Any] = {}
    label: str = ""  # where one op has several cases


def _args(*head: Any) -> Callable[[list[torch.Tensor]], tuple]:
    """Tensors first, then the fixed trailing arguments `head`."""
    return lambda t: (*t, *head)


S, D, H = 64, 256, 128
CASES = [
    Case(
        "linear",
        ((S, D), (2 * D, D), (2 * D,)),
        _args(),
        ("bf16", "fp32", "mixed", "fp64"),
    ),
    Case("matmul", ((S, D), (D, H)), _args()),
    Case("mm", ((S, D), (D, H)), _args()),
    Case("addmm", ((H,), (S, D), (D, H)), _args()),
    Case("bmm", ((4, S, 32), (4, 32, S)), _args()),
    Case("baddbmm", ((4, S, S), (4, S, 32), (4, 32, S)), _args()),
    Case("scaled_dot_product_attention", ((1, 4, S, H),) * 3, _args()),
    Case("layer_norm", ((S, D),), _args([D], None, None, 1e-6)),
    Case(
        "layer_norm",
        ((S, D), (D,), (D,)),
        lambda t: (t[0], [D], t[1], t[2], 1e-6),
        positive=True,
        label="layer_norm (affine)",
    ),
    Case("group_norm", ((2, 8, 16, 16), (8,), (8,)), lambda t: (t[0], 4, t[1], t[2])),
    Case("rms_norm", ((S, D), (D,)), lambda t: (t[0], [D], t[1], 1e-6), positive=True),
    Case("pow.Tensor_Scalar", ((S, D),), _args(2)),
    Case("pow.Tensor_Tensor", ((S, D), (S, D)), _args(), positive=True),
    Case("pow.Scalar", ((H,),), lambda t: (10000, t[0]), ("bf16", "fp32")),
    Case("rsqrt", ((S, D),), _args(), positive=True),
    Case("exp", ((S, D),), _args(), ("bf16", "fp32", "fp64")),
    Case("log", ((S, D),), _args(), positive=True),
    Case("sum", ((S, D),), _args()),
    Case("sum.dim_IntList", ((S, D),), _args([-1])),
    Case("mean.dim", ((S, D),), _args([-1], True)),
    Case("softmax.int", ((S, D),), _args(-1)),
    Case("log_softmax.int", ((S, D),), _args(-1)),
    Case("linalg_vector_norm", ((S, D),), _args(2)),
    Case("norm.Scalar", ((S, D),), _args(2)),
    Case("norm.ScalarOpt_dim", ((S, D),), _args(2, [-1])),
    Case("gelu", ((S, D),), _args(), kwargs={"approximate": "tanh"}),
    Case("silu", ((S, D),), _args()),
    Case("add.Tensor", ((S, D), (S, D)), _args()),
    Case("mul.Tensor", ((S, D), (S, D)), _args(), ("bf16", "fp32", "mixed", "c64")),
    Case("cat", ((S, D), (S, D)), lambda t: (t,)),
    Case("stack", ((S, D), (S, D)), lambda t: (t,)),
    Case("addcmul", ((S, D),) * 3, _args()),
    Case("polar", ((S,), (S,)), _args(), ("fp32",), positive=True),
    Case("view_as_complex", ((S, H // 2, 2),), _args(), ("fp32",)),
]


def _op(op_name: str) -> torch._ops.OpOverload:
    packet, _, overload = op_name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _inputs(case: Case, combo: str, seed: int) -> list[torch.Tensor]:
    """CPU tensors; "mixed" alternates fp32 and bf16, starting with fp32."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for i, shape in enumerate(case.shapes):
        dtype = DTYPES[("fp32", "bf16")[i % 2]] if combo == "mixed" else DTYPES[combo]
        source = torch.complex128 if combo == "c64" else torch.float64
        t = torch.randn(shape, generator=generator, dtype=source)
        if case.positive:
            t = t.abs().remainder(1) + 0.5
        tensors.append(t.to(dtype))
    return tensors


def _bit_distance(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Largest difference of the outputs' raw words (ULPs for same-sign bf16/fp32 values)."""
    words = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(a.dtype)
    if words is None or a.dtype != b.dtype or a.shape != b.shape:
        return None
    return int((a.view(words).long() - b.view(words).long()).abs().max())


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = a.to(torch.complex128) - b.to(torch.complex128)
    return float(diff.abs().max()) if diff.numel() else 0.0


def _to(args: tuple, device: str) -> tuple:
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, list):
            return [move(item) for item in x]
        return x

    return tuple(move(x) for x in args)


def run_case(case: Case, combo: str, seed: int, device: str) -> dict[str, Any]:
    cpu_args = case.build(_inputs(case, combo, seed))
    args = _to(cpu_args, device)
    op = _op(case.op_name)
    with cuda_autocast(device):
        real = op(*args, **case.kwargs)
    policy = apply_policy(case.op_name, args, case.kwargs, device_type=device)
    row = {
        "op": case.label or case.op_name,
        "inputs": combo,
        "policy": CUDA_POLICY.get(case.op_name, "none"),
        "autocast_dtype": str(real.dtype),
        "policy_dtype": str(policy.dtype),
        "dtype_equal": real.dtype == policy.dtype,
        "bitwise_equal": real.dtype == policy.dtype and torch.equal(real, policy),
        "max_bit_distance": _bit_distance(real, policy),
    }
    if device == "cuda":
        with cuda_autocast("cpu"):
            emulated = op(*cpu_args, **case.kwargs)
        row["cpu_emulation_dtype"] = str(emulated.dtype)
        row["cpu_dtype_equal"] = emulated.dtype == real.dtype
        row["cpu_max_abs_diff"] = _max_abs_diff(emulated, real.cpu())
    return row


def registration_differences() -> dict[str, list[str]]:
    registered = {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_registrations_for_dispatch_key(
            "AutocastCUDA"
        )
    }
    return {
        "registered_not_in_policy": sorted(
            registered - NOT_MODELLED - set(CUDA_POLICY)
        ),
        "policy_not_registered": sorted(set(CUDA_POLICY) - registered),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmark/results/autocast_emulation_proof.json",
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU only: skip CUDA")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    if not options.dry_run and not torch.cuda.is_available():
        parser.error("CUDA is not available (use --dry-run on a CPU machine)")
    device = "cpu" if options.dry_run else "cuda"

    rows = [
        run_case(case, combo, options.seed, device)
        for case in CASES
        for combo in case.combos
        if combo != "mixed" or len(case.shapes) > 1
    ]
    registrations = registration_differences()

    header = f"{'op':<30} {'inputs':<6} {'policy':<19} {'autocast':<15} {'policy casts':<15} bitwise"
    if device == "cuda":
        header += f"  {'cpu emulation':<15} cpu max|diff|"
    print(header)
    for row in rows:
        bits = "yes" if row["bitwise_equal"] else f"NO ({row['max_bit_distance']} bits)"
        line = (
            f"{row['op']:<30} {row['inputs']:<6} {row['policy']:<19} {row['autocast_dtype']:<15} "
            f"{row['policy_dtype']:<15} {bits}"
        )
        if device == "cuda":
            mark = "" if row["cpu_dtype_equal"] else " (DTYPE MISMATCH)"
            line += f"  {row['cpu_emulation_dtype'] + mark:<15} {row['cpu_max_abs_diff']:.3g}"
        print(line)
    print(f"AutocastCUDA registrations vs policy: {registrations}")

    failures = [
        r
        for r in rows
        if not (
            r["dtype_equal"] and r["bitwise_equal"] and r.get("cpu_dtype_equal", True)
        )
    ]
    failed = bool(failures) or any(registrations.values())
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "device": (
                    torch.cuda.get_device_name()
                    if device == "cuda"
                    else "cpu (dry run)"
                ),
                "dry_run": options.dry_run,
                "seed": options.seed,
                "passed": not failed,
                "registrations": registrations,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"{len(rows) - len(failures)}/{len(rows)} rows pass; wrote {options.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
