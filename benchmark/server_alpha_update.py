"""On a GPU, through `sglang serve --numerics train_parity` (CUDA graphs on) on the tiny
Qwen-Image: an adapter update that keeps A/B in their storage and changes only `lora_alpha`,
then rollouts bitwise equal to the trainer's recompute, and a 50-step rollout.

The adapter goes as the trainer's bf16 CUDA tensors through CUDA IPC (sglang's
MultiprocessingSerializer, as a trainer on the same GPU sends it). The server rebuilds an IPC
tensor in the storage it opened for that allocation before, while a tensor still holds it (the
LoRA layer holds the first push's), and `set_lora_weights` keeps a bf16 tensor on the weight's
device as it is: the second push's A/B are the first push's storage. (The HTTP pickle push of
`rollout_demo.push_lora` and disk loads allocate new tensors: new storage drops the graphs
whatever they are keyed on.) Graphs keyed on the storage and the LoRA flags alone replay the
old alpha: the rollout after the update then equals the recompute with the old alpha, which
this script fails on (run it on a build without the fix to see that control).

    bash benchmark/run_h200.sh alpha-update
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from sglang_train_parity.rollout_demo import (
    QwenImageDemo,
    policy_checksum,
    random_adapters,
    request_rollout,
    serve,
)

RANK = 16
ALPHAS = (48, 40)  # alpha / rank: 3, then 2.5 with the same A/B
SEED = 7


def push_over_ipc(server, tensors: list[tuple[str, torch.Tensor]], alpha: int) -> None:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    response = server.post(
        "/update_weights_from_tensor",
        serialized_named_tensors=[
            MultiprocessingSerializer.serialize(tensors, output_str=True)
        ],
        weight_update_mode="lora_merge",
        target_modules=["transformer"],
        lora_rank=RANK,
        lora_alpha=alpha,
    )
    if response.status_code != 200 or not response.json().get("success"):
        raise SystemExit(f"update with alpha {alpha} refused: {response.text}")


def checked_rollout(server, demo, adapter, alpha: int, steps: int, stale_alpha=None):
    """A rollout against the trainer's recompute with `alpha`; with `stale_alpha`, also
    whether its outputs equal the recompute with that alpha (a stale replay's)."""
    from sglang_train_parity.fingerprints import verify_rollout
    from sglang_train_parity.policy import trainer_policy_checksum

    rollout = request_rollout(
        server,
        demo.request,
        rollout_debug_mode=False,
        seed=SEED,
        num_inference_steps=steps,
        generator_device="cuda",
    )

    def verdict(alpha_, check_adapter=True):
        trainer = demo.trainer("transformer", adapter, RANK, alpha_, "cuda")
        checksum = trainer_policy_checksum(
            trainer, param_names_mapping=demo.family.param_names_mapping
        )
        trainer_steps, _ = demo.step_outputs({"transformer": trainer}, rollout, "cuda")
        adapter_checksum = checksum["adapter"] if check_adapter else None
        fingerprints = rollout["rollout_fingerprints"]
        return verify_rollout(fingerprints, trainer_steps, adapter_checksum), checksum

    result, checksum = verdict(alpha)
    row = {
        "alpha": alpha,
        "steps": steps,
        "bitwise": result.ok,
        "fingerprints": result.explain(),
        "policy_checksum_equal": policy_checksum(server) == checksum,
    }
    if stale_alpha is not None:
        stale, _ = verdict(stale_alpha, check_adapter=False)
        row["equals_recompute_with_alpha"] = {stale_alpha: stale.ok}
    print(json.dumps(row), flush=True)
    return row


def captured(server) -> int:
    return server.log_path.read_text(errors="replace").count("captured a CUDA graph")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/tiny-Qwen-Image"))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/alpha-logs"))
    parser.add_argument("--report", type=Path, default=Path("/tmp/alpha_update.json"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    demo = QwenImageDemo(
        QwenImageDemo.build_tiny("Qwen-Image", args.model_dir), "Qwen-Image"
    )
    adapter = random_adapters(args.model_dir, 1, RANK, ALPHAS[0])[0]
    # the trainer's bf16 copies of its fp32 masters, on the GPU, kept alive: both pushes
    # send these very tensors
    tensors = [(name, t.to("cuda", torch.bfloat16)) for name, t in adapter.items()]
    rows = []
    with serve(
        args.model_dir,
        "train_parity",
        args.log_dir,
        model_id="Qwen-Image",
        device="cuda",
        site_dir=Path(__file__).parent / "demo_site",
    ) as server:
        push_over_ipc(server, tensors, ALPHAS[0])
        rows.append(checked_rollout(server, demo, adapter, ALPHAS[0], 4))
        graphs_before = captured(server)
        push_over_ipc(server, tensors, ALPHAS[1])
        rows.append(
            checked_rollout(server, demo, adapter, ALPHAS[1], 4, stale_alpha=ALPHAS[0])
        )
        graphs_after = captured(server)
        rows.append(checked_rollout(server, demo, adapter, ALPHAS[1], 50))
    failures = [
        f"rollout {i} not bitwise" for i, r in enumerate(rows) if not r["bitwise"]
    ]
    if not graphs_before:
        failures.append("no CUDA graph captured in the first rollout")
    if graphs_after == graphs_before:
        failures.append("the alpha update did not drop the graphs (stale replay)")
    if rows[1]["equals_recompute_with_alpha"][ALPHAS[0]]:
        failures.append("the rollout after the alpha update ran the old alpha")
    report = dict(
        rows=rows,
        graphs_captured=[graphs_before, graphs_after],
        failures=failures,
        device=torch.cuda.get_device_name(),
    )
    args.report.write_text(json.dumps(report, indent=2))
    print("FAILED: " + "; ".join(failures) if failures else "passed", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
