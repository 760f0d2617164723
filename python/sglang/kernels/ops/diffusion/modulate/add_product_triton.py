# SPDX-License-Identifier: Apache-2.0
"""``a + b * c`` with the eager chain's roundings, for BF16 ``a`` and ``b``.

Numerics contract: bit-exact vs the two aten ops ``a + b * c`` on CUDA:

- ``residual_gate_add_bf16``: ``residual + gate * update`` with a ``[B, D]``
  gate broadcast over the sequence. A BF16 gate rounds the product to BF16
  and then the sum; an FP32 gate keeps the product and the sum in FP32 and
  rounds once, as ``(residual + gate * update).to(residual.dtype)`` does.
- ``scale_add_bf16``: ``base + update * scale`` with a Python float scale
  (PEFT's LoRA epilogue ``result + lora_B(lora_A(x)) * scaling``): the FP32
  product rounds to BF16, then the sum.

Every multiply and add is a separate correctly rounded FP32 op
(``enable_fp_fusion=False``), as each aten kernel computes it.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit(do_not_specialize=["n_cols", "seq_len", "c_row_stride", "c_scalar"])
def _add_product_kernel(
    out_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    c_scalar,
    n_cols,
    seq_len,
    c_row_stride,
    BLOCK: tl.constexpr,
    C_ROWS: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    a = tl.load(a_ptr + offsets, mask, 0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask, 0.0).to(tl.float32)
    if C_ROWS:
        c_row = (row // seq_len) * c_row_stride
        c = tl.load(c_ptr + c_row + cols, mask, 0.0).to(tl.float32)
    else:
        c = c_scalar
    product = b * c
    if ROUND_PRODUCT:
        product = product.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (a + product).to(out_ptr.dtype.element_ty), mask)


def _launch(a, b, c, c_scalar, seq_len, c_row_stride, round_product):
    out = torch.empty_like(a)
    n_cols = a.shape[-1]
    with torch.cuda.device(a.device):
        _add_product_kernel[(a.numel() // n_cols, triton.cdiv(n_cols, _BLOCK))](
            out,
            a,
            b,
            c,
            c_scalar,
            n_cols,
            seq_len,
            c_row_stride,
            BLOCK=_BLOCK,
            C_ROWS=c is not None,
            ROUND_PRODUCT=round_product,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.is_cuda
        and a.dtype == torch.bfloat16
        and a.numel() > 0
        and a.is_contiguous()
        and b.shape == a.shape
        and b.dtype == a.dtype
        and b.device == a.device
        and b.is_contiguous()
    )


def residual_gate_add_bf16(
    residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """``(residual + gate[:, None] * update).to(residual.dtype)`` for BF16
    ``residual``/``update`` [B, S, D] and a BF16 or FP32 gate [B, D] whose
    rows may be strided (a chunk of a modulation projection)."""
    if not (
        _check_operands(residual, update)
        and residual.dim() == 3
        and gate.dtype in (torch.bfloat16, torch.float32)
        and gate.device == residual.device
        and gate.shape == (residual.shape[0], residual.shape[2])
        and gate.stride(1) == 1
    ):
        raise RuntimeError(
            "residual_gate_add_bf16 expects contiguous BF16 CUDA residual and "
            "update [B, S, D] and a BF16 or FP32 gate [B, D] with packed rows"
        )
    return _launch(
        residual,
        update,
        gate,
        0.0,
        residual.shape[1],
        gate.stride(0),
        gate.dtype == torch.bfloat16,
    )


def scale_add_bf16(
    base: torch.Tensor, update: torch.Tensor, scale: float
) -> torch.Tensor:
    """``base + update * scale`` for BF16 ``base``/``update`` of one shape."""
    if not _check_operands(base, update):
        raise RuntimeError(
            "scale_add_bf16 expects contiguous BF16 CUDA base and update of one shape"
        )
    return _launch(base, update, None, scale, 1, 0, True)
