# SPDX-License-Identifier: Apache-2.0
"""Full-weight updates, from tensors and from disk, are checked whole (names,
dtypes, shapes, finiteness) before any parameter is written, and take the names
the trainer and the checkpoint use once LoRA wrappers rename the Linears."""

import hashlib
import math

import pytest
import torch
from safetensors.torch import save_file

from sglang.multimodal_gen.runtime.layers.lora.linear import wrap_with_lora_layer
from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import LoRAPipeline
from sglang.multimodal_gen.runtime.post_training import policy_checksum
from sglang.multimodal_gen.runtime.post_training.rollout_fingerprints import (
    RolloutFingerprints,
)
from sglang.multimodal_gen.runtime.post_training.tensor_update_checker import (
    TensorUpdateChecker,
    compute_tensor_sha256,
)
from sglang.multimodal_gen.runtime.post_training.weights_updater import (
    WeightsUpdater,
    _load_weights_into_module,
    _lora_update_problems,
)

BF16 = torch.bfloat16
RANK = 2


class _TinyDiT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=BF16)
        self.norm = torch.nn.LayerNorm(8, dtype=BF16)
        self.out = torch.nn.Linear(8, 4, dtype=BF16)


class _TestLoRAPipeline(LoRAPipeline):
    def create_pipeline_stages(self, server_args):
        pass


def _pipeline(dit: torch.nn.Module | None = None) -> LoRAPipeline:
    pipeline = object.__new__(_TestLoRAPipeline)
    pipeline.modules = {"transformer": dit if dit is not None else _TinyDiT()}
    pipeline.exclude_lora_layers = []
    pipeline.lora_initialized = False
    return pipeline


def _with_adapter(dit: torch.nn.Module) -> torch.nn.Module:
    """`dit` with its Linears LoRA-wrapped (``proj.base_layer.weight``) and an
    adapter on ``proj``, as after the first LoRA push."""
    dit.proj = wrap_with_lora_layer(dit.proj)
    dit.out = wrap_with_lora_layer(dit.out)
    dit.proj.lora_rank, dit.proj.lora_alpha = RANK, 4
    dit.proj.set_lora_weights(
        torch.randn(RANK, 8).to(BF16),
        torch.randn(8, RANK).to(BF16),
        merge_weights=False,
        clear_existing=True,
    )
    return dit


def _params(dit) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in dit.named_parameters()}


def _changed(before, dit) -> set[str]:
    after = _params(dit)
    assert after.keys() == before.keys()
    return {name for name in before if not torch.equal(before[name], after[name])}


def _update(pipeline, named_tensors, **kwargs):
    return WeightsUpdater(pipeline).update_weights_from_tensor(named_tensors, **kwargs)


def _disk_update(pipeline, tmp_path, tensors: dict[str, torch.Tensor]):
    folder = tmp_path / "transformer"
    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return WeightsUpdater(pipeline).update_weights_from_disk(
        str(tmp_path), target_modules=["transformer"]
    )


def test_trainer_names_update_a_lora_wrapped_dit():
    """``proj.weight`` is ``proj.base_layer.weight`` once an adapter is loaded;
    an update under the trainer's name loads it, from tensors and from disk."""
    dit = _with_adapter(_TinyDiT())
    before = _params(dit)
    new = torch.ones(8, 8, dtype=BF16)
    ok, message = _update(
        _pipeline(dit), [("proj.weight", new), ("norm.weight", torch.zeros(8))]
    )
    assert ok, message
    assert message == "Updated 1 modules from tensor (transformer): 2 tensors."
    assert _changed(before, dit) == {"proj.base_layer.weight", "norm.weight"}
    assert torch.equal(dit.proj.base_layer.weight, new)


def test_wrapped_names_still_update():
    dit = _with_adapter(_TinyDiT())
    before = _params(dit)
    ok, message = _update(
        _pipeline(dit), [("out.base_layer.bias", torch.ones(4, dtype=BF16))]
    )
    assert ok, message
    assert _changed(before, dit) == {"out.base_layer.bias"}


def _assert_refused_unchanged(dit, result, *fragments):
    before = _params(dit)
    ok, message = result()
    assert not ok, message
    assert message.startswith("Weight update refused, served weights unchanged")
    for fragment in fragments:
        assert fragment in message, message
    assert _changed(before, dit) == set()


# Each refused whole: the valid first tensor is not written either.
BAD_TENSORS = [
    (torch.ones(3, 3), "out.weight: shape (3, 3); the parameter is (4, 8)"),
    (torch.ones(4, 8, dtype=torch.int64), "out.weight: dtype torch.int64"),
    (torch.ones(4, 8, dtype=torch.bool), "out.weight: dtype torch.bool"),
    (torch.full((4, 8), math.nan), "out.weight: contains NaN or Inf"),
    (torch.full((4, 8), -math.inf), "out.weight: contains NaN or Inf"),
    # finite in fp32, infinite once cast to the parameter's bf16
    (torch.full((4, 8), 3.4e38), "out.weight: contains NaN or Inf (as torch.bfloat16"),
]


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "lora-wrapped"])
@pytest.mark.parametrize(
    "bad, named", BAD_TENSORS, ids=["shape", "int", "bool", "nan", "inf", "overflow"]
)
def test_a_bad_last_tensor_refuses_the_whole_update(wrapped, bad, named):
    dit = _with_adapter(_TinyDiT()) if wrapped else _TinyDiT()
    tensors = [("proj.weight", torch.ones(8, 8)), ("out.weight", bad)]
    _assert_refused_unchanged(dit, lambda: _update(_pipeline(dit), tensors), named)


def test_one_parameter_given_twice_is_refused():
    dit = _with_adapter(_TinyDiT())
    tensors = [
        ("proj.weight", torch.ones(8, 8)),
        ("proj.base_layer.weight", torch.zeros(8, 8)),
    ]
    _assert_refused_unchanged(
        dit,
        lambda: _update(_pipeline(dit), tensors),
        "proj.base_layer.weight: proj.weight already loads proj.base_layer.weight",
    )


@pytest.mark.parametrize(
    "name",
    ["proj.lora_A", "proj.lora_A.weight", "proj.lora_B", "proj.lora_A.default.weight"],
)
def test_adapter_tensors_need_the_lora_mode(name):
    """Under the wrapper's own names (``proj.lora_A``) they are parameters: the
    full-weight path must not write them in place, past the LoRA rules."""
    dit = _with_adapter(_TinyDiT())
    adapter = policy_checksum.cached_adapter_checksum(dit)
    shape = tuple(getattr(dit.proj, name.split(".")[1]).shape)
    _assert_refused_unchanged(
        dit,
        lambda: _update(_pipeline(dit), [(name, torch.zeros(shape))]),
        f"1 LoRA adapter tensor(s) ({name})",
        "LoRA A/B tensors need weight_update_mode='lora_merge'",
    )
    assert policy_checksum.cached_adapter_checksum(dit) == adapter


class _FusedDiT(torch.nn.Module):
    """A fused q/k parameter loaded by a weight_loader, section by section."""

    def __init__(self):
        super().__init__()
        self.to_qk = torch.nn.Linear(4, 4, bias=False, dtype=BF16)
        self.to_qk.weight.weight_loader = self._load_section
        self.param_names_mapping = {
            r"^to_q\.(weight)$": (r"to_qk.\1", 0, 2),
            r"^to_k\.(weight)$": (r"to_qk.\1", 1, 2),
        }

    @staticmethod
    def _load_section(param, loaded_weight, shard_id):
        section = param.data.narrow(0, 2 * shard_id, 2)
        assert section.shape == loaded_weight.shape, "section shape"
        section.copy_(loaded_weight)


def test_a_loader_refusal_is_found_before_any_section_is_written():
    dit = _FusedDiT()
    tensors = [("to_q.weight", torch.ones(2, 4)), ("to_k.weight", torch.ones(3, 4))]
    _assert_refused_unchanged(
        dit,
        lambda: _update(_pipeline(dit), tensors),
        "to_k.weight: shape (3, 4) does not load into the parameter (4, 4) "
        "(section 1): section shape",
    )
    ok, message = _update(
        _pipeline(dit), [tensors[0], ("to_k.weight", torch.ones(2, 4))]
    )
    assert ok, message
    assert torch.equal(dit.to_qk.weight, torch.ones(4, 4, dtype=BF16))


class _ColumnLoaderDiT(torch.nn.Module):
    """A loader that takes this rank's rows of the whole tensor, as tensor
    parallel linears do."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False, dtype=BF16)
        self.proj.weight.weight_loader = self._load_rows

    @staticmethod
    def _load_rows(param, loaded_weight):
        param.data.copy_(loaded_weight.narrow(0, 0, param.shape[0]))


@pytest.mark.usefixtures("single_process_model_parallel")
def test_without_tensor_parallelism_a_loader_gets_the_whole_shape():
    """The loader would cut the first rows of a longer tensor and load them."""
    dit = _ColumnLoaderDiT()
    _assert_refused_unchanged(
        dit,
        lambda: _update(_pipeline(dit), [("proj.weight", torch.ones(6, 4))]),
        "proj.weight: shape (6, 4); the parameter is (4, 4)",
    )
    ok, message = _update(_pipeline(dit), [("proj.weight", torch.ones(4, 4))])
    assert ok, message


def test_disk_update_after_a_lora_push_loads_every_tensor(tmp_path):
    """The checkpoint's ``proj.weight`` loads too: skipped with a warning, the
    update would answer "Updated 1 modules" having loaded only the norm."""
    dit = _with_adapter(_TinyDiT())
    before = _params(dit)
    new = torch.ones(8, 8, dtype=BF16)
    ok, message = _disk_update(
        _pipeline(dit), tmp_path, {"proj.weight": new, "norm.weight": torch.zeros(8)}
    )
    assert ok, message
    assert message == "Updated 1 modules (transformer): 2 tensors."
    assert _changed(before, dit) == {"proj.base_layer.weight", "norm.weight"}


@pytest.mark.parametrize(
    "tensor, named",
    [
        (torch.ones(8, 8), "1 tensor(s) match no parameter of transformer: nowhere"),
        (torch.full((4, 8), math.nan), "out.weight: contains NaN or Inf"),
        (torch.ones(4, 7), "out.weight: shape (4, 7); the parameter is (4, 8)"),
    ],
    ids=["unknown", "nan", "shape"],
)
def test_disk_update_is_refused_before_writing(tmp_path, tensor, named):
    dit = _with_adapter(_TinyDiT())
    name = "nowhere" if named.endswith("nowhere") else "out.weight"
    tensors = {"norm.weight": torch.zeros(8, dtype=BF16), name: tensor}
    _assert_refused_unchanged(
        dit, lambda: _disk_update(_pipeline(dit), tmp_path, tensors), named
    )


def test_checker_takes_the_trainer_names():
    dit = _with_adapter(_TinyDiT())
    expected = {
        "proj.weight": compute_tensor_sha256(dit.proj.base_layer.weight),
        "norm.weight": compute_tensor_sha256(dit.norm.weight),
    }
    ok, message = TensorUpdateChecker(_pipeline(dit)).verify("transformer", expected)
    assert ok, message
    expected["proj.weight"] = hashlib.sha256(b"another").hexdigest()
    ok, message = TensorUpdateChecker(_pipeline(dit)).verify("transformer", expected)
    assert not ok and "checksum mismatch for 1 tensor(s): proj.weight" in message


def _adapter(scale_b: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    return [
        ("proj.lora_A.weight", torch.randn(RANK, 8)),
        ("proj.lora_B.weight", torch.randn(8, RANK) * scale_b),
    ]


@pytest.mark.parametrize(
    "alpha, scale_b, named",
    [
        (1e300, 1.0, "lora_alpha / rank = 1e+300 / 2 must be a finite, nonzero fp32"),
        (10**400, 1.0, f"lora_alpha / rank = {10**400!r} / 2 must be a finite"),
        (1e-60, 1.0, "lora_alpha / rank = 1e-60 / 2 must be a finite, nonzero fp32"),
        (math.inf, 1.0, "lora_alpha must be a positive number, got inf"),
        (math.nan, 1.0, "lora_alpha must be a positive number, got nan"),
        (1e37, 1e3, "proj.lora_B times the scale lora_alpha / rank = 5e+36 overflows"),
    ],
    ids=["1e300", "huge int", "scale 0 in fp32", "inf", "nan", "B overflows"],
)
def test_lora_alpha_out_of_range_is_refused(alpha, scale_b, named):
    """In every numerics mode: lora_alpha=1e300 is refused (served, every output
    is NaN)."""
    problems = _lora_update_problems(_adapter(scale_b), _TinyDiT(), [], RANK, alpha)
    assert any(named in p for p in problems), problems
    dit = _TinyDiT()
    before = _params(dit)
    pipeline = _pipeline(dit)
    ok, message = _update(
        pipeline, _adapter(scale_b), weight_update_mode="lora_merge", lora_alpha=alpha
    )
    assert not ok and named in message, message
    assert not pipeline.lora_initialized and _changed(before, dit) == set()


def test_lora_alpha_in_range_has_no_problems():
    dit = _TinyDiT()
    assert _lora_update_problems(_adapter(), dit, [], RANK, 1e6) == []
    assert _lora_update_problems(_adapter(), dit, [], None, None) == []


def test_writes_in_place_drop_the_cached_adapter_checksum():
    """The updater writes under inference mode through ``.data``: the written
    tensor keeps its identity and its version counter, which the cached
    checksum alone would not see."""
    dit = _with_adapter(_TinyDiT())
    cached = policy_checksum.cached_adapter_checksum(dit)
    lora_A = dit.proj.lora_A
    version = lora_A._version
    with torch.inference_mode():
        lora_A.data.copy_(torch.ones_like(lora_A))
    assert lora_A._version == version
    assert policy_checksum.cached_adapter_checksum(dit) == cached  # stale

    _load_weights_into_module(dit, [("norm.bias", torch.ones(8))])

    # the next rollout's fingerprints carry what /get_policy_checksum reports
    served = policy_checksum.module_policy_checksum(
        dit, dit.named_parameters(), include_base=False
    )["adapter"]
    assert served != cached
    fingerprints = RolloutFingerprints()
    output = torch.zeros(1, 2, dtype=BF16)
    fingerprints.record_step(0, dit, {"conditional": output}, output)
    assert fingerprints.per_output()[0]["steps"][0]["adapter"] == served
