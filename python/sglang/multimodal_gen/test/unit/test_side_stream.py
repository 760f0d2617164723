# SPDX-License-Identifier: Apache-2.0
"""SideStream: a hand-over orders the sender's work before the receiver's and
keeps the handed tensors' memory from early reuse; the Qwen-Image train_parity
DiT computes the same bits with its text stream on a side stream as on one
stream, eagerly and replayed from a CUDA graph, and a block with forward hooks
fences the side stream with the current one."""

import functools

import pytest
import torch

from sglang.multimodal_gen.runtime.models.dits import qwen_image
from sglang.multimodal_gen.runtime.utils import train_parity_graphs
from sglang.multimodal_gen.runtime.utils.side_stream import SideStream

pytestmark = pytest.mark.usefixtures("single_process_model_parallel")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a side stream needs CUDA"
)
# Long enough that the other stream runs ahead unless it waits.
_SLEEP_CYCLES = 200_000_000


def test_off_cuda_everything_runs_on_the_current_stream():
    x = torch.zeros(3)
    side = SideStream(x.device, x)
    assert not side.enabled
    with side:
        x.add_(1)
    side.to_main(x)
    side.to_side(x)
    side.join()
    assert torch.equal(x, torch.ones(3))


@needs_cuda
def test_to_main_orders_the_side_streams_work_first():
    def main_reads_after_side_writes(hand_over: bool) -> float:
        x = torch.zeros(1, device="cuda")
        side = SideStream(x.device, x)
        with side:
            torch.cuda._sleep(_SLEEP_CYCLES)
            x.add_(1)
        if hand_over:
            side.to_main(x)
        seen = x.clone()
        side.join()
        return seen.item()

    assert main_reads_after_side_writes(hand_over=True) == 1
    # control: without the hand-over the current stream reads before the write
    assert main_reads_after_side_writes(hand_over=False) == 0


@needs_cuda
def test_a_handed_over_tensor_outlives_the_receivers_reads():
    def reuse_while_main_reads(record: bool) -> tuple[bool, float]:
        side = SideStream(torch.device("cuda"))
        with side:
            handed = torch.full((1 << 20,), 1.0, device="cuda")
        if record:
            side.to_main(handed)
        else:
            side.main.wait_stream(side.side)
        torch.cuda._sleep(_SLEEP_CYCLES)
        seen = handed.clone()
        ptr = handed.data_ptr()
        del handed
        with side:
            reused = torch.full((1 << 20,), 2.0, device="cuda")
        side.join()
        return reused.data_ptr() == ptr, seen[0].item()

    torch.cuda.synchronize()
    assert reuse_while_main_reads(record=True) == (False, 1.0)
    # control: without recording the tensor on the receiver, the side stream
    # reuses its memory while the current stream has yet to read it
    torch.cuda.synchronize()
    assert reuse_while_main_reads(record=False) == (True, 2.0)


@needs_cuda
def test_the_text_stream_on_a_side_stream_computes_the_same_bits(
    monkeypatch, tiny_qwen_image_dit, qwen_image_dit_inputs
):
    dit = tiny_qwen_image_dit("cuda")
    inputs = [qwen_image_dit_inputs(dit, "cuda", seed) for seed in range(3)]
    with torch.no_grad():
        two_streams = [dit(**x) for x in inputs]
        monkeypatch.setattr(
            qwen_image, "SideStream", functools.partial(SideStream, overlap=False)
        )
        one_stream = [dit(**x) for x in inputs]
        monkeypatch.undo()
        train_parity_graphs.install(dit)
        replayed = [dit(**x) for x in inputs for _ in range(2)][1::2]
    for outputs in (two_streams, replayed):
        assert all(map(torch.equal, outputs, one_stream))


@needs_cuda
def test_a_block_with_forward_hooks_fences_the_side_stream(
    monkeypatch, tiny_qwen_image_dit, qwen_image_dit_inputs
):
    # a pre-forward hook that writes the block's text modulation weight late on
    # the current stream, as a weight prefetch the current stream waits for
    dit = tiny_qwen_image_dit("cuda")
    block = dit.transformer_blocks[0]
    weight = block.txt_mod[1].weight
    old, new = weight.detach().clone(), weight.detach() * 2

    def prefetch(*args):
        torch.cuda._sleep(_SLEEP_CYCLES)
        weight.data.copy_(new)

    def forward(start_with: torch.Tensor) -> torch.Tensor:
        weight.data.copy_(start_with)
        torch.cuda.synchronize()
        # fresh inputs: no modulation cached from an earlier call
        return dit(**qwen_image_dit_inputs(dit, "cuda", 0))

    with torch.no_grad():
        expected = forward(new)
        block.register_forward_pre_hook(prefetch)
        fenced = forward(old)
        monkeypatch.setattr(qwen_image, "has_forward_hooks", lambda module: False)
        unfenced = forward(old)
    assert torch.equal(fenced, expected)
    # control: unfenced, the side stream reads the weight before the hook wrote it
    assert not torch.equal(unfenced, expected)
