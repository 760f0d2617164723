"""Tensor parallelism under `numerics="train_parity"`: with TP=2 the LoRA-wrapped Column/Row
parallel linears keep sglang's TP-aware forward (sharded base weights, sliced adapter, all-reduce),
which is correct but not bitwise; their outputs match the single-process train_parity result
within bf16 tolerance, and the adapter rules still hold. Two CPU processes over gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.tp_lora import (
    IN_FEATURES,
    OUT_FEATURES,
    LoraMasters,
    free_port,
    init_parallel,
    run_layer,
    sglang_lora_layer,
    tp_worker,
)

TP_SIZE = 2
# A few bf16 ULPs of O(1) outputs: TP rounds the partial sums and the fp32 LoRA delta differently.
TOLERANCE = {"rtol": 2**-6, "atol": 2**-6}


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """The inputs, the single-process train_parity outputs, and each TP rank's outputs."""
    masters = LoraMasters.random(rank=4, alpha=6)  # scaling 1.5: not a power of two
    x = torch.randn(2, 13, IN_FEATURES, generator=torch.Generator().manual_seed(1))
    x = x.bfloat16()
    init_parallel(tp_size=1)
    single = {}
    for kind in ("column", "row"):
        layer = sglang_lora_layer(kind, masters, "train_parity")
        assert layer.peft_forward
        single[kind] = run_layer(layer, x)
    out_dir = tmp_path_factory.mktemp("tp")
    mp.spawn(
        tp_worker, args=(TP_SIZE, free_port(), masters, x, out_dir), nprocs=TP_SIZE
    )
    ranks = [torch.load(out_dir / f"rank{r}.pt") for r in range(TP_SIZE)]
    return single, ranks


@pytest.mark.parametrize("rank", range(TP_SIZE))
def test_tp_layers_keep_the_tp_aware_forward(tp_run, rank):
    _, ranks = tp_run
    outputs = ranks[rank]
    assert outputs["tp_world_size"] == TP_SIZE
    assert outputs["column_peft_forward"] is False
    assert outputs["row_peft_forward"] is False


@pytest.mark.parametrize("rank", range(TP_SIZE))
def test_tp_layers_keep_the_adapter_rules(tp_run, rank):
    """Only the bitwise forward is given up at TP > 1: a strength of 0.5 is still refused."""
    outputs = tp_run[1][rank]
    for kind in ("column", "row"):
        assert "does not support LoRA strength 0.5" in outputs[f"{kind}_refused"]


@pytest.mark.parametrize("rank", range(TP_SIZE))
def test_column_parallel_shard_matches_single_process(tp_run, rank):
    single, ranks = tp_run
    shard = OUT_FEATURES // TP_SIZE
    expected = single["column"][..., rank * shard : (rank + 1) * shard]
    torch.testing.assert_close(ranks[rank]["column"], expected, **TOLERANCE)


@pytest.mark.parametrize("rank", range(TP_SIZE))
def test_row_parallel_reduced_output_matches_single_process(tp_run, rank):
    single, ranks = tp_run
    torch.testing.assert_close(ranks[rank]["row"], single["row"], **TOLERANCE)
