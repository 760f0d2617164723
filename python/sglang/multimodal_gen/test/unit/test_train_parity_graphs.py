# SPDX-License-Identifier: Apache-2.0
"""CUDA-graph replay of the train_parity DiT forward: which calls replay, and on CUDA that
every replay equals the eager forward bitwise, also after a weight update and with a
CFG step's branches replayed at once on two streams."""

import inspect
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch
from torch.utils._pytree import tree_flatten

from sglang.multimodal_gen.runtime.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.runtime.layers.lora.linear import (
    BaseLayerWithLoRA,
    replace_submodule,
    wrap_with_lora_layer,
)
from sglang.multimodal_gen.runtime.managers import forward_context
from sglang.multimodal_gen.runtime.models.dits.qwen_image import (
    QwenImageTransformer2DModel,
)
from sglang.multimodal_gen.runtime.utils import train_parity_graphs
from sglang.multimodal_gen.runtime.utils.train_parity import numerics_mode_context

pytestmark = pytest.mark.usefixtures("single_process_model_parallel")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need CUDA"
)


def test_only_a_dit_that_says_how_gets_graphs(tiny_qwen_image_dit):
    assert train_parity_graphs.install(torch.nn.Linear(2, 2)) is False
    dit = tiny_qwen_image_dit("cpu")
    eager_forward = dit.forward
    assert train_parity_graphs.install(dit)
    assert isinstance(dit.forward, train_parity_graphs.ExactShapeGraphs)
    # the denoising stage passes only the kwargs the forward's signature names
    assert inspect.signature(dit.forward) == inspect.signature(eager_forward)
    assert inspect.unwrap(dit.forward) == eager_forward


def test_calls_a_graph_cannot_replay_run_eagerly(monkeypatch, tiny_qwen_image_dit):
    monkeypatch.setattr(train_parity_graphs, "logger", MagicMock())
    dit = tiny_qwen_image_dit("cpu")
    graphs = train_parity_graphs.ExactShapeGraphs(dit)
    leaves, spec = [torch.zeros(2)], None
    with torch.no_grad():
        assert graphs._key(leaves, spec, {}) is None  # CPU tensors
        assert graphs._key([[1, 2]], spec, {}) is None  # unhashable leaf
        assert graphs._key([1], spec, {"encoder_hidden_states_mask": True}) is None
        assert graphs._key([1], spec, {}) is not None
    assert graphs._key([1], spec, {}) is None  # autograd on
    assert graphs._state() is None  # parameters on the CPU
    # each refusal says why, in the log
    reasons = [c.args[1] for c in train_parity_graphs.logger.info_once.call_args_list]
    assert reasons == [
        "an input is not a contiguous CUDA tensor",
        "an input is not hashable",
        "QwenImageTransformer2DModel does not replay calls with these inputs",
        "autograd is on",
        "a parameter or buffer is not on the GPU",
    ]


def test_the_state_changes_with_anything_a_graph_holds(
    monkeypatch, tiny_qwen_image_dit
):
    # on the CPU, as if on the GPU: the state is read the same way
    monkeypatch.setattr(train_parity_graphs, "_on_gpu", lambda tensors: True)
    dit = tiny_qwen_image_dit("cpu")
    attn = dit.transformer_blocks[1].attn
    attn.add_module("extra", wrap_with_lora_layer(ReplicatedLinear(8, 8)))
    tree = train_parity_graphs._ModuleTreeState(dit)
    state = tree.read()
    assert tree.read() == state
    # in-place updates are what a graph replays
    attn.to_q.weight.data.mul_(2)
    assert tree.read() == state

    def changes(update, undo):
        update()
        changed = tree.read() != state
        undo()
        return changed and tree.read() == state

    weight = attn.to_q.weight
    storage = weight.data
    assert changes(
        lambda: setattr(weight, "data", storage.clone()),
        lambda: setattr(weight, "data", storage),
    )
    params = attn.to_q._parameters
    assert changes(
        lambda: params.update(weight=torch.nn.Parameter(storage.clone())),
        lambda: params.update(weight=weight),
    )
    # a module deep in the tree replaced, with the same parameters
    norm = attn.norm_q
    assert changes(
        lambda: setattr(attn, "norm_q", torch.nn.Sequential(norm)),
        lambda: setattr(attn, "norm_q", norm),
    )
    # a buffer where the module had none: the dicts are read live
    assert changes(
        lambda: norm.register_buffer("extra", torch.zeros(1)),
        lambda: delattr(norm, "extra"),
    )
    lora = attn.extra
    assert changes(
        lambda: setattr(lora, "disable_lora", not lora.disable_lora),
        lambda: setattr(lora, "disable_lora", not lora.disable_lora),
    )
    # an adapter rescaled with its factors left in their storage: the scale is a
    # constant of the captured kernels
    for name, value in (("lora_alpha", 16), ("lora_rank", 8), ("strength", 0.5)):
        kept = getattr(lora, name)
        assert changes(
            lambda: setattr(lora, name, value), lambda: setattr(lora, name, kept)
        )
    handle = norm.register_forward_pre_hook(lambda *args: None)
    assert tree.read() is None
    handle.remove()
    assert tree.read() == state


def _with_lora_update_from_host(dit: QwenImageTransformer2DModel):
    """One LoRA'd linear, its update sent as the weight updater sends it:
    fp32 host tensors."""
    name = "transformer_blocks.0.attn.to_q"
    with numerics_mode_context("train_parity"):
        layer = wrap_with_lora_layer(dit.get_submodule(name))
    replace_submodule(dit, name, layer)
    layer.lora_rank, layer.lora_alpha = 4, 8
    out_features, in_features = layer.weight.shape
    generator = torch.Generator().manual_seed(0)
    layer.set_lora_weights(
        torch.randn(4, in_features, generator=generator) / 8,
        torch.randn(out_features, 4, generator=generator) / 8,
        merge_weights=False,
    )
    return layer


def _perturbed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 3 + 1
    return None


def test_a_lora_layer_states_every_scalar_its_forward_reads(tiny_qwen_image_dit):
    """Each plain scalar attribute of a train_parity LoRA layer, changed: where
    the forward's output changes (or it refuses), the layer's numerics_state
    changes too, so no such value can be left out of what a graph is keyed on."""
    dit = tiny_qwen_image_dit("cpu")
    layer = _with_lora_update_from_host(dit)
    x = torch.randn(3, layer.weight.shape[1]).to(torch.bfloat16)

    def forward():
        with torch.no_grad():
            try:
                out = layer(x)
            except Exception as exc:  # a refusal is an outcome too
                return type(exc)
        return out[0] if isinstance(out, tuple) else out

    expected, state = forward(), layer.numerics_state()
    read = []
    for name, value in list(vars(layer).items()):
        changed = _perturbed(value)
        if changed is None:
            continue
        setattr(layer, name, changed)
        out, new_state = forward(), layer.numerics_state()
        setattr(layer, name, value)
        if not (isinstance(out, torch.Tensor) and torch.equal(out, expected)):
            read.append(name)
            assert new_state != state, f"{name} is read but not in numerics_state"
    assert {"disable_lora", "lora_rank", "lora_alpha"} <= set(read)


class _Recorder:
    """Reads of ``obj``'s attributes, by ``name.attribute``."""

    def __init__(self, name, obj, reads):
        vars(self).update(_name=name, _obj=obj, _reads=reads)

    def __getattr__(self, attribute):
        self._reads.add(f"{self._name}.{attribute}")
        return getattr(self._obj, attribute)


def test_the_signature_holds_what_the_forward_reads_from_the_forward_context(
    monkeypatch, tiny_qwen_image_dit, qwen_image_dit_inputs
):
    dit = tiny_qwen_image_dit("cpu")
    _with_lora_update_from_host(dit)
    batch = SimpleNamespace(
        runtime_lora_scale=1.0, sampling_params=SimpleNamespace(quality=None)
    )

    def reads_of(run):
        reads = set()
        context = forward_context.ForwardContext(
            current_timestep=0,
            attn_metadata=None,
            forward_batch=_Recorder("forward_batch", batch, reads),
        )
        monkeypatch.setattr(
            forward_context,
            "_forward_context",
            _Recorder("context", context, reads),
        )
        with torch.no_grad():
            run()
        return reads

    forward = reads_of(lambda: dit(**qwen_image_dit_inputs(dit, "cpu", 0)))
    assert "forward_batch.runtime_lora_scale" in forward
    assert forward <= reads_of(BaseLayerWithLoRA.forward_context_state)


@needs_cuda
def test_an_adapter_rescaled_in_its_storage_replays_the_new_scale(
    monkeypatch, tiny_qwen_image_dit, qwen_image_dit_inputs
):
    dit = tiny_qwen_image_dit("cuda")
    layer = _with_lora_update_from_host(dit)
    eager_forward = dit.forward
    train_parity_graphs.install(dit)

    def rescale(alpha):
        """The same A/B storage with another alpha, as when a trainer's CUDA
        tensors arrive again through IPC."""
        lora_A, lora_B = layer.lora_A, layer.lora_B
        layer.lora_alpha = alpha
        layer.set_lora_weights(lora_A, lora_B, merge_weights=False, clear_existing=True)
        assert layer.lora_A.data_ptr() == lora_A.data_ptr()
        assert layer.lora_B.data_ptr() == lora_B.data_ptr()

    with torch.no_grad():
        inputs = qwen_image_dit_inputs(dit, "cuda", 0)
        for _ in range(3):  # eager, capture, replay
            assert torch.equal(dit(**inputs), eager_forward(**inputs))
        rescale(12)
        for _ in range(3):
            assert torch.equal(dit(**inputs), eager_forward(**inputs))
        # control: keyed on the LoRA flags alone, the graph replays the old scale
        monkeypatch.setattr(
            BaseLayerWithLoRA,
            "numerics_state",
            lambda self: (self.disable_lora, self.merged),
        )
        for _ in range(3):
            assert torch.equal(dit(**inputs), eager_forward(**inputs))
        rescale(16)
        assert not torch.equal(dit(**inputs), eager_forward(**inputs))


@needs_cuda
def test_a_lora_update_sent_from_the_host_replays(
    tiny_qwen_image_dit, qwen_image_dit_inputs
):
    dit = tiny_qwen_image_dit("cuda")
    layer = _with_lora_update_from_host(dit)
    eager_forward = dit.forward
    train_parity_graphs.install(dit)
    with torch.no_grad():
        inputs = qwen_image_dit_inputs(dit, "cuda", 0)
        for _ in range(3):
            assert torch.equal(dit(**inputs), eager_forward(**inputs))
        assert len(dit.forward.graphs) == 1
        # control: a factor on the host, which every forward would copy, keeps
        # the forward out of graphs
        layer.lora_A = torch.nn.Parameter(layer.lora_A.data.cpu())
        assert dit.forward._state() is None


@needs_cuda
def test_replays_equal_the_eager_forward_bitwise(
    tiny_qwen_image_dit, qwen_image_dit_inputs
):
    dit = tiny_qwen_image_dit("cuda")
    eager_forward = dit.forward
    train_parity_graphs.install(dit)
    graphs = dit.forward
    with torch.no_grad():
        for seed in range(4):
            inputs = qwen_image_dit_inputs(dit, "cuda", seed)
            assert torch.equal(dit(**inputs), eager_forward(**inputs))
        assert len(graphs.graphs) == 1
        # a new prompt length is a new graph, not a padded one
        inputs = qwen_image_dit_inputs(dit, "cuda", 9, text_len=11)
        for _ in range(2):
            assert torch.equal(dit(**inputs), eager_forward(**inputs))
        assert len(graphs.graphs) == 2
        # a weight update (new storage) drops every graph; control: a graph captured
        # before it still reads the old weights
        stale = next(iter(graphs.graphs.values()))
        weight = dit.proj_out.weight
        weight.data = weight.data * 1.5
        inputs = qwen_image_dit_inputs(dit, "cuda", 5)
        eager = eager_forward(**inputs)
        assert not torch.equal(stale.replay(tree_flatten(((), inputs))[0]), eager)
        assert torch.equal(dit(**inputs), eager)
        assert not graphs.graphs
        assert torch.equal(dit(**inputs), eager)
        assert len(graphs.graphs) == 1
        # an in-place update is what a graph replays
        weight.data.mul_(0.5)
        assert torch.equal(dit(**inputs), eager_forward(**inputs))
        # a text mask and module hooks run the eager forward
        masked = qwen_image_dit_inputs(dit, "cuda", 6, mask=True)
        for _ in range(2):
            assert torch.equal(dit(**masked), eager_forward(**masked))
        handle = dit.proj_out.register_forward_hook(lambda *args: None)
        assert graphs._state() is None
        handle.remove()
        # an update that drops every graph with none of them kept alive, as in a
        # server between rollouts: the next capture still succeeds and replays
        del stale
        for scale in (2.0, 0.5):
            weight.data = weight.data * scale
            for _ in range(2):
                assert torch.equal(dit(**inputs), eager_forward(**inputs))
            assert [type(g) for g in graphs.graphs.values()] == [
                train_parity_graphs._Graph
            ]


def test_cfg_branches_run_in_turn_without_graphs_on_cuda(tiny_qwen_image_dit):
    calls = []

    def predict(branch):
        calls.append(branch)
        return branch

    for dit in (torch.nn.Linear(2, 2), tiny_qwen_image_dit("cpu")):
        train_parity_graphs.install(dit)
        calls.clear()
        results = train_parity_graphs.run_cfg_branches(dit, predict, ["a", "b"])
        assert results == calls == ["a", "b"]


@needs_cuda
def test_cfg_branches_on_their_own_streams_equal_the_forwards_in_turn(
    monkeypatch, tiny_qwen_image_dit, qwen_image_dit_inputs
):
    dit = tiny_qwen_image_dit("cuda")
    eager_forward = dit.forward
    train_parity_graphs.install(dit)
    graphs = dit.forward

    def run(text_lens, compare=True):
        # first sight eager, then capture, then replays
        for seed in range(0, 40, 10):
            pair = [
                qwen_image_dit_inputs(dit, "cuda", seed + k, text_len=n)
                for k, n in enumerate(text_lens)
            ]
            outs = train_parity_graphs.run_cfg_branches(
                dit, lambda inputs: dit(**inputs), pair
            )
            for out, inputs in zip(outs, pair):
                assert not compare or torch.equal(out, eager_forward(**inputs))

    reads = []
    read = graphs.tree_state.read
    monkeypatch.setattr(graphs.tree_state, "read", lambda: reads.append(1) or read())
    with torch.no_grad():
        run((7, 7))
        run((7, 11))
        # a step whose branches replay reads the DiT's state once
        reads.clear()
        run((7, 11))
        assert len(reads) == 4
    # each branch stream replays graphs of its own from a pool of its own, also
    # for two prompts of one length
    assert len(graphs.graphs) == 3
    assert len(graphs.pools) == 2
    with torch.no_grad():
        # a weight update between steps is read by the next step; control: a
        # step that reads no state replays the old weights
        weight = dit.proj_out.weight
        weight.data = weight.data * 1.5
        run((7, 11))
        monkeypatch.setattr(graphs.tree_state, "read", lambda: graphs.state)
        weight.data = weight.data * 1.5
        with pytest.raises(AssertionError):
            run((7, 11))
    monkeypatch.setattr(graphs.tree_state, "read", read)
    # control: keyed without the stream, the two branches share one graph (whose
    # replays at once overwrite each other's inputs, so outputs are not compared)
    monkeypatch.setattr(train_parity_graphs, "_current_stream_id", lambda: None)
    graphs.state = None
    with torch.no_grad():
        run((7, 7), compare=False)
    assert len(graphs.graphs) == 1
