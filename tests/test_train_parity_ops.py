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
import math  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from functools import cache, partial  # noqa: E402
from unittest.mock import patch  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers.models.attention_dispatch import dispatch_attention_fn  # noqa: E402
from diffusers.models.normalization import FP32LayerNorm  # noqa: E402
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402
from diffusers.models.transformers import transformer_qwenimage21  # noqa: E402
from diffusers.models.transformers import transformer_wan  # noqa: E402
from diffusers.models.transformers.transformer_qwenimage import (  # noqa: E402
    QwenImageTransformerBlock,
    apply_rotary_emb_qwen,
)
from sglang_train_parity.autocast_emulation import (  # noqa: E402
    CUDA_POLICY,
    cuda_autocast,
)
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
from sglang.multimodal_gen.runtime.layers.rotary_embedding.mrope import (  # noqa: E402
    NDRotaryEmbedding,
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


# ---------------------------------------------------------------------------------------- Wan

# Wan's fp32 modulation: every norm / residual site rounds once, where WanTransformerBlock does.
# temb [B, 6, D] (Wan2.1, Wan2.2 A14B) or per token [B, L, 6, D] (Wan2.2 TI2V-5B).
WAN_MODULATION = ("per_sample", "per_token")
# latent token grids (frames, height, width) after the (1, 2, 2) patch: odd sequence lengths.
WAN_TOKEN_GRIDS = ((1, 7, 1), (3, 3, 5))
WAN_GRID = list(itertools.product((1, 2), WAN_TOKEN_GRIDS, ("contiguous", "sliced")))
WAN_GRID_IDS = [f"b{b}-{'x'.join(map(str, g))}-{layout}" for b, g, layout in WAN_GRID]
# What CUDA autocast does with rms_norm: fp32 from torch 2.12 on, the input dtype in 2.11 (the
# trainer's). The emulation follows the installed torch; `wan_attention` emulates the other.
RMS_NORM_RULES = {"fp32": True, "input_dtype": False}
RULE_PARAMS = dict(argvalues=list(RMS_NORM_RULES.values()), ids=list(RMS_NORM_RULES))
EMULATED_RMS_NORM_IN_FP32 = "rms_norm" in CUDA_POLICY


def wan_modulation(batch: int, seq: int, per_token: bool) -> list[torch.Tensor]:
    """WanTransformerBlock's fp32 shift, scale, gate, c_shift, c_scale, c_gate: the bf16
    table + temb.float(), as its forward writes them; [B, 1, D] views or [B, L, D]."""
    table = rand(1, 6, HIDDEN, scale=0.1)
    if per_token:
        temb = rand(batch, seq, 6, HIDDEN, scale=0.5)
        chunks = (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return [c.squeeze(2) for c in chunks]
    return list((table + rand(batch, 6, HIDDEN, scale=0.5).float()).chunk(6, dim=1))


def fp32_layer_norm(affine: bool = False) -> nn.Module:
    """diffusers' FP32LayerNorm of Wan's norm1/2/3 and norm_out, bf16 affine as the trainer's."""
    norm = FP32LayerNorm(HIDDEN, EPS, elementwise_affine=affine)
    if affine:
        norm.weight.data = 1 + rand(HIDDEN, scale=0.1)
        norm.bias.data = rand(HIDDEN, scale=0.1)
    return norm


def wan_norm1_case(numerics, batch, seq, layout, per_token):
    """norm1 + modulation. Other rounding: the norm's output rounded before the modulation
    (FP32LayerNorm of the bf16 activations, without diffusers' `.float()`)."""
    x = arrange(rand(batch, seq, HIDDEN), layout)
    shift, scale, *_ = wan_modulation(batch, seq, per_token)
    op = make_op(LayerNormScaleShift, numerics, HIDDEN, eps=EPS, dtype=torch.float32)
    with torch.no_grad():
        actual = op(x, shift, scale)
    norm1 = fp32_layer_norm()
    with reference():
        # transformer_wan.py, WanTransformerBlock.forward, "1. Self-attention".
        expected = (norm1(x.float()) * (1 + scale) + shift).type_as(x)
        other = (norm1(x) * (1 + scale) + shift).type_as(x)
    return actual, expected, other


def wan_self_attn_residual_case(numerics, batch, seq, layout, per_token):
    """sglang's self_attn_residual_norm: diffusers' gated residual, then norm2 (affine).
    Other rounding: norm2 of the fp32 residual sum before it is rounded (a fused kernel's
    order)."""
    residual, x = (arrange(rand(batch, seq, HIDDEN), layout) for _ in range(2))
    gate = wan_modulation(batch, seq, per_token)[2]
    norm2 = fp32_layer_norm(affine=True)
    op = make_op(
        ScaleResidualLayerNormScaleShift,
        numerics,
        HIDDEN,
        eps=EPS,
        elementwise_affine=True,
        dtype=torch.float32,
    ).to(BF16)
    op.norm.load_state_dict(norm2.state_dict())
    null = torch.zeros(1, dtype=BF16)  # sglang's null_shift / null_scale
    with torch.no_grad():
        normed, residual_out = op(residual, x, gate, null, null)
    # sglang's WanTransformerBlock._cross_and_ffn rounds both to the activation dtype.
    actual = normed.to(BF16), residual_out.to(BF16)
    with reference():
        # WanTransformerBlock.forward: the residual after attn1, then "2. Cross-attention".
        hidden = (residual.float() + x * gate).type_as(residual)
        expected = norm2(hidden.float()).type_as(hidden)
        other = norm2(residual.float() + x * gate).type_as(hidden)
    return actual, (expected, hidden), (other, hidden)


def wan_cross_attn_residual_case(numerics, batch, seq, layout, per_token):
    """sglang's cross_attn_residual_norm: the ungated bf16 residual, then norm3 + modulation.
    Other rounding: norm3 of the fp32 sum before it is rounded."""
    residual, x = (arrange(rand(batch, seq, HIDDEN), layout) for _ in range(2))
    *_, c_shift, c_scale, _ = wan_modulation(batch, seq, per_token)
    op = make_op(
        ScaleResidualLayerNormScaleShift, numerics, HIDDEN, eps=EPS, dtype=torch.float32
    )
    with torch.no_grad():
        normed, residual_out = op(residual, x, 1, c_shift, c_scale)
    actual = normed.to(BF16), residual_out.to(BF16)
    norm3 = fp32_layer_norm()
    with reference():
        # WanTransformerBlock.forward: the residual after attn2, then "3. Feed-forward".
        hidden = residual + x
        expected = (norm3(hidden.float()) * (1 + c_scale) + c_shift).type_as(hidden)
        unrounded = residual.float() + x
        other = (norm3(unrounded) * (1 + c_scale) + c_shift).type_as(hidden)
    return actual, (expected, hidden), (other, hidden)


def wan_mlp_residual_case(numerics, batch, seq, layout, per_token):
    """The FFN's gated residual (MulAdd). Other rounding: the fp32 product rounded to bf16
    before the sum (Qwen's two roundings)."""
    ff_output, residual = rand(batch, seq, HIDDEN), rand(batch, seq, HIDDEN)
    c_gate = wan_modulation(batch, seq, per_token)[5]
    # -0.0 gates over -0.0 residuals: `0 + gate` would turn the sum's -0.0 into +0.0.
    c_gate[..., :8] = -0.0
    residual[..., :8] = -0.0
    ff_output, residual = arrange(ff_output, layout), arrange(residual, layout)
    op = make_op(MulAdd, numerics)
    with torch.no_grad():
        # sglang's WanTransformerBlock: self.mlp_residual(...).to(orig_dtype)
        actual = op(ff_output, c_gate, residual).to(BF16)
    with reference():
        # WanTransformerBlock.forward, the end of "3. Feed-forward".
        expected = (residual.float() + ff_output.float() * c_gate).type_as(residual)
        other = residual + (ff_output.float() * c_gate).type_as(residual)
    return actual, expected, other


def wan_norm_out_case(numerics, batch, seq, layout, per_token):
    """The output norm: bf16 modulation (bf16 table + bf16 temb), fp32 norm. Other rounding:
    the norm's output rounded before the modulation, as for norm1."""
    x = arrange(rand(batch, seq, HIDDEN), layout)
    table = rand(1, 2, HIDDEN, scale=0.1)
    # WanTransformer3DModel.forward, "5. Output norm": [B, L, D] (wan 2.2 ti2v) or [B, 1, D].
    if per_token:
        temb = rand(batch, seq, HIDDEN, scale=0.5)
        shift, scale = (table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        temb = rand(batch, HIDDEN, scale=0.5)
        shift, scale = (table + temb.unsqueeze(1)).chunk(2, dim=1)
    op = make_op(LayerNormScaleShift, numerics, HIDDEN, eps=EPS, dtype=torch.float32)
    with torch.no_grad():
        actual = op(x, shift, scale)
    norm_out = fp32_layer_norm()
    with reference():
        expected = (norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        other = (norm_out(x) * (1 + scale) + shift).type_as(x)
    return actual, expected, other


WAN_NORM_CASES = {
    f"{name}-{modulation}": partial(case, per_token=modulation == "per_token")
    for name, case in (
        ("norm1", wan_norm1_case),
        ("self_attn_residual_norm", wan_self_attn_residual_case),
        ("cross_attn_residual_norm", wan_cross_attn_residual_case),
        ("mlp_residual", wan_mlp_residual_case),
        ("norm_out", wan_norm_out_case),
    )
    for modulation in WAN_MODULATION
}
# Upstream's default CPU forward misses diffusers' bits only at these sites: at the others its
# sgl_kernel CPU ops (stood in by cpu_kernels: fp32 math, one rounding) compute Wan's arithmetic.
WAN_DEFAULT_DIFFERS = [
    c for c in WAN_NORM_CASES if c.startswith(("mlp_residual", "norm_out"))
]


@pytest.mark.parametrize("batch,seq,layout", GRID, ids=GRID_IDS)
@pytest.mark.parametrize("case", WAN_NORM_CASES)
def test_wan_norm_op_matches_diffusers(case, batch, seq, layout):
    actual, expected, _ = WAN_NORM_CASES[case](TRAIN_PARITY, batch, seq, layout)
    assert_bitwise(actual, expected)


@pytest.mark.parametrize("case", WAN_NORM_CASES)
def test_wan_norm_other_rounding_differs(case):
    """The control: the site's other rounding order (see each case) misses diffusers' bits."""
    cases = (WAN_NORM_CASES[case](TRAIN_PARITY, *point) for point in GRID)
    assert any(mismatches(other, expected) for _, expected, other in cases)


@pytest.mark.parametrize("case", WAN_DEFAULT_DIFFERS)
def test_default_mode_wan_norm_op_differs(case):
    """The control: upstream's CPU forward of the same op misses diffusers' bits somewhere."""
    cases = (WAN_NORM_CASES[case](DEFAULT, *point) for point in GRID)
    assert any(mismatches(actual, expected) for actual, expected, _ in cases)


@pytest.mark.parametrize("batch,seq,layout", GRID, ids=GRID_IDS)
@pytest.mark.parametrize("modulation", WAN_MODULATION)
def test_gated_residual_fp32_gate_matches_wan(modulation, batch, seq, layout):
    """An fp32 gate: Wan's one rounding of the fp32 product and sum."""
    residual, x = (arrange(rand(batch, seq, HIDDEN), layout) for _ in range(2))
    gate = wan_modulation(batch, seq, modulation == "per_token")[2]
    actual = train_parity_ops.gated_residual(residual, gate, x)
    with reference():
        # WanTransformerBlock.forward, after attn1.
        expected = (residual.float() + x * gate).type_as(residual)
    assert_bitwise(actual, expected)


@pytest.mark.parametrize("batch,seq,layout", GRID, ids=GRID_IDS)
def test_gated_residual_bf16_gate_matches_qwen(batch, seq, layout):
    """A bf16 gate: Qwen-Image's bf16 product and bf16 sum."""
    residual, x = (arrange(rand(batch, seq, HIDDEN), layout) for _ in range(2))
    gate = rand(batch, 1, HIDDEN, scale=0.5)
    actual = train_parity_ops.gated_residual(residual, gate[:, 0], x)  # a [B, D] gate
    with reference():
        # QwenImageTransformerBlock.forward: `hidden_states + img_gate1 * img_attn_output`.
        expected = residual + gate * x
    assert_bitwise(actual, expected)


def test_gated_residual_two_roundings_differ():
    """The control: Wan's fp32 gate rounded to bf16 first (Qwen's variant), or the product
    rounded before the sum, misses Wan's bits."""
    residual, x = rand(2, 13, HIDDEN), rand(2, 13, HIDDEN)
    gate = wan_modulation(2, 13, per_token=False)[2]
    with reference():
        expected = (residual.float() + x * gate).type_as(residual)
    assert mismatches(
        train_parity_ops.gated_residual(residual, gate.to(BF16), x), expected
    )
    assert mismatches(residual + (x * gate).to(BF16), expected)


# ------------------------------------------------------------ Wan Q/K norm, RoPE, attention


class WithoutAutocast(nn.Module):
    """`module` run with autocast off: torch 2.11's CUDA autocast has no rms_norm rule, so the
    norm runs in its input dtype, as outside autocast."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.module(x)


@cache
def diffusers_wan_rope() -> nn.Module:
    """diffusers' WanRotaryPosEmbed as WanTransformer3DModel builds it (patch (1, 2, 2),
    rope_max_seq_len 1024): float64 tables rounded to fp32 buffers."""
    return transformer_wan.WanRotaryPosEmbed(HEAD_DIM, (1, 2, 2), max_seq_len=1024)


def diffusers_wan_rope_tables(grid: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
    """WanRotaryPosEmbed's (freqs_cos, freqs_sin) [1, S, 1, HEAD_DIM] for a token grid."""
    frames, height, width = grid
    return diffusers_wan_rope()(torch.empty(1, 1, frames, 2 * height, 2 * width))


def wan_rope_tables(grid: tuple[int, int, int], dtype=torch.float64):
    """sglang's Wan RoPE tables (cos, sin) [S, HEAD_DIM / 2] fp32, built as
    WanTransformer3DModel builds them (float64 where the platform has it)."""
    d = HEAD_DIM
    rope_dim_list = [d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)]
    rope = NDRotaryEmbedding(rope_dim_list=rope_dim_list, rope_theta=10000, dtype=dtype)
    return rope.forward_from_grid(grid)


def wan_attention(
    x: torch.Tensor, grid: tuple[int, int, int], rms_norm_in_fp32: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """diffusers' WanAttention (self-attention, Q/K RMSNorm across heads) with identity
    projections, so its norm_q/norm_k see `x` itself, run on `x` [B, S, HIDDEN] with
    WanRotaryPosEmbed's tables for the token `grid`, under the trainer's regime with the given
    rms_norm autocast rule. Records the norms' outputs ("norm_q", "norm_k"), what reaches
    dispatch_attention_fn ("query", "key": RoPE applied; "value") and its output
    ("attention"). Returns the norms' weights and the records."""
    if rms_norm_in_fp32 and not EMULATED_RMS_NORM_IN_FP32:
        pytest.skip("this torch's autocast has no fp32 rms_norm rule to emulate")
    attn = transformer_wan.WanAttention(
        HIDDEN,
        heads=HEADS,
        dim_head=HEAD_DIM,
        eps=EPS,
        processor=transformer_wan.WanAttnProcessor(),
    ).to(BF16)
    attn.to_q = attn.to_k = attn.to_v = nn.Identity()
    recorded, weights = {}, {}
    for name in ("norm_q", "norm_k"):
        norm = getattr(attn, name)
        norm.weight.data = weights[name] = 1 + rand(HIDDEN, scale=0.1)
        norm.register_forward_hook(
            lambda module, args, out, name=name: recorded.__setitem__(name, out)
        )
        if rms_norm_in_fp32 != EMULATED_RMS_NORM_IN_FP32:
            setattr(attn, name, WithoutAutocast(norm))

    def recording_dispatch(query, key, value, **kwargs):
        recorded.update(query=query, key=key, value=value)
        recorded["attention"] = dispatch_attention_fn(query, key, value, **kwargs)
        return recorded["attention"]

    with (
        patch.object(transformer_wan, "dispatch_attention_fn", recording_dispatch),
        reference(),
    ):
        attn(x, None, None, diffusers_wan_rope_tables(grid))
    return weights, recorded


def heads(t: torch.Tensor) -> torch.Tensor:
    return t.unflatten(2, (HEADS, HEAD_DIM))


def wan_qk(weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """train_parity's Q/K norms (sglang's _train_parity_qk_norm) with diffusers' weights."""
    return tuple(
        train_parity_ops.torch_rms_norm(x, weights[name], EPS)
        for name in ("norm_q", "norm_k")
    )


def wan_self_attention(weights, x: torch.Tensor, grid) -> torch.Tensor:
    """Q/K norm, RoPE and SDPA chained as sglang's WanTransformerBlock._forward_train_parity
    does (Q/K cast to V's dtype), on identity projections of `x`."""
    cos, sin = wan_rope_tables(grid)
    query, key = (
        train_parity_ops.rotary_emb_real(heads(t), cos, sin) for t in wan_qk(weights, x)
    )
    value = heads(x)
    return train_parity_ops.joint_attention(
        query.to(value.dtype), key.to(value.dtype), value
    )


@pytest.fixture
def rms_norm_rule(request, monkeypatch) -> bool:
    """train_parity's rms_norm autocast rule set to the parameter (the reference follows it)."""
    monkeypatch.setattr(train_parity_ops, "AUTOCAST_RMS_NORM_IN_FP32", request.param)
    return request.param


def test_rms_norm_rule_follows_the_emulation():
    """Both sides take the installed torch's rule unless a test sets one."""
    assert train_parity_ops.AUTOCAST_RMS_NORM_IN_FP32 == EMULATED_RMS_NORM_IN_FP32


@pytest.mark.parametrize("batch,grid,layout", WAN_GRID, ids=WAN_GRID_IDS)
@pytest.mark.parametrize("rms_norm_rule", **RULE_PARAMS, indirect=True)
def test_wan_self_attention_ops_match_diffusers(
    tp1, rms_norm_rule, batch, grid, layout
):
    """Under each rms_norm rule: torch_rms_norm equals WanAttention's norm_q/norm_k
    (torch.nn.RMSNorm); rotary_emb_real of those outputs (fp32 or bf16 by the rule) with
    sglang's tables equals diffusers' apply_rotary_emb with WanRotaryPosEmbed's; and the chain
    norm -> RoPE -> joint_attention equals what WanAttnProcessor's attention returns."""
    x = arrange(rand(batch, math.prod(grid), HIDDEN), layout)
    weights, recorded = wan_attention(x, grid, rms_norm_rule)
    cos, sin = wan_rope_tables(grid)
    roped = (
        train_parity_ops.rotary_emb_real(heads(recorded[norm]), cos, sin)
        for norm in ("norm_q", "norm_k")
    )
    pairs = {
        "qk_rms_norm": (wan_qk(weights, x), (recorded["norm_q"], recorded["norm_k"])),
        "rotary_emb_real": (tuple(roped), (recorded["query"], recorded["key"])),
        "attention": (wan_self_attention(weights, x, grid), recorded["attention"]),
    }
    problems = [f"{op}: {p}" for op, pair in pairs.items() for p in mismatches(*pair)]
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("rms_norm_in_fp32", **RULE_PARAMS)
def test_wan_qk_rms_norm_rounding_before_weight_differs(rms_norm_in_fp32):
    """The control: rounding the normalized value before the weight multiply, as Qwen's
    diffusers RMSNorm (train_parity's rms_norm) does, misses torch.nn.RMSNorm's bits, compared
    in bf16 so the dtype is not what differs."""
    x = rand(2, 13, HIDDEN)
    weights, recorded = wan_attention(x, (1, 13, 1), rms_norm_in_fp32)
    assert mismatches(
        train_parity_ops.rms_norm(x, weights["norm_q"], EPS),
        recorded["norm_q"].to(BF16),
    )


@pytest.mark.parametrize("grid", WAN_TOKEN_GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_wan_rope_tables_match_diffusers(tp1, grid):
    """sglang's tables are WanRotaryPosEmbed's at the pair slices diffusers' apply_rotary_emb
    reads (`freqs_cos[..., 0::2]`, `freqs_sin[..., 1::2]`); the control: the tables built in
    fp32 (sglang's fallback without float64) differ."""
    freqs_cos, freqs_sin = diffusers_wan_rope_tables(grid)
    expected = (freqs_cos[0, :, 0, 0::2], freqs_sin[0, :, 0, 1::2])
    assert_bitwise(wan_rope_tables(grid), expected)
    assert mismatches(wan_rope_tables(grid, dtype=torch.float32), expected)


@pytest.mark.parametrize("rms_norm_rule", **RULE_PARAMS, indirect=True)
def test_wan_rotary_emb_bf16_tables_differ(tp1, rms_norm_rule):
    """The control: the same RoPE with the tables rounded to bf16 misses diffusers' bits.
    (Qwen's complex `rotary_emb` is no control here: on CPU it gives the same bits.)"""
    grid = WAN_TOKEN_GRIDS[-1]
    x = rand(2, math.prod(grid), HIDDEN)
    _, recorded = wan_attention(x, grid, rms_norm_rule)
    cos, sin = (t.to(BF16) for t in wan_rope_tables(grid))
    actual = train_parity_ops.rotary_emb_real(heads(recorded["norm_q"]), cos, sin)
    assert mismatches(actual, recorded["query"])


@pytest.mark.parametrize("grid", WAN_TOKEN_GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_wan_other_rms_norm_rule_differs(tp1, monkeypatch, grid):
    """The control: train_parity with the other torch's rms_norm rule hands SDPA other Q bits
    than diffusers under the installed torch's (compared in bf16, as SDPA casts them), and
    its attention output differs."""
    x = rand(2, math.prod(grid), HIDDEN)
    weights, recorded = wan_attention(x, grid, EMULATED_RMS_NORM_IN_FP32)
    monkeypatch.setattr(
        train_parity_ops, "AUTOCAST_RMS_NORM_IN_FP32", not EMULATED_RMS_NORM_IN_FP32
    )
    cos, sin = wan_rope_tables(grid)
    query = train_parity_ops.rotary_emb_real(heads(wan_qk(weights, x)[0]), cos, sin)
    assert mismatches(query.to(BF16), recorded["query"].to(BF16))
    assert mismatches(wan_self_attention(weights, x, grid), recorded["attention"])


# ----------------------------------------------------------------------- Qwen-Image 2.1's variants
QWEN21_GRID = [(1, 7, "contiguous"), (2, 13, "sliced")]
QWEN21_IDS = [f"b{b}-s{s}-{layout}" for b, s, layout in QWEN21_GRID]


@pytest.mark.parametrize("batch,seq,layout", QWEN21_GRID, ids=QWEN21_IDS)
def test_qwen21_text_norm_matches_diffusers(batch, seq, layout):
    """zero_centred_rms_norm is diffusers' QwenImage21ZeroCenterRMSNorm (bf16 weight, applied
    as weight + 1 in fp32); the control: diffusers' ordinary RMSNorm rounding before a bf16
    (weight + 1) misses its bits."""
    x = arrange(rand(batch, seq, HIDDEN), layout)
    norm = transformer_qwenimage21.QwenImage21ZeroCenterRMSNorm(HIDDEN, eps=EPS)
    norm.weight.data = rand(HIDDEN, scale=0.3)
    actual = train_parity_ops.zero_centred_rms_norm(x, norm.weight, EPS)
    with reference():
        expected = norm(x)
    assert_bitwise(actual, expected)
    assert mismatches(train_parity_ops.rms_norm(x, norm.weight + 1, EPS), expected)


def qwen21_modulation_case(batch: int, seq: int, layout: str):
    """Activations whose first token is constant (its LayerNorm is exactly zero), a scale below
    -1 on the first channels, and diffusers' [B + 1, 2D] modulation: the first 3 (text) tokens
    read the t=0 row, the rest their sample's row."""
    x = rand(batch, seq, HIDDEN)
    x[:, 0] = 0.5
    mod = rand(batch + 1, 2 * HIDDEN, scale=0.5)
    mod[:, :8] = -3.0
    is_target = (torch.arange(seq) >= 3).view(1, -1, 1)
    return arrange(x, layout), mod, is_target


@pytest.mark.parametrize("batch,seq,layout", QWEN21_GRID, ids=QWEN21_IDS)
def test_qwen21_scale_only_modulation_matches_diffusers(batch, seq, layout):
    """layer_norm_scale_shift with shift=None is QwenImage21TransformerBlock._modulate of its
    autocast LayerNorm, rounded where the next Linear casts it. Controls: a zero shift turns the
    -0.0 of a zero norm times a negative (1 + scale) into +0.0; the LayerNorm in bf16 (the default
    path's order) misses the bits."""
    x, mod, is_target = qwen21_modulation_case(batch, seq, layout)
    block = transformer_qwenimage21.QwenImage21TransformerBlock
    scale = torch.where(is_target, mod[:-1, None, :HIDDEN], mod[-1:, None, :HIDDEN])
    actual = train_parity_ops.layer_norm_scale_shift(x, None, scale, EPS)
    norm = nn.LayerNorm(HIDDEN, elementwise_affine=False, eps=EPS)
    with reference():
        modulated, _ = block._modulate(None, norm(x), mod, is_target.view(-1))
        expected = modulated.to(BF16)
    assert_bitwise(actual, expected)
    assert bool((bits(expected) == bits(torch.tensor(-0.0, dtype=BF16))).any())
    zero_shift = train_parity_ops.layer_norm_scale_shift(x, torch.zeros_like(scale), scale, EPS)
    assert mismatches(zero_shift, expected)
    assert mismatches((norm(x) * (1 + scale)).to(BF16), expected)
