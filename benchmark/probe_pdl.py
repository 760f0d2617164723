# SPDX-License-Identifier: Apache-2.0
"""What programmatic dependent launch (PDL) saves per kernel boundary in a
replayed CUDA graph, on a chain shaped like a Qwen-Image block's launches.

Each "block" launches cuBLAS GEMMs at the image stream's (4096 rows) and the
text stream's (211 rows) shapes, each followed by Triton elementwise kernels,
two of them back to back. Variants: the Triton kernels launched plainly, with
PDL and ``gdc_wait`` at their top, and with ``gdc_launch_dependents`` right
after the wait as well. Every variant computes the same values (checked); only
launch timing differs. Also records the host time of ``graph.replay()``.

    python3 benchmark/probe_pdl.py --out $OUT/pdl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_add_kernel(out_ptr, a_ptr, b_ptr, n, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC >= 1:
        tl.extra.cuda.gdc_wait()
    if GDC == 2:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask, 0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask, 0.0).to(tl.float32)
    tl.store(out_ptr + offs, (a + 0.5 * b).to(out_ptr.dtype.element_ty), mask)


def scale_add(a, b, gdc: int):
    out = torch.empty_like(a)
    n = a.numel()
    _scale_add_kernel[(triton.cdiv(n, 2048),)](
        out, a, b, n, BLOCK=2048, GDC=gdc, launch_pdl=gdc >= 1, num_warps=4
    )
    return out


def chain(x_img, x_txt, w, w_a, blocks: int, gdc: int):
    img, txt = x_img, x_txt
    for _ in range(blocks):
        y = torch.nn.functional.linear(img, w)
        img = scale_add(img, scale_add(img, y, gdc), gdc)
        t = torch.nn.functional.linear(txt, w)
        down = torch.nn.functional.linear(txt, w_a)  # rank 64: cuBLAS splits K
        txt = scale_add(txt, t, gdc)
        txt = scale_add(txt, torch.nn.functional.linear(down, w_a.t()), gdc)
    return img, txt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=60)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    x_img = torch.randn(4096, 3072, device=dev, dtype=torch.bfloat16)
    x_txt = torch.randn(211, 3072, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3072, 3072, device=dev, dtype=torch.bfloat16) / 64
    w_a = torch.randn(64, 3072, device=dev, dtype=torch.bfloat16) / 64
    result = {"blocks": args.blocks, "variants": {}}
    reference = None
    for name, gdc in (("plain", 0), ("pdl_wait", 1), ("pdl_wait_trigger", 2)):
        out = chain(x_img, x_txt, w, w_a, args.blocks, gdc)  # compile, warm up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x_img, x_txt, w, w_a, args.blocks, gdc)
        graph.replay()
        torch.cuda.synchronize()
        if reference is None:
            reference = [t.clone() for t in out]
        equal = all(torch.equal(a, b) for a, b in zip(out, reference))
        device_ms, host_ms = [], []
        for _ in range(args.replays):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            t0 = time.perf_counter()
            graph.replay()
            host_ms.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
        result["variants"][name] = {
            "replay_ms_median": round(statistics.median(device_ms), 3),
            "replay_ms_min": round(min(device_ms), 3),
            "replay_host_ms_median": round(statistics.median(host_ms), 3),
            "equal_to_plain": equal,
        }
        print(name, result["variants"][name], flush=True)
        del graph
    plain = result["variants"]["plain"]["replay_ms_median"]
    triton_launches = 4 * args.blocks
    for name, v in result["variants"].items():
        v["saved_us_per_triton_launch"] = round(
            (plain - v["replay_ms_median"]) * 1e3 / triton_launches, 2
        )
    result["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
