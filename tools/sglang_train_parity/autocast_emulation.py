"""CUDA autocast's bf16 cast policy, as data, applied on any device.

Why: the training forward that train_parity must reproduce runs under ``torch.autocast("cuda", bf16)``,
but CI has no GPU, and ``torch.autocast("cpu", bf16)`` follows a different op policy. CUDA runs
``layer_norm``, ``group_norm``, ``pow``, ``rsqrt``, ``exp``, ``softmax``, ``sum``, ``linalg_vector_norm``,
... in fp32, CPU autocast leaves them in bf16; CPU autocast casts ops CUDA leaves alone (``cat``/``stack``
promote, ``polar``/``view_as_complex``/fft/linalg in fp32); matmul-like lists differ in details
(``einsum``, ``addmv``, ``mv``, ``convolution``, ``_addmm_activation``, ...). A CPU test under plain
CPU autocast therefore checks a forward with other dtypes than the trainer's.

What: the CUDA lists of ``aten/src/ATen/autocast_mode.{h,cpp}`` (torch 2.14, plus the overloads
torch 2.11 still had) with the semantics of their C++ wrappers (``cached_cast``, ``set_opt_dtype``,
``promote_type``):

* ``cuda_autocast(device_type)``: for "cuda", exactly ``torch.autocast("cuda", dtype=torch.bfloat16)``;
  for "cpu", ``torch.autocast("cpu", dtype=torch.bfloat16)`` after replacing, once per process, every
  ``AutocastCPU`` kernel with CUDA's rule for that op (a policy kernel, or a fallthrough where CUDA
  has no rule). ``AutocastCPU`` kernels only run while CPU autocast is enabled, so code outside CPU
  autocast is unaffected; inside any CPU autocast region of the process the CUDA policy applies.
* ``apply_policy(op_name, args, kwargs, device_type=...)``: runs one aten overload with CUDA
  autocast's casts done explicitly, outside autocast, on tensors of any device (the GPU proof,
  sglang-train-parity's benchmark/autocast_emulation_proof.py compares it bitwise with
  real CUDA autocast).
* ``CUDA_POLICY``: aten overload name -> cast policy, for the installed torch.

The policy follows the installed torch. Between the trainer's torch 2.11 and CI's 2.14 one rule
differs: ``rms_norm`` is fp32 from torch 2.12 on, so ``F.rms_norm`` under autocast gives bf16 on the
trainer and fp32 here. The diffusers Qwen-Image forward never calls it (its RMSNorm is written out).

Not emulated: the cast cache (it reuses earlier casts of fp32 leaf weights; same values) and
``_cudnn_rnn``'s own cuDNN rule (aten/src/ATen/cudnn/AutocastRNN.cpp).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

# Cast every floating input on the autocast device to the autocast dtype (bf16 here).
LOWER_PRECISION_FP = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    # Registered in autocast_mode.cpp's CUDA block, not in the header's shared lists.
    "cudnn_convolution",
    "cudnn_convolution_transpose",
)

# Cast every floating input on the autocast device to fp32.
FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
    # New in torch 2.14; registered in autocast_mode.cpp's CUDA block (fp32 checked via fake CUDA).
    "linalg_matrix_sqrth",
)

# If the first argument is eligible, run with dtype=fp32 unless the caller gave a dtype.
FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "prod.dim_Dimname",
    "softmax.int",
    "softmax.Dimname",
    "log_softmax.int",
    "log_softmax.Dimname",
    "cumprod",
    "cumprod.dimname",
    "cumsum",
    "cumsum.dimname",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
    "sum.dim_DimnameList",
)

# Redispatch to the overload with a trailing dtype: fp32 if the first argument is eligible, else its own.
FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}

# Cast eligible inputs to the widest floating type among the Tensor / Tensor[] arguments.
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)

# CUDA autocast raises for these (CPU autocast runs them in fp32).
BANNED = ("binary_cross_entropy",)

# Entries not in every torch: rms_norm joined CUDA's fp32 list in torch 2.12 (pytorch#174824; torch
# 2.11, the trainer's, leaves it in the input dtype). Overloads a torch lacks (the Dimname ones after
# 2.11, linalg_matrix_sqrth before 2.14) are dropped by _exists.
_FIRST_TORCH = {"rms_norm": "2.12"}


def _overload(op_name: str) -> torch._ops.OpOverload:
    packet, _, overload = op_name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _exists(op_name: str) -> bool:
    try:
        _overload(op_name)
    except AttributeError:
        return False
    return True


def _policy_for_installed_torch() -> dict[str, str]:
    lists = {
        "lower_precision_fp": LOWER_PRECISION_FP,
        "fp32": FP32,
        "fp32_set_opt_dtype": FP32_SET_OPT_DTYPE,
        "fp32_append_dtype": tuple(FP32_APPEND_DTYPE),
        "promote": PROMOTE,
        "banned": BANNED,
    }
    return {
        op_name: policy
        for policy, op_names in lists.items()
        for op_name in op_names
        if _exists(op_name) and torch.__version__ >= _FIRST_TORCH.get(op_name, "0")
    }


# aten overload name ("sum.dim_IntList"; "linear" for the default overload) -> CUDA cast policy.
CUDA_POLICY = _policy_for_installed_torch()


def _eligible(x: Any, device_type: str) -> bool:
    """autocast's is_eligible: a floating (not fp64, not complex) tensor on the autocast device."""
    return (
        isinstance(x, torch.Tensor)
        and x.device.type == device_type
        and x.is_floating_point()
        and x.dtype != torch.float64
    )


def _cast(x: Any, dtype: torch.dtype, device_type: str) -> Any:
    """autocast's cached_cast, on a Tensor, None, or a list of tensors; other values pass through."""
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(item, dtype, device_type) for item in x)
    if _eligible(x, device_type) and x.dtype != dtype:
        return x.to(dtype)
    return x


def _promote_type(
    schema: torch._C.FunctionSchema,
    values: dict[str, Any],
    lower_dtype: torch.dtype,
    device_type: str,
) -> torch.dtype:
    """autocast's promote_type: only Tensor and Tensor[] arguments vote (not Tensor? ones); fp64 abstains."""
    dtype = lower_dtype
    for arg in schema.arguments:
        if isinstance(arg.type, torch.TensorType):
            voters = [values[arg.name]]
        elif isinstance(arg.type, torch.ListType) and isinstance(
            arg.type.getElementType(), torch.TensorType
        ):
            voters = values[arg.name]
        else:
            continue
        for t in voters:
            if not _eligible(t, device_type) or t.dtype == dtype:
                continue
            if torch.float32 not in (dtype, t.dtype):
                raise RuntimeError(
                    "Unexpected floating ScalarType in at::autocast::prioritize"
                )
            dtype = torch.float32
    return dtype


def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Schema argument name -> value, with defaults filled in (a Python kernel gets trailing defaults
    left out, and fp32_append_dtype calls another overload)."""
    values = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            values[arg.name] = args[i]
        elif arg.name in kwargs:
            values[arg.name] = kwargs[arg.name]
        else:
            values[arg.name] = arg.default_value
    return values


def _call(op: torch._ops.OpOverload, values: dict[str, Any]) -> Any:
    arguments = op._schema.arguments
    positional = [values[a.name] for a in arguments if not a.kwarg_only]
    keyword = {a.name: values[a.name] for a in arguments if a.kwarg_only}
    return op(*positional, **keyword)


def apply_policy(
    op_name: str,
    args: tuple,
    kwargs: dict | None = None,
    *,
    device_type: str,
    lower_dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """Run aten overload `op_name` with the casts CUDA autocast applies to it, treating tensors on
    `device_type` as the autocast device's. Call it with autocast off; ops without a policy run as is.
    """
    policy = CUDA_POLICY.get(op_name)
    if policy == "banned":
        raise RuntimeError(
            f"aten::{op_name} is unsafe to autocast (CUDA autocast bans it)"
        )
    op = _overload(op_name)
    values = _bind(op, args, kwargs or {})
    first = values[op._schema.arguments[0].name]
    if policy in ("lower_precision_fp", "fp32", "promote"):
        dtype = {
            "lower_precision_fp": lower_dtype,
            "fp32": torch.float32,
            "promote": _promote_type(op._schema, values, lower_dtype, device_type),
        }[policy]
        values = {name: _cast(v, dtype, device_type) for name, v in values.items()}
    elif policy == "fp32_set_opt_dtype":
        if _eligible(first, device_type) and values["dtype"] is None:
            values["dtype"] = torch.float32
    elif policy == "fp32_append_dtype":
        values["dtype"] = (
            torch.float32 if _eligible(first, device_type) else first.dtype
        )
        op = _overload(FP32_APPEND_DTYPE[op_name])
    return _call(op, values)


_NO_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _cpu_kernel(op_name: str):
    def kernel(*args, **kwargs):
        # As the C++ wrappers do: the op and its casts run with CPU autocast excluded, so the op's
        # own sub-ops (layer_norm -> native_layer_norm) are not autocast again.
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST_CPU):
            return apply_policy(
                op_name,
                args,
                kwargs,
                device_type="cpu",
                lower_dtype=torch.get_autocast_dtype("cpu"),
            )

    return kernel


@functools.cache
def _install_cpu_emulation() -> torch.library.Library:
    """Give every AutocastCPU registration CUDA's rule; cached, so it happens once and the Library
    (whose lifetime is the registrations') lives as long as the process."""
    # Other namespaces (torchvision::nms, ...) are outside the Qwen forward; they keep their rules.
    cpu_rules = {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
        if name.startswith("aten::")
    }
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # Replacing torch's AutocastCPU kernels is the point; torch 2.11 warns about it.
        warnings.filterwarnings("ignore", "Warning only once for all operators")
        for op_name in CUDA_POLICY:
            lib.impl(op_name, _cpu_kernel(op_name), "AutocastCPU")
        # CPU-only rules (cat/stack promote, polar/view_as_complex/fft/linalg fp32, ...): CUDA
        # autocast leaves these ops alone, so fall through to the op itself.
        for op_name in sorted(cpu_rules - CUDA_POLICY.keys()):
            lib.impl(op_name, torch.library.fallthrough_kernel, "AutocastCPU")
    return lib


def cuda_autocast(device_type: str) -> torch.autocast:
    """bf16 autocast with CUDA's op policy on `device_type` ("cuda": real; "cpu": emulated)."""
    if device_type == "cpu":
        _install_cpu_emulation()
    elif device_type != "cuda":
        raise ValueError(
            f"cuda_autocast supports 'cuda' and 'cpu', not {device_type!r}"
        )
    return torch.autocast(device_type, dtype=torch.bfloat16)
