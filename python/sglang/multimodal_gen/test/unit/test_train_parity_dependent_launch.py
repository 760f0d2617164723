# SPDX-License-Identifier: Apache-2.0
"""The train_parity kernels launch with programmatic dependent launch: each,
compiled for sm_90 (no GPU needed), waits for the previous kernel before its
first global memory access, and the launch options ask for PDL only on
Hopper and later."""

import re

import pytest
import torch

from sglang.kernels.kda_kernels import layernorm_modulate_triton as layer_norm
from sglang.kernels.ops.diffusion.common import dependent_launch
from sglang.kernels.ops.diffusion.gemm import linear_lora_triton as linear_lora
from sglang.kernels.ops.diffusion.gemm import lora_b_scale_add_triton as lora_b
from sglang.kernels.ops.diffusion.modulate import add_product_triton as add_product
from sglang.kernels.ops.diffusion.rope import qknorm_complex_rope_joint_triton as qk

_GLOBAL_ACCESS = re.compile(
    r"\b(?:ld\.global|st\.global|cp\.async\.bulk\.tensor|atom\.global|red\.global)"
)


def _tma(shape: str) -> str:
    return f"tensordesc<bf16[{shape}]>"


# kernel, constexprs, argument types besides BF16 pointers and int32 scalars,
# compile options (those of each kernel's launch that change its code)
KERNELS = {
    "gated residual": (
        add_product._add_product_kernel,
        {"BLOCK": 1024, "ROUND_PRODUCT": True},
        {},
        {},
    ),
    "LoRA-B + tanh GELU": (
        lora_b._lora_b_scale_add_kernel,
        {"RANK": 64, "GELU_TANH": True, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64},
        {"scale": "fp32"},
        {},
    ),
    "base GEMM + LoRA-B": (
        linear_lora._linear_lora_kernel,
        {
            "BLOCK_M": 128,
            "BLOCK_N": 256,
            "BLOCK_K": 64,
            "GROUP_M": 8,
            "EPILOGUE_PARTS": 2,
            "WARP_SPECIALIZE": True,
        },
        {
            "x_desc": _tma("128, 64"),
            "weight_desc": _tma("256, 64"),
            "out_desc": _tma("128, 128"),
            "down_desc": _tma("128, 64"),
            "lora_b_desc": _tma("128, 64"),
            "scale": "fp32",
        },
        {"num_warps": 8, "num_stages": 3},
    ),
    "Q/K RMSNorm + RoPE": (
        qk._qknorm_complex_rope_joint_kernel,
        {"HEADS": 24, "ROWS": 4, "FUSE_REAL_SIN": True},
        {"rope_ptr": "*fp32", "eps": "fp32"},
        {"num_warps": 4},
    ),
    "LayerNorm + modulation": (
        layer_norm._layernorm_modulate_kernel,
        {
            "D": 3072,
            "ROWS": 2,
            "FP8_DTYPE": None,
            "FP8_MIN": 0.0,
            "FP8_MAX": 0.0,
            "STORE_BF16": True,
            "QUANTIZE_FP8": False,
            "HAS_SHIFT": True,
            "POST_OP": "autocast_modulate",
        },
        {"eps": "fp32"},
        {},
    ),
}


def _ptx(name: str, use_gdc: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, constexprs, types, options = KERNELS[name]
    constexprs = dict(constexprs, USE_GDC=use_gdc)
    names = kernel.arg_names
    signature = {
        n: (
            "constexpr"
            if n in constexprs
            else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
        )
        for n in names
    }
    source = ASTSource(
        kernel,
        signature,
        constexprs,
        attrs={
            (i,): [["tt.divisibility", 16]]
            for i, n in enumerate(names)
            if n.endswith("_ptr")
        },
    )
    options = dict(options, enable_fp_fusion=False, launch_pdl=use_gdc)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"]


def _waits_before_global_access(ptx: str) -> bool:
    wait = ptx.find("griddepcontrol.wait")
    first_access = _GLOBAL_ACCESS.search(ptx)
    return 0 <= wait < first_access.start()


@pytest.mark.parametrize("name", KERNELS)
def test_each_kernel_waits_for_the_previous_one_before_touching_memory(name):
    # a kernel scheduled early must not read an input the previous kernel is
    # still writing, nor overwrite one it still reads
    assert _waits_before_global_access(_ptx(name, use_gdc=True))


def test_control_without_pdl_the_kernel_does_not_wait():
    assert not _waits_before_global_access(_ptx("gated residual", use_gdc=False))


def test_pdl_only_on_hopper_and_later(monkeypatch):
    assert dependent_launch.dependent_launch_options(torch.device("cpu")) == {}
    monkeypatch.setattr(
        dependent_launch, "is_cuda_sm_at_least", lambda sm, device: sm <= (9, 0)
    )
    assert dependent_launch.dependent_launch_options(torch.device("cuda")) == {
        "USE_GDC": True,
        "launch_pdl": True,
    }
