"""The CPU emulation of CUDA autocast (tests/autocast_emulation.py) gives CUDA's dtypes and the values of
the explicitly cast op.

Each case's expected dtype is checked three ways: under the emulation on CPU, under torch's real
AutocastCUDA kernels (reached on CPU through fake CUDA tensors, which carry the AutocastCUDA key),
and against the dtype table of train-side-contract.md §2.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm
from sglang_train_parity.autocast_emulation import CUDA_POLICY, cuda_autocast
from torch._subclasses.fake_tensor import FakeTensorMode

bf16, fp32, fp64, c64 = torch.bfloat16, torch.float32, torch.float64, torch.complex64
D = 16

# rms_norm joined CUDA autocast's fp32 list in torch 2.12 (the trainer's torch 2.11 keeps the input dtype).
RMS_NORM_FP32 = torch.__version__ >= "2.12"


class Case(NamedTuple):
    name: str
    fn: Callable
    inputs: tuple
    expected: torch.dtype
    reference: Callable | None = (
        None  # the op on explicitly cast inputs, run without autocast; None: fn
    )


def _randn(*shape: int, dtype: torch.dtype = fp32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bf16(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(bf16) for t in tensors]


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(fp32) for t in tensors]


x32, x16, x64 = _randn(4, D), _randn(4, D, dtype=bf16), _randn(4, D, dtype=fp64)
w32, w16 = _randn(D, D, seed=1), _randn(D, D, dtype=bf16, seed=1)
b32, b16 = _randn(D, seed=2), _randn(D, dtype=bf16, seed=2)
g16 = (_randn(D, seed=3).abs() + 0.5).to(
    bf16
)  # positive: a norm weight, an rsqrt input
batch32 = _randn(2, 4, D, seed=4)
q32, k32, v32 = (_randn(1, 2, 8, D, seed=s) for s in (5, 6, 7))
qkv16 = tuple(t.to(bf16) for t in (q32, k32, v32))
img16 = _randn(2, 4, 3, 3, dtype=bf16, seed=8)
layer_norm = torch.nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
rms_norm = RMSNorm(D, eps=1e-6)


def diffusers_rms_norm(x, weight):
    return torch.func.functional_call(rms_norm, {"weight": weight}, (x,))


CASES = [
    # lower_precision_fp on both devices: inputs cast to bf16, fp64 left alone.
    Case(
        "linear fp32 x, fp32 W",
        F.linear,
        (x32, w32, b32),
        bf16,
        lambda x, w, b: F.linear(*_bf16(x, w, b)),
    ),
    Case(
        "linear fp32 x, bf16 W (LoRA)",
        F.linear,
        (x32, w16, b16),
        bf16,
        lambda x, w, b: F.linear(x.to(bf16), w, b),
    ),
    Case("linear fp64 stays fp64", F.linear, (x64, w32.to(fp64)), fp64),
    Case(
        "matmul",
        torch.matmul,
        (x32, w32),
        bf16,
        lambda a, b: torch.matmul(*_bf16(a, b)),
    ),
    Case("mm", torch.mm, (x32, w16), bf16, lambda a, b: torch.mm(a.to(bf16), b)),
    Case(
        "addmm",
        torch.addmm,
        (b32, x32, w32),
        bf16,
        lambda c, a, b: torch.addmm(*_bf16(c, a, b)),
    ),
    Case(
        "bmm",
        torch.bmm,
        (batch32, batch32.transpose(1, 2)),
        bf16,
        lambda a, b: torch.bmm(*_bf16(a, b)),
    ),
    Case(
        "baddbmm",
        torch.baddbmm,
        (_randn(2, 4, 4, seed=9), batch32, batch32.transpose(1, 2)),
        bf16,
        lambda c, a, b: torch.baddbmm(*_bf16(c, a, b)),
    ),
    Case(
        "sdpa fp32 q/k/v",
        F.scaled_dot_product_attention,
        (q32, k32, v32),
        bf16,
        lambda q, k, v: F.scaled_dot_product_attention(*_bf16(q, k, v)),
    ),
    Case("sdpa bf16 q/k/v", F.scaled_dot_product_attention, qkv16, bf16),
    # fp32 on CUDA, left in bf16 by plain CPU autocast.
    Case(
        "layer_norm bf16",
        lambda x: F.layer_norm(x, (D,), eps=1e-6),
        (x16,),
        fp32,
        lambda x: F.layer_norm(x.to(fp32), (D,), eps=1e-6),
    ),
    Case(
        "layer_norm bf16 x, bf16 affine",
        lambda x, w, b: F.layer_norm(x, (D,), w, b),
        (x16, g16, b16),
        fp32,
        lambda x, w, b: F.layer_norm(*_fp32(x), (D,), *_fp32(w, b)),
    ),
    Case(
        "nn.LayerNorm bf16 (Qwen norm1/norm2/norm_out)",
        layer_norm,
        (x16,),
        fp32,
        lambda x: layer_norm(x.to(fp32)),
    ),
    Case(
        "group_norm bf16",
        lambda x, w, b: F.group_norm(x, 2, w, b),
        (img16, g16[:4], b16[:4]),
        fp32,
        lambda x, w, b: F.group_norm(x.to(fp32), 2, *_fp32(w, b)),
    ),
    Case(
        "F.rms_norm bf16 x, bf16 weight",
        lambda x, w: F.rms_norm(x, (D,), w, 1e-6),
        (x16, g16),
        fp32 if RMS_NORM_FP32 else bf16,
        lambda x, w: (
            F.rms_norm(*_fp32(x), (D,), *_fp32(w), 1e-6)
            if RMS_NORM_FP32
            else F.rms_norm(x, (D,), w, 1e-6)
        ),
    ),
    Case(
        "pow.Tensor_Scalar bf16",
        lambda x: x.pow(2),
        (x16,),
        fp32,
        lambda x: x.to(fp32).pow(2),
    ),
    Case(
        "pow.Scalar (RoPE 10000**e)",
        lambda e: torch.pow(10000, e),
        (b16,),
        fp32,
        lambda e: torch.pow(10000, e.to(fp32)),
    ),
    Case("pow.Scalar fp32 (RoPE)", lambda e: torch.pow(10000, e), (b32,), fp32),
    Case("rsqrt bf16", torch.rsqrt, (g16,), fp32, lambda x: torch.rsqrt(x.to(fp32))),
    Case("exp bf16", torch.exp, (x16,), fp32, lambda x: torch.exp(x.to(fp32))),
    Case("exp fp64 stays fp64", torch.exp, (x64,), fp64),
    # fp32_set_opt_dtype: run with dtype=fp32 (not on an fp32 copy) unless a dtype is given.
    Case("sum bf16", torch.sum, (x16,), fp32, lambda x: torch.sum(x, dtype=fp32)),
    Case(
        "sum(dim) bf16",
        lambda x: x.sum(-1),
        (x16,),
        fp32,
        lambda x: x.sum(-1, dtype=fp32),
    ),
    Case("sum explicit dtype kept", lambda x: x.sum(dtype=fp64), (x16,), fp64, None),
    Case("sum int64 untouched", torch.sum, (torch.arange(6),), torch.int64),
    Case(
        "softmax bf16",
        lambda x: F.softmax(x, -1),
        (x16,),
        fp32,
        lambda x: F.softmax(x, -1, dtype=fp32),
    ),
    Case(
        "log_softmax bf16",
        lambda x: F.log_softmax(x, -1),
        (x16,),
        fp32,
        lambda x: F.log_softmax(x, -1, dtype=fp32),
    ),
    Case(
        "torch.norm bf16 (CFG)",
        torch.norm,
        (x16,),
        fp32,
        lambda x: torch.linalg.vector_norm(x, dtype=fp32),
    ),
    Case(
        "linalg.vector_norm(dim) bf16",
        lambda x: torch.linalg.vector_norm(x, dim=-1),
        (x16,),
        fp32,
        lambda x: torch.linalg.vector_norm(x, dim=-1, dtype=fp32),
    ),
    # fp32_append_dtype: aten::norm redispatched with dtype=fp32.
    Case(
        "aten norm.Scalar bf16",
        torch.ops.aten.norm.Scalar,
        (x16,),
        fp32,
        lambda x: torch.ops.aten.norm.ScalarOpt_dtype(x, 2, dtype=fp32),
    ),
    # promote on CUDA: the widest floating input.
    Case(
        "addcmul bf16, fp32, bf16",
        torch.addcmul,
        (x16, x32, x16),
        fp32,
        lambda a, b, c: torch.addcmul(*_fp32(a, b, c)),
    ),
    # No rule on CUDA: the op's own dtype behaviour.
    Case("mean bf16", lambda x: x.mean(-1, keepdim=True), (x16,), bf16),
    Case("gelu tanh bf16", lambda x: F.gelu(x, approximate="tanh"), (x16,), bf16),
    Case("silu bf16", F.silu, (x16,), bf16),
    Case("add bf16", torch.add, (x16, x16), bf16),
    Case("mul bf16 x fp32 promotes", torch.mul, (x16, x32), fp32),
    Case("cat bf16, fp32 promotes", lambda a, b: torch.cat([a, b]), (x16, x32), fp32),
    Case("stack bf16", lambda a, b: torch.stack([a, b]), (x16, x16), bf16),
    Case(
        "diffusers RMSNorm bf16 x, bf16 weight (Qwen txt_norm, QK norm)",
        diffusers_rms_norm,
        (x16, g16),
        bf16,
    ),
    # Complex RoPE math (CPU autocast has fp32 rules for polar / view_as_complex; CUDA none).
    Case("polar fp32", torch.polar, (b32.abs(), b32), c64),
    Case("view_as_complex fp32", torch.view_as_complex, (x32.view(4, D // 2, 2),), c64),
    Case(
        "complex64 mul",
        torch.mul,
        (torch.polar(b32.abs(), b32), torch.polar(b32.abs(), x32[0])),
        c64,
    ),
]


@contextlib.contextmanager
def real_cuda_autocast_on_fake_tensors():
    """torch's own AutocastCUDA kernels without a GPU: fake CUDA tensors carry the AutocastCUDA key."""
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode():
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", bf16)
        try:
            yield
        finally:
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", dtype)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_emulation_gives_cuda_dtype_and_explicit_cast_value(case):
    with cuda_autocast("cpu"):
        out = case.fn(*case.inputs)
    expected = (case.reference or case.fn)(*case.inputs)
    assert out.dtype == case.expected
    assert expected.dtype == case.expected
    assert torch.equal(out, expected)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_real_cuda_autocast_gives_the_same_dtype(case):
    with real_cuda_autocast_on_fake_tensors():
        inputs = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
            for t in case.inputs
        ]
        assert case.fn(*inputs).dtype == case.expected


def test_policy_matches_installed_torch_cuda_registrations():
    registered = {  # other namespaces (torchvision::nms, ...) are not the policy's
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_registrations_for_dispatch_key(
            "AutocastCUDA"
        )
        if name.startswith("aten::")
    }
    # aten/src/ATen/cudnn/AutocastRNN.cpp: a cuDNN-only op with its own cast rule.
    not_modelled = {"_cudnn_rnn"}
    assert set(CUDA_POLICY) == registered - not_modelled


def test_policy_classes_match_installed_header():
    header = Path(torch.__file__).parent / "include/ATen/autocast_mode.h"
    if not header.exists():
        pytest.skip("torch was installed without its C++ headers")
    text = header.read_text()

    def listed(macro: str) -> set[str]:
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S).group(1)
        return {
            name + (f".{overload}" if overload else "")
            for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body)
        }

    def policy(name: str) -> set[str]:
        return {op for op, p in CUDA_POLICY.items() if p == name}

    # Registered in autocast_mode.cpp's CUDA block rather than through the header's lists.
    cpp_only = {
        "cudnn_convolution",
        "cudnn_convolution_transpose",
        "linalg_matrix_sqrth",
    }
    assert (
        listed("AT_FORALL_LOWER_PRECISION_FP")
        == policy("lower_precision_fp") - cpp_only
    )
    assert listed("AT_FORALL_FP32") == policy("fp32") - cpp_only
    assert listed("AT_FORALL_FP32_SET_OPT_DTYPE") == policy("fp32_set_opt_dtype")
    assert listed("AT_FORALL_PROMOTE") == policy("promote")
    append = re.search(
        r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE.*?\n\n", text, re.S
    )
    assert set(re.findall(r'"(norm\.\w+)"', append.group(0))) == policy(
        "fp32_append_dtype"
    )


def test_outside_autocast_ops_are_untouched():
    cuda_autocast("cpu")  # the AutocastCPU kernels are installed from here on
    assert F.layer_norm(x16, (D,)).dtype == bf16
    assert F.linear(x32, w32).dtype == fp32
    assert x16.sum().dtype == bf16
    with torch.autocast("cpu", dtype=bf16, enabled=False):
        assert F.layer_norm(x16, (D,)).dtype == bf16


def test_plain_cpu_autocast_differs_without_the_emulation():
    """Negative control, in a fresh interpreter: the AutocastCPU overrides are process-wide."""
    probe = """
import json, torch, torch.nn.functional as F
x = torch.randn(4, 16, dtype=torch.bfloat16)
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = {"layer_norm": F.layer_norm(x, (16,)), "softmax": F.softmax(x, -1),
           "pow": x.pow(2), "sum": x.sum(), "norm": torch.norm(x), "linear": F.linear(x.float(), x.float())}
print(json.dumps({k: str(v.dtype) for k, v in out.items()}))
"""
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) == {
        "layer_norm": "torch.bfloat16",
        "softmax": "torch.bfloat16",
        "pow": "torch.bfloat16",
        "sum": "torch.bfloat16",
        "norm": "torch.bfloat16",
        "linear": "torch.bfloat16",
    }


def test_cuda_device_type_is_plain_cuda_autocast():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available" on CPU machines
        autocast = cuda_autocast("cuda")
    assert type(autocast) is torch.autocast
    assert (autocast.device, autocast.fast_dtype) == ("cuda", bf16)
