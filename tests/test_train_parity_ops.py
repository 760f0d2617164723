"""Op-level parity of `numerics="train_parity"`: each op the fork gives a train_parity forward equals
its diffusers / PEFT counterpart bit for bit, the diffusers side run under CUDA's bf16 autocast
policy (emulated on CPU), with bf16 parameters and activations. Negative controls show that the
same ops built in the default mode differ from those references, so the comparisons can fail.
"""

from __future__ import annotations

import os

# Before torch is imported: upstream compiles forward_native on CPU (see also `cpu_runtime`).
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import itertools  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from functools import partial  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers.models.attention_dispatch import dispatch_attention_fn  # noqa: E402
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_qwenimage import (  # noqa: E402
    QwenImageTransformerBlock,
    apply_rotary_emb_qwen,
)
from sglang_train_parity.autocast_emulation import cuda_autocast  # noqa: E402
from sglang_train_parity.cpu_kernels import register_cpu_kernels  # noqa: E402
from torch import nn  # noqa: E402

from sglang.multimodal_gen.runtime.layers import train_parity_ops  # noqa: E402
from sglang.multimodal_gen.runtime.layers.elementwise import MulAdd  # noqa: E402
from sglang.multimodal_gen.runtime.layers.fused_scale_shift_gate import (  # noqa: E402
    FusedLayerNormScaleShiftGateSelect01,
    FusedResidualLayerNormScaleShiftGateSelect01,
)
from sglang.multimodal_gen.runtime.layers.layernorm import (  # noqa: E402
    LayerNormScaleShift,
    RMSNorm,
    ScaleResidualLayerNormScaleShift,
)
from sglang.multimodal_gen.runtime.utils.train_parity import (  # noqa: E402
    numerics_mode_context,
)
from tests.tp_lora import (  # noqa: E402
    BF16,
    IN_FEATURES,
    OUT_FEATURES,
    LoraMasters,
    init_parallel,
    peft_lora_linear,
    run_layer,
    sglang_lora_layer,
)

TRAIN_PARITY, DEFAULT = "train_parity", "default"
EPS = 1e-6
HIDDEN = 256  # a multiple of 256 like Qwen-Image's 3072, small enough for CPU
HEAD_DIM = 128
HEADS = 2
# batch x sequence length x layout of the activations; odd lengths catch per-row tails.
GRID = list(itertools.product((1, 2), (7, 13), ("contiguous", "sliced")))
GRID_IDS = [f"b{b}-s{s}-{layout}" for b, s, layout in GRID]


@pytest.fixture(scope="module", autouse=True)
def cpu_runtime():
    # Upstream's default CPU norm path calls sgl_kernel CPU ops; the stand-ins make it runnable.
    register_cpu_kernels()
    # TORCH_COMPILE_DISABLE only counts if set before torch._dynamo's config was first imported
    # (another test module may have done it); dynamo reads this flag at call time.
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


# ------------------------------------------------------------------------------------ helpers


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(BF16)


def arrange(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`, or the same values as a non-contiguous slice of a wider tensor."""
    if layout == "contiguous":
        return t
    return torch.cat([t, torch.zeros_like(t)], dim=-1)[..., : t.shape[-1]]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns, widened: unlike torch.equal this tells -0.0 from +0.0."""
    int_dtype = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype]
    return t.contiguous().view(int_dtype).to(torch.int64)


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Max abs difference of the bit patterns (ULPs between same-sign values)."""
    return int((bits(actual) - bits(expected)).abs().max())


def as_tuple(outputs) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def mismatches(actual, expected) -> list[str]:
    """How two (tuples of) outputs differ bit for bit; empty when they do not."""
    problems = []
    pairs = zip(as_tuple(actual), as_tuple(expected), strict=True)
    for i, (a, e) in enumerate(pairs):
        if (a.dtype, a.shape) != (e.dtype, e.shape):
            problems.append(
                f"output {i}: {a.dtype} {tuple(a.shape)} vs {e.dtype} {tuple(e.shape)}"
            )
        elif not torch.equal(bits(a), bits(e)):
            differ = int((bits(a) != bits(e)).sum())
            problems.append(
                f"output {i} {tuple(a.shape)}: {ulp_distance(a, e)} ULP, {differ} elements differ"
            )
    return problems


def assert_bitwise(actual, expected) -> None:
    problems = mismatches(actual, expected)
    assert not problems, "; ".join(problems)


def make_op(cls: type, numerics: str, *args, **kwargs) -> nn.Module:
    """`cls` built in `numerics` mode (CustomOp picks its forward at construction)."""
    with numerics_mode_context(numerics):
        op = cls(*args, **kwargs)
    is_train_parity = op._forward_method.__name__ == "forward_train_parity"
    assert is_train_parity == (numerics == TRAIN_PARITY)
    return op


@contextmanager
def reference() -> Iterator[None]:
    """The trainer's regime: CUDA bf16 autocast (emulated on CPU), no autograd."""
    with torch.no_grad(), cuda_autocast("cpu"):
        yield


def diffusers_layer_norm(x: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's img/txt_norm1/2: fp32 out under autocast."""
    return nn.LayerNorm(HIDDEN, elementwise_affine=False, eps=EPS)(x)


def diffusers_modulate(x: torch.Tensor, mod_params: torch.Tensor, index=None):
    """QwenImageTransformerBlock._modulate (it does not use `self`): (modulated, gate [B, L|1, D])."""
    return QwenImageTransformerBlock._modulate(None, x, mod_params, index)


def modulation(mod_params: torch.Tensor, dims: int) -> list[torch.Tensor]:
    """shift, scale, gate as chunks of the modulation Linear's output (non-contiguous views), as
    [B, D] or [B, 1, D]."""
    chunks = mod_params.chunk(3, dim=-1)
    return [c.unsqueeze(1) if dims == 3 else c for c in chunks]


# ------------------------------------------------- norm / modulation ops: (actual, expected) cases


def rms_norm_case(numerics, batch, seq, layout, feature_shape):
    width = feature_shape[-1]
    x = arrange(rand(batch, seq, *feature_shape), layout)
    # Not ones: the weight multiply must round where diffusers rounds it.
    weight = 1 + rand(width, scale=0.1)
    op = make_op(RMSNorm, numerics, width, eps=EPS).to(BF16)
    diffusers_norm = DiffusersRMSNorm(width, eps=EPS).to(BF16)
    for norm in (op, diffusers_norm):
        norm.weight.data.copy_(weight)
    with torch.no_grad():
        actual = op(x)
    with reference():
        expected = diffusers_norm(x)
    return actual, expected


def layer_norm_scale_shift_case(numerics, batch, seq, layout, mod_dims):
    x = arrange(rand(batch, seq, HIDDEN), layout)
    mod_params = rand(batch, 3 * HIDDEN, scale=0.5)
    shift, scale, _ = modulation(mod_params, mod_dims)
    op = make_op(LayerNormScaleShift, numerics, HIDDEN, eps=EPS)
    with torch.no_grad():
        actual = op(x, shift, scale)
    with reference():
        expected, _ = diffusers_modulate(diffusers_layer_norm(x), mod_params)
    # fp32 in diffusers until the next Linear's autocast cast rounds it to bf16.
    return actual, expected.to(BF16)


def scale_residual_case(numerics, batch, seq, layout, mod_dims, unit_gate):
    residual, x = (arrange(rand(batch, seq, HIDDEN), layout) for _ in range(2))
    mod_params = rand(batch, 3 * HIDDEN, scale=0.5)
    shift, scale, gate = modulation(mod_params, mod_dims)
    op = make_op(ScaleResidualLayerNormScaleShift, numerics, HIDDEN, eps=EPS)
    with torch.no_grad():
        actual = op(residual, x, 1 if unit_gate else gate, shift, scale)
    with reference():
        # diffusers' block: `hidden_states + gate * attn_output` with _modulate's [B, 1, D] gate.
        _, block_gate = diffusers_modulate(x, mod_params)
        residual_out = residual + x if unit_gate else residual + block_gate * x
        modulated, _ = diffusers_modulate(
            diffusers_layer_norm(residual_out), mod_params
        )
    return actual, (modulated.to(BF16), residual_out)


def mul_add_case(numerics, batch, seq, layout):
    x, residual = rand(batch, seq, HIDDEN), rand(batch, seq, HIDDEN)
    gate = rand(batch, 1, HIDDEN, scale=0.5)
    # -0.0 gates over -0.0 residuals: `0 + gate` would turn the sum's -0.0 into +0.0.
    gate[..., :8] = -0.0
    residual[..., :8] = -0.0
    x, residual = arrange(x, layout), arrange(residual, layout)
    op = make_op(MulAdd, numerics)
    with torch.no_grad():
        actual = op(x, gate, residual, 0)
    with reference():
        expected = residual + gate * x
    return actual, expected


def select01_case(numerics, batch, seq, layout, with_residual):
    """zero_cond_t: per sample, tokens before a boundary take modulation 0, the rest 1."""
    x = arrange(rand(batch, seq, HIDDEN), layout)
    mod_params = rand(2 * batch, 3 * HIDDEN, scale=0.5)
    index = torch.stack(
        [(torch.arange(seq) >= seq // 2 + b).int() for b in range(batch)]
    )
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    selectable = [
        t[half]
        for half in (slice(batch), slice(batch, None))
        for t in (scale, shift, gate)
    ]
    if with_residual:
        residual = arrange(rand(batch, seq, HIDDEN), layout)
        # A previous select's per-token [B, L, D] gate.
        residual_gate = rand(batch, seq, HIDDEN, scale=0.5)
        op = make_op(FusedResidualLayerNormScaleShiftGateSelect01, numerics)
        inputs = (x, residual, residual_gate)
    else:
        op = make_op(FusedLayerNormScaleShiftGateSelect01, numerics)
        inputs = (x,)
    with torch.no_grad():
        actual = op(*inputs, None, None, *selectable, index, EPS)
    with reference():
        normed_input = residual + residual_gate * x if with_residual else x
        modulated, gate_out = diffusers_modulate(
            diffusers_layer_norm(normed_input), mod_params, index
        )
    if with_residual:
        return actual, (modulated.to(BF16), normed_input, gate_out)
    return actual, (modulated.to(BF16), gate_out)


NORM_CASES = {
    "rms_norm-heads": partial(rms_norm_case, feature_shape=(HEADS, HEAD_DIM)),
    "rms_norm-hidden": partial(rms_norm_case, feature_shape=(HIDDEN,)),
    "layer_norm_scale_shift-2d": partial(layer_norm_scale_shift_case, mod_dims=2),
    "layer_norm_scale_shift-3d": partial(layer_norm_scale_shift_case, mod_dims=3),
    "scale_residual-gate2d": partial(scale_residual_case, mod_dims=2, unit_gate=False),
    "scale_residual-gate3d": partial(scale_residual_case, mod_dims=3, unit_gate=False),
    "scale_residual-gate1": partial(scale_residual_case, mod_dims=3, unit_gate=True),
    "mul_add": mul_add_case,
    "select01": partial(select01_case, with_residual=False),
    "select01-residual": partial(select01_case, with_residual=True),
}


@pytest.mark.parametrize("batch,seq,layout", GRID, ids=GRID_IDS)
@pytest.mark.parametrize("case", NORM_CASES)
def test_norm_op_matches_diffusers(case, batch, seq, layout):
    assert_bitwise(*NORM_CASES[case](TRAIN_PARITY, batch, seq, layout))


@pytest.mark.parametrize("case", NORM_CASES)
def test_default_mode_norm_op_differs(case):
    """The control: upstream's CPU forward of the same op misses diffusers' bits somewhere."""
    assert any(mismatches(*NORM_CASES[case](DEFAULT, *point)) for point in GRID)


def test_rms_norm_weight_before_rounding_differs():
    """The rounding order is what matters: the weight multiplied in fp32 before the one rounding
    (upstream's forward_native) misses diffusers' bits; rounding first hits them."""
    x, weight = rand(2, 13, HIDDEN), 1 + rand(HIDDEN, scale=0.1)
    diffusers_norm = DiffusersRMSNorm(HIDDEN, eps=EPS).to(BF16)
    diffusers_norm.weight.data.copy_(weight)
    with reference():
        expected = diffusers_norm(x)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    assert mismatches((normed * weight).to(BF16), expected)
    assert not mismatches(normed.to(BF16) * weight, expected)


# ------------------------------------------------------------ RoPE, attention, CFG rescale


@pytest.mark.parametrize("batch,seq,layout", GRID, ids=GRID_IDS)
def test_rotary_emb_matches_diffusers(batch, seq, layout):
    x = arrange(rand(batch, seq, HEADS, HEAD_DIM), layout)
    angles = torch.randn(seq, HEAD_DIM // 2) * 10
    # complex64 [S, D / 2], as QwenEmbedRope builds its tables.
    freqs = torch.polar(torch.ones_like(angles), angles)
    actual = train_parity_ops.rotary_emb(x, freqs)
    with reference():
        expected = apply_rotary_emb_qwen(x, freqs, use_real=False)
    assert_bitwise(actual, expected)


@pytest.mark.parametrize("batch,seq,layout", GRID, ids=GRID_IDS)
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding_mask"])
def test_joint_attention_matches_diffusers(masked, batch, seq, layout):
    q, k, v = (arrange(rand(batch, seq, HEADS, 64), layout) for _ in range(3))
    mask = None
    if masked:  # each row pads a different number of tokens
        lengths = torch.tensor([seq - 2 - b for b in range(batch)])
        mask = torch.arange(seq)[None] < lengths[:, None]
    with torch.no_grad():
        actual = train_parity_ops.joint_attention(q, k, v, mask)
    with reference():
        expected = dispatch_attention_fn(
            q,
            k,
            v,
            attn_mask=None if mask is None else mask[:, None, None, :],
            backend="native",
        )
    assert_bitwise(actual, expected)


@pytest.mark.parametrize("batch,seq,layout", GRID, ids=GRID_IDS)
def test_cfg_norm_rescale_matches_trainer(batch, seq, layout):
    cond, uncond = rand(batch, seq, 64), rand(batch, seq, 64)
    combined = uncond + 4.0 * (cond - uncond)
    combined[0, 0] = 0  # an all-zero prediction: the clamp keeps it 0
    cond, combined = arrange(cond, layout), arrange(combined, layout)
    actual = train_parity_ops.cfg_norm_rescale(combined, cond)
    with reference():
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        noise_norm = torch.norm(combined, dim=-1, keepdim=True).clamp_min(1e-12)
        expected = combined * (cond_norm / noise_norm)
    assert expected.dtype == torch.float32
    assert_bitwise(actual, expected)


# --------------------------------------------------------------------------------------- LoRA

LORA_KINDS = ("column", "row", "replicated", "nn.Linear")
# (rank, alpha): alpha / rank a power of two, and two that are not.
LORA_SCALINGS = {"2.0": (4, 8), "1.5": (4, 6), "0.3": (10, 3)}
LORA_GRID = [(1, 7, "contiguous"), (2, 13, "sliced")]


@pytest.fixture(scope="module")
def tp1():
    """sglang's linear layers need the (single-process) tensor-parallel group."""
    init_parallel(tp_size=1)


def lora_case(kind, scaling, numerics, merge_weights=False, point=LORA_GRID[-1]):
    batch, seq, layout = point
    masters = LoraMasters.random(*LORA_SCALINGS[scaling])
    x = arrange(rand(batch, seq, IN_FEATURES), layout)
    layer = sglang_lora_layer(kind, masters, numerics, merge_weights)
    peft_linear = peft_lora_linear(masters)
    with reference():
        expected = peft_linear(x)
    return layer, run_layer(layer, x), expected


@pytest.mark.parametrize("point", LORA_GRID, ids=lambda p: f"b{p[0]}-s{p[1]}-{p[2]}")
@pytest.mark.parametrize("scaling", LORA_SCALINGS)
@pytest.mark.parametrize("kind", LORA_KINDS)
def test_lora_matches_peft(tp1, kind, scaling, point):
    layer, actual, expected = lora_case(kind, scaling, TRAIN_PARITY, point=point)
    assert layer.peft_forward
    assert layer.lora_A.dtype == layer.lora_B.dtype == BF16  # the masters' bf16 copies
    assert_bitwise(actual, expected)


@pytest.mark.parametrize(
    "merge_weights", [False, True], ids=["default-unmerged", "merged"]
)
@pytest.mark.parametrize("kind", LORA_KINDS)
def test_default_or_merged_lora_differs(tp1, kind, merge_weights):
    """The control: upstream's fp32 delta, or the update merged into the bf16 weight, misses
    PEFT's bits at a scale that is not a power of two."""
    layer, actual, expected = lora_case(kind, "0.3", DEFAULT, merge_weights)
    assert not layer.peft_forward
    assert mismatches(actual, expected)
