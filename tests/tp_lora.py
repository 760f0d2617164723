"""Shared LoRA fixtures for the train_parity tests: fp32 masters, sglang's LoRA-wrapped linear layers
built from them, PEFT's reference, and sglang's parallel state on CPU (gloo), for one process or for
each rank of a tensor-parallel group (`tp_worker` is the torch.multiprocessing entry point).
"""

from __future__ import annotations

import os

# Before torch._dynamo reads it (spawned TP workers inherit it): upstream wraps several CPU
# forwards in torch.compile, which would need a C++ toolchain and minutes per shape.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import socket  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

IN_FEATURES = 64
OUT_FEATURES = 48
BF16 = torch.bfloat16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(tp_size: int = 1, rank: int = 0, port: int | None = None) -> None:
    """sglang's world and model-parallel groups on CPU (gloo); a no-op once initialized."""
    from sglang.multimodal_gen.runtime.distributed.parallel_state import (
        maybe_init_distributed_environment_and_model_parallel,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port or free_port()),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(tp_size),
        )
    maybe_init_distributed_environment_and_model_parallel(tp_size=tp_size, sp_size=1)


@dataclass
class LoraMasters:
    """fp32 masters of a base Linear and its LoRA adapter, as the trainer holds them."""

    weight: torch.Tensor
    bias: torch.Tensor
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    rank: int
    alpha: int

    @classmethod
    def random(cls, rank: int, alpha: int, seed: int = 0) -> LoraMasters:
        # B large enough that the scaled update moves the bf16 output by many ULPs.
        g = torch.Generator().manual_seed(seed)
        return cls(
            weight=torch.randn(OUT_FEATURES, IN_FEATURES, generator=g) / 8,
            bias=torch.randn(OUT_FEATURES, generator=g),
            lora_A=torch.randn(rank, IN_FEATURES, generator=g) / 8,
            lora_B=torch.randn(OUT_FEATURES, rank, generator=g) / (rank * alpha) ** 0.5,
            rank=rank,
            alpha=alpha,
        )


def _base_layer(kind: str) -> nn.Module:
    from sglang.multimodal_gen.runtime.layers.linear import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    if kind == "nn.Linear":
        return nn.Linear(IN_FEATURES, OUT_FEATURES, dtype=BF16)
    cls = {
        "column": ColumnParallelLinear,
        "row": RowParallelLinear,
        "replicated": ReplicatedLinear,
    }[kind]
    return cls(IN_FEATURES, OUT_FEATURES, bias=True, params_dtype=BF16)


def _load(param: nn.Parameter, full: torch.Tensor) -> None:
    """Through sglang's weight_loader where the layer has one, so each TP rank keeps its shard."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        param.data.copy_(full)
    else:
        loader(param, full)


def sglang_lora_layer(
    kind: str, masters: LoraMasters, numerics: str, merge_weights: bool = False
) -> nn.Module:
    """`kind` ("column", "row", "replicated", "nn.Linear") with bf16 base weights, wrapped for
    LoRA in `numerics` mode, holding the fp32 masters as its adapter (as a weight sync sends them).
    """
    from sglang.multimodal_gen.runtime.layers.lora.linear import wrap_with_lora_layer
    from sglang.multimodal_gen.runtime.utils.train_parity import numerics_mode_context

    with numerics_mode_context(numerics):
        base = _base_layer(kind)
        _load(base.weight, masters.weight.to(BF16))
        _load(base.bias, masters.bias.to(BF16))
        layer = wrap_with_lora_layer(base)
    layer.lora_rank, layer.lora_alpha = masters.rank, masters.alpha
    layer.set_lora_weights(
        masters.lora_A,
        masters.lora_B,
        merge_weights=merge_weights,
        clear_existing=True,
    )
    return layer


def run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """sglang's linear layers return (output, output_bias); nn.Linear-based ones a tensor."""
    with torch.no_grad():
        out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def peft_lora_linear(masters: LoraMasters) -> nn.Module:
    """PEFT 0.21's unmerged `lora.Linear`, injected into fp32 masters, then every parameter
    rounded to bf16 (what FSDP2 with param_dtype=bf16 gives the trainer)."""
    from peft import LoraConfig, inject_adapter_in_model

    model = nn.Sequential()
    model.add_module("proj", nn.Linear(IN_FEATURES, OUT_FEATURES))
    config = LoraConfig(
        r=masters.rank,
        lora_alpha=masters.alpha,
        target_modules=["proj"],
        lora_dropout=0.0,
    )
    inject_adapter_in_model(config, model)
    proj = model.proj
    with torch.no_grad():
        proj.base_layer.weight.copy_(masters.weight)
        proj.base_layer.bias.copy_(masters.bias)
        proj.lora_A["default"].weight.copy_(masters.lora_A)
        proj.lora_B["default"].weight.copy_(masters.lora_B)
    return model.to(BF16).eval()


def tp_worker(
    rank: int,
    tp_size: int,
    port: int,
    masters: LoraMasters,
    x: torch.Tensor,
    out_dir: Path,
) -> None:
    """One rank of a TP group: build the LoRA-wrapped Column and Row layers under train_parity
    and save their outputs on `x` to `out_dir/rank{rank}.pt`.

    Column keeps its output shard (gather_output=False) and Row takes its input shard
    (input_is_parallel=True); Row's output is all-reduced over the group.
    """
    from sglang.multimodal_gen.runtime.distributed import get_tp_world_size

    init_parallel(tp_size, rank, port)
    outputs = {"tp_world_size": get_tp_world_size()}
    from sglang.multimodal_gen.runtime.utils.train_parity import TrainParityError

    for kind, layer_input in (("column", x), ("row", x.chunk(tp_size, -1)[rank])):
        layer = sglang_lora_layer(kind, masters, "train_parity")
        outputs[f"{kind}_peft_forward"] = layer.peft_forward
        try:  # the adapter rules hold at any TP size
            layer.set_lora_weights(masters.lora_A, masters.lora_B, strength=0.5)
            outputs[f"{kind}_refused"] = None
        except TrainParityError as e:
            outputs[f"{kind}_refused"] = str(e)
        outputs[kind] = run_layer(layer, layer_input)
    torch.save(outputs, out_dir / f"rank{rank}.pt")
