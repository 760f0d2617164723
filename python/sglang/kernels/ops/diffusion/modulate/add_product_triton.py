# SPDX-License-Identifier: Apache-2.0
"""``a + b * c`` with the eager chain's roundings, for BF16 ``a`` and ``b``.

Numerics contract: bit-exact vs the two aten ops on CUDA in
``residual_gate_add_bf16``: ``residual + gate * update`` with a ``[B, D]``
gate broadcast over the sequence. A BF16 gate rounds the product to BF16 and
then the sum; an FP32 gate keeps the product and the sum in FP32 and rounds
once, as ``(residual + gate * update).to(residual.dtype)`` does.

Every multiply and add is a separate correctly rounded FP32 op
(``enable_fp_fusion=False``), as each aten kernel computes it.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit(do_not_specialize=["n_cols", "seq_len", "c_row_stride"])
def _add_product_kernel(
    out_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    n_cols,
    seq_len,
    c_row_stride,
    BLOCK: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    a = tl.load(a_ptr + offsets, mask, 0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask, 0.0).to(tl.float32)
    c_row = (row // seq_len) * c_row_stride
    c = tl.load(c_ptr + c_row + cols, mask, 0.0).to(tl.float32)
    product = b * c
    if ROUND_PRODUCT:
        product = product.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (a + product).to(out_ptr.dtype.element_ty), mask)


def residual_gate_add_bf16(
    residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """``(residual + gate[:, None] * update).to(residual.dtype)`` for BF16
    ``residual``/``update`` [B, S, D] and a BF16 or FP32 gate [B, D] whose
    rows may be strided (a chunk of a modulation projection)."""
    if not (
        residual.is_cuda
        and residual.dtype == torch.bfloat16
        and residual.dim() == 3
        and residual.numel() > 0
        and residual.is_contiguous()
        and update.shape == residual.shape
        and update.dtype == residual.dtype
        and update.device == residual.device
        and update.is_contiguous()
        and gate.dtype in (torch.bfloat16, torch.float32)
        and gate.device == residual.device
        and gate.shape == (residual.shape[0], residual.shape[2])
        and gate.stride(1) == 1
    ):
        raise RuntimeError(
            "residual_gate_add_bf16 expects contiguous BF16 CUDA residual and "
            "update [B, S, D] and a BF16 or FP32 gate [B, D] with packed rows"
        )
    out = torch.empty_like(residual)
    n_cols = residual.shape[-1]
    with torch.cuda.device(residual.device):
        _add_product_kernel[(residual.numel() // n_cols, triton.cdiv(n_cols, _BLOCK))](
            out,
            residual,
            update,
            gate,
            n_cols,
            residual.shape[1],
            gate.stride(0),
            BLOCK=_BLOCK,
            ROUND_PRODUCT=gate.dtype == torch.bfloat16,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out
