# SPDX-License-Identifier: Apache-2.0
"""Programmatic dependent launch (PDL) for the diffusion Triton kernels.

Back-to-back small kernels spend part of each boundary waiting for the previous
grid to drain and the next one to be scheduled. A kernel launched with
``dependent_launch_options`` is scheduled while the previous kernel in the
stream is still running, and calls ``wait_for_prior_kernel`` before its first
memory access, which blocks until that kernel has finished and its writes are
visible. The kernel computes exactly what it computes without PDL.
"""

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.diffusion.common.platform import is_cuda_sm_at_least


@triton.jit
def wait_for_prior_kernel(USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        # from here the next kernel may be scheduled; it waits for this one
        tl.extra.cuda.gdc_launch_dependents()


def dependent_launch_options(device: torch.device) -> dict:
    """Launch options for a kernel that calls ``wait_for_prior_kernel(USE_GDC)``
    first: PDL on Hopper and later, a plain launch elsewhere."""
    if is_cuda_sm_at_least((9, 0), device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {}
