"""How the parity harnesses compare the fork's DiT with the trainer's, module by module on the
device: `Comparator` (paired module outputs, bitwise, with max ULP and the first divergence in
execution order), `compare_case` (one case through both models), the fork forward with hooks, and the
checks every harness applies to a run (`fused_kernels_ran`, `condense`). Used by
benchmark/gpu_parity.py (Qwen-Image) and gpu_parity_wan.py, gpu_parity_qwen21.py, gpu_parity_ltx2.py.
"""

from __future__ import annotations

import contextlib

MAX_LISTED = 25  # non-equal modules listed per comparison


class Comparator:
    """Forward hooks on the fork's modules that compare each output, when produced, with the
    paired diffusers module output of one or more reference runs; keeps statistics only.
    """

    def __init__(self, refs: dict, lora: bool, pair_of=None):
        from sglang_train_parity.reference import sglang_to_diffusers

        self.refs = refs
        self.lora = lora
        self.pair_of = pair_of or sglang_to_diffusers  # the family's module pairing
        self.rows = {key: [] for key in refs}
        self.seen: set[str] = set()

    def compare_one(self, name: str, out, key: str):
        import torch
        from sglang_train_parity.compare import ulp_distance
        from sglang_train_parity.reference import Pairing

        pair = self.pair_of(name, lora=self.lora) if name else None
        if pair is not None and pair.pairing in (
            Pairing.DIFFERENT,
            Pairing.SGLANG_ONLY,
        ):
            return
        dname = "" if pair is None else pair.diffusers
        theirs = self.refs[key].get(dname)
        if theirs is None:
            return
        if pair is not None and pair.pairing is Pairing.RESHAPED:
            theirs = theirs.reshape(out.shape)
        elif pair is not None and pair.pairing is Pairing.ROUNDED:
            theirs = theirs.to(out.dtype)
        same_layout = out.dtype == theirs.dtype and out.shape == theirs.shape
        equal = bool(same_layout and torch.equal(out, theirs))
        ulp = (
            0
            if equal
            else (
                ulp_distance(out, theirs)
                if same_layout and out.dtype == torch.bfloat16
                else None
            )
        )
        self.rows[key].append(
            {
                "sglang": name,
                "diffusers": dname,
                "dtype": str(out.dtype),
                "equal": equal,
                "max_ulp": ulp,
            }
        )

    def hook(self, name: str):
        import torch

        def fn(module, args, out):
            if name in self.seen or name == "":
                return
            out = out[0] if isinstance(out, (tuple, list)) else out
            if not isinstance(out, torch.Tensor):
                return
            self.seen.add(name)
            for key in self.refs:
                self.compare_one(name, out.detach(), key)

        return fn

    def summaries(self) -> dict:
        result = {}
        for key, rows in self.rows.items():
            root = next((r for r in rows if r["sglang"] == ""), None)
            bad = [r for r in rows if not r["equal"]]
            ulps = [r["max_ulp"] for r in rows if r["max_ulp"] is not None]
            result[key] = {
                "root_equal": None if root is None else root["equal"],
                "root_max_ulp": None if root is None else root["max_ulp"],
                "pairs": len(rows),
                "equal_pairs": len(rows) - len(bad),
                "max_ulp_any": max(ulps) if ulps else None,
                "first_divergence": bad[0] if bad else None,
                "not_equal": bad[:MAX_LISTED],
                "compared": [r["sglang"] for r in rows],
            }
        return result


@contextlib.contextmanager
def other_rms_norm_rule():
    """A control: the train_parity DiT with the autocast rule for rms_norm of the other torch
    versions (fp32 from 2.12 on, the input dtype before)."""
    from sglang.multimodal_gen.runtime.layers import train_parity_ops

    rule = train_parity_ops.AUTOCAST_RMS_NORM_IN_FP32
    train_parity_ops.AUTOCAST_RMS_NORM_IN_FP32 = not rule
    try:
        yield
    finally:
        train_parity_ops.AUTOCAST_RMS_NORM_IN_FP32 = rule


def compare_case(
    family, model, reference, inputs, controls, device, pair_of=None, outputs=()
) -> dict:
    """One case of a family module's (`sglang_train_parity.wan`, `.qwen_image21`, `.ltx2`) parity
    run: the reference outputs once; the fork's forward with every module compared as produced
    (`pair_of`: the family's pairing, default `family.sglang_to_diffusers`), and the named
    `outputs` of its result besides the root; then the fork's forward under each control (a
    context manager factory), root only."""
    import torch
    from sglang_train_parity.compare import ulp_distance

    out, ref_outputs = family.reference_forward(reference, inputs, device)
    comparator = Comparator(
        {"ref": ref_outputs}, True, pair_of or family.sglang_to_diffusers
    )
    handles = hook_modules(model, comparator)
    try:
        # the comparator sees every module; recording only the named outputs leaves the LoRA
        # base layers unhooked, so that their GEMMs run in the kernel that adds the update
        results = family.sglang_forward(model, inputs, device, record=outputs)
    finally:
        for handle in handles:
            handle.remove()
    for name in ("", *outputs):
        comparator.compare_one(name, results[name], "ref")
    ours = results[""]
    del results
    summary = comparator.summaries()["ref"]
    summary.pop("compared")
    del ref_outputs
    for name, control in controls.items():
        with control():
            theirs = family.sglang_forward(model, inputs, device, record=())[""]
        summary[f"control {name}: root_equal"] = torch.equal(theirs, out)
        summary[f"control {name}: root_max_ulp"] = ulp_distance(theirs, out)
    return summary


def hook_modules(model, comparator: Comparator) -> list:
    """Compares every module's output except a LoRA layer's base layer: a hook there keeps
    its GEMM out of the kernel that adds the update (the LoRA layer's output is compared).
    """
    return [
        m.register_forward_hook(comparator.hook(n))
        for n, m in model.named_modules()
        if not n.endswith(".base_layer")
    ]


def fork_forward(model, inputs, device: str, comparator: Comparator):
    """The fork's forward (train_parity.sglang_dit.run_dit) with each module's output compared as
    it is produced: only statistics stay on the GPU."""
    from sglang_train_parity.sglang_dit import run_dit

    handles = hook_modules(model, comparator)
    try:
        output = run_dit(model, inputs, device)
    finally:
        for h in handles:
            h.remove()
    for key in comparator.refs:
        comparator.compare_one("", output, key)
    return comparator


def condense(
    records: list[dict], expect_equal: set[str], expect_differ: set[str]
) -> dict:
    """Per comparison: how many cases, how many bitwise at the root and at every pair; the modules
    compared (union); first divergences seen."""
    out = {}
    for key in sorted({k for r in records for k in r.get("comparisons", {})}):
        rows = [
            r["comparisons"][key] for r in records if key in r.get("comparisons", {})
        ]
        firsts = sorted(
            {(s["first_divergence"] or {}).get("sglang", "<none>") for s in rows}
        )
        out[key] = {
            "expect": (
                "equal"
                if key in expect_equal
                else ("differ" if key in expect_differ else "-")
            ),
            "cases": len(rows),
            "root_bitwise": sum(bool(s["root_equal"]) for s in rows),
            "all_pairs_bitwise": sum(
                s["equal_pairs"] == s["pairs"] and s["pairs"] > 0 for s in rows
            ),
            "root_max_ulp_max": (
                max((s["root_max_ulp"] or 0) for s in rows) if rows else None
            ),
            "pairs_per_case": sorted({s["pairs"] for s in rows}),
            "first_divergences": firsts,
            "modules_compared": sorted({m for s in rows for m in s["compared"]}),
        }
        ok = (
            all(s["root_equal"] and s["equal_pairs"] == s["pairs"] for s in rows)
            if key in expect_equal
            else (
                not any(s["root_equal"] for s in rows) if key in expect_differ else True
            )
        )
        out[key]["as_expected"] = ok and bool(rows)
    return out


def fused_kernels_ran(result: dict, device: str, every_kernel: bool = True) -> bool:
    """Records the fused kernels' gates; on CUDA with the kernels on (the default) none may have
    fallen back, and every one (a family that runs only some: at least one) must have matched
    its eager chain, or the run did not test them. Prints the gates."""
    from sglang.multimodal_gen.runtime.layers import train_parity_kernels

    gates = train_parity_kernels.gate_states()
    result["fused_kernels"] = {"on": train_parity_kernels.FUSED_KERNELS, "gates": gates}
    print("fused kernel gates:", gates, flush=True)
    if device != "cuda" or not train_parity_kernels.FUSED_KERNELS:
        return True
    ran = [g["verified_signatures"] > 0 for g in gates.values()]
    return not any(g["disabled"] for g in gates.values()) and (
        all(ran) if every_kernel else any(ran)
    )


def strip_compared(records: list[dict]) -> None:
    for r in records:
        for s in r.get("comparisons", {}).values():
            s.pop("compared", None)
