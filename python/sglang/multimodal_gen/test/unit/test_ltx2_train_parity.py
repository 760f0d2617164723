# SPDX-License-Identifier: Apache-2.0
"""LTX-2 under --numerics train_parity: the contract, the DiT built for it, and
its forward against ltx-core's LTXModel in the trainer's dtypes."""

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglang.multimodal_gen.configs.models.dits.ltx_2 import (
    LTX2_PARAM_NAMES_MAPPING,
    LTX2ArchConfig,
    LTX2Config,
    LTX2RopeType,
)
from sglang.multimodal_gen.configs.pipeline_configs.ltx_2 import (
    LTX2PipelineConfig,
    LTX23PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.ltx_2_5 import LTX25PipelineConfig
from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
from sglang.multimodal_gen.runtime.layers import train_parity_ops
from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp
from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
from sglang.multimodal_gen.runtime.models.dits import ltx_2
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.denoising import (
    LTX2DenoisingStage,
)
from sglang.multimodal_gen.runtime.utils import train_parity, train_parity_requests

ltx_core_model = pytest.importorskip("ltx_core.model.transformer.model")
from ltx_core.model.transformer.modality import Modality  # noqa: E402
from ltx_core.model.transformer.rope import (  # noqa: E402
    LTXRopeType,
    apply_split_rotary_emb,
    generate_freq_grid_np,
    precompute_freqs_cis,
)
from ltx_core.model.transformer.text_projection import (  # noqa: E402
    PixArtAlphaTextProjection,
)

BF16 = torch.bfloat16
CAPTION_CHANNELS = 48
CONFIG = dict(
    num_attention_heads=2,
    attention_head_dim=32,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    cross_attention_dim=64,
    audio_num_attention_heads=2,
    audio_attention_head_dim=16,
    audio_in_channels=16,
    audio_out_channels=16,
    audio_cross_attention_dim=32,
)

pytestmark = pytest.mark.usefixtures("single_process_model_parallel")


def test_ltx2_text_to_video_opts_in_and_its_variants_are_refused():
    contract = train_parity.train_parity_contract(LTX2PipelineConfig)
    assert contract.dit == "LTX2VideoTransformer3DModel"
    assert contract.unguided and contract.pipeline_classes == ("LTX2Pipeline",)
    for config_cls in (LTX23PipelineConfig, LTX25PipelineConfig):
        args = SimpleNamespace(model_path="a/ltx", pipeline_config=config_cls())
        with pytest.raises(train_parity.TrainParityError, match="not this variant"):
            train_parity.require_contract(args)
    two_stage = SimpleNamespace(
        model_path="a/ltx",
        pipeline_config=LTX2PipelineConfig(),
        pipeline_class_name="LTX2TwoStagePipeline",
    )
    with pytest.raises(
        train_parity.TrainParityError, match="the pipeline LTX2TwoStagePipeline"
    ):
        train_parity.require_contract(two_stage)
    # the pipeline model_index.json names, when none is requested
    train_parity.check_pipeline(contract, "LTX2Pipeline")
    with pytest.raises(train_parity.TrainParityError, match="LTX2TwoStageHQPipeline"):
        train_parity.check_pipeline(contract, "LTX2TwoStageHQPipeline")


@pytest.mark.parametrize("scale, refused", [(1.0, False), (4.0, True)])
def test_requests_are_unguided(scale, refused, server_args_for):
    """The trainer (miles) steps LTX-2 with one unguided forward."""
    args = server_args_for(LTX2PipelineConfig(), numerics="train_parity")
    params = SamplingParams(prompt="a cat", guidance_scale=scale)
    params._explicit_fields = {"prompt", "guidance_scale"}
    if refused:
        with pytest.raises(train_parity.TrainParityError, match="guidance_scale=4.0"):
            train_parity_requests.adjust_sampling_params(params, args)
    else:
        train_parity_requests.adjust_sampling_params(params, args)


def _tiny_dits(numerics: str = "train_parity", **arch):
    """ltx-core's model with bf16 random weights, and sglang's holding the same."""
    torch.manual_seed(0)
    reference = ltx_core_model.LTXModel(
        model_type=ltx_core_model.LTXModelType.AudioVideo,
        rope_type=LTXRopeType.SPLIT,
        double_precision_rope=True,
        caption_projection=PixArtAlphaTextProjection(CAPTION_CHANNELS, 64),
        audio_caption_projection=PixArtAlphaTextProjection(CAPTION_CHANNELS, 32),
        **CONFIG,
    )
    for param in reference.parameters():
        param.data = torch.randn_like(param).mul(0.1).to(BF16)
    arch_config = LTX2ArchConfig(
        rope_type=LTX2RopeType.SPLIT,
        double_precision_rope=True,
        caption_channels=CAPTION_CHANNELS,
        **CONFIG,
        **arch,
    )
    with train_parity.numerics_mode_context(numerics):
        dit = ltx_2.LTX2VideoTransformer3DModel(
            LTX2Config(arch_config=arch_config), hf_config={}
        ).to(BF16)
    params = dict(dit.named_parameters())
    for name, tensor in reference.state_dict().items():
        for pattern, target in LTX2_PARAM_NAMES_MAPPING.items():
            if re.match(pattern, name):
                name = re.sub(pattern, target, name)
        params.pop(name).data = tensor.clone()
    assert not params, f"parameters ltx-core does not have: {sorted(params)}"
    return reference.eval(), dit.eval()


def test_the_contract_lists_every_op_the_dit_builds():
    _, dit = _tiny_dits()
    contract = LTX2PipelineConfig.train_parity_contract
    train_parity.check_dit_ops(contract, dit)
    built = {type(m).__name__ for m in dit.modules() if isinstance(m, CustomOp)}
    assert built == set(contract.ops) | set(contract.parameter_only_ops)
    assert not dit.caches_prompt_kv


@pytest.mark.parametrize(
    "arch, option",
    [
        (dict(rope_type=LTX2RopeType.INTERLEAVED), "rope_type='interleaved'"),
        (dict(apply_gated_attention=True), "apply_gated_attention"),
        (dict(cross_attention_adaln=True), "cross_attention_adaln"),
    ],
)
def test_ltx23_features_are_refused_at_construction(arch, option):
    config = {**CONFIG, "rope_type": LTX2RopeType.SPLIT, **arch}
    with (
        train_parity.numerics_mode_context("train_parity"),
        pytest.raises(train_parity.TrainParityError, match=re.escape(option)),
    ):
        ltx_2.LTX2VideoTransformer3DModel(
            LTX2Config(arch_config=LTX2ArchConfig(**config)), hf_config={}
        )


def _inputs(batch=2, frames=3, height=4, width=6, audio_frames=7, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(
            batch, frames * height * width, 16, generator=generator
        ),
        audio_hidden_states=torch.randn(batch, audio_frames, 16, generator=generator),
        text=torch.randn(batch, 5, CAPTION_CHANNELS, generator=generator).to(BF16),
        # the rollout's timesteps, on the 0..1000 scale
        timestep=torch.tensor([700.3, 312.77])[:batch],
        grid=(frames, height, width, audio_frames),
    )


def _sglang(dit, inputs, **kwargs):
    frames, height, width, audio_frames = inputs["grid"]
    call = dict(
        hidden_states=inputs["hidden_states"].to(BF16),
        audio_hidden_states=inputs["audio_hidden_states"].to(BF16),
        encoder_hidden_states=inputs["text"],
        audio_encoder_hidden_states=inputs["text"],
        timestep=inputs["timestep"],
        num_frames=frames,
        height=height,
        width=width,
        fps=24.0,
        audio_num_frames=audio_frames,
        disable_a2v_cross_attn=True,
        disable_v2a_cross_attn=True,
        return_latents=False,
    )
    call.update(kwargs)
    with torch.no_grad(), set_forward_context(0, None, forward_batch=None):
        return dit(**call)


class _AutocastOutputNorm(torch.nn.Module):
    """The output LayerNorm as CUDA autocast runs it: fp32 in, fp32 out."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x.float(), x.shape[-1:], eps=self.eps)


class _AutocastLinear(torch.nn.Module):
    """A bf16 Linear under CUDA autocast: its input cast to bf16."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x.to(BF16))


def _reference(reference, dit, inputs, sigma_dtype=BF16):
    """ltx-core run in bf16 outside autocast, as the trainer's CUDA autocast runs
    it in torch 2.11 (rms_norm in the input dtype) apart from the output norm,
    wrapped to run in fp32; each stream alone, SDPA's math kernel, and the
    Modality built as miles' trainer builds it (sigma = timestep in bf16 /
    1000, positions in bf16, no text mask)."""
    frames, height, width, audio_frames = inputs["grid"]
    batch = inputs["hidden_states"].shape[0]
    sigma = inputs["timestep"].to(sigma_dtype) / 1000
    positions = dit.rope.prepare_video_coords(batch, frames, height, width, "cpu")
    audio_positions = dit.audio_rope.prepare_audio_coords(batch, audio_frames, "cpu")
    for prefix in ("", "audio_"):
        norm = getattr(reference, f"{prefix}norm_out")
        if not isinstance(norm, _AutocastOutputNorm):
            setattr(reference, f"{prefix}norm_out", _AutocastOutputNorm(norm.eps))
            proj = getattr(reference, f"{prefix}proj_out")
            setattr(reference, f"{prefix}proj_out", _AutocastLinear(proj))

    def modality(latent, positions, positions_dtype=BF16):
        return Modality(
            latent=latent.to(BF16),
            sigma=sigma,
            timesteps=sigma[:, None],
            positions=positions.to(positions_dtype),
            context=inputs["text"],
        )

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        video, _ = reference(
            video=modality(inputs["hidden_states"], positions),
            audio=None,
            perturbations=None,
        )
        _, audio = reference(
            video=None,
            audio=modality(
                inputs["audio_hidden_states"], audio_positions, torch.float32
            ),
            perturbations=None,
        )
    return video, audio


@pytest.mark.parametrize("rms_norm_in_fp32", [False, True])
def test_dit_matches_ltx_core(rms_norm_in_fp32, monkeypatch):
    """Each stream bitwise equal to ltx-core's under torch 2.11's autocast rule;
    the fp32 rms_norm of later autocasts differs (the control)."""
    reference, dit = _tiny_dits()
    monkeypatch.setattr(train_parity_ops, "AUTOCAST_RMS_NORM_IN_FP32", rms_norm_in_fp32)
    inputs = _inputs()
    expected = _reference(reference, dit, inputs)
    actual = _sglang(dit, inputs)
    for ours, theirs in zip(actual, expected):
        assert torch.equal(ours, theirs) == (not rms_norm_in_fp32)


def test_timestep_is_the_trainers_bf16_sigma(monkeypatch):
    """miles computes sigma = timestep / 1000 in bf16; an fp32 sigma differs."""
    reference, dit = _tiny_dits()
    monkeypatch.setattr(train_parity_ops, "AUTOCAST_RMS_NORM_IN_FP32", False)
    inputs = _inputs(batch=1)
    video, _ = _sglang(dit, inputs)
    fp32_sigma, _ = _reference(reference, dit, inputs, sigma_dtype=torch.float32)
    assert not torch.equal(video, fp32_sigma)


def test_an_all_valid_text_mask_computes_no_mask(monkeypatch):
    """The connector's mask is all ones; ltx-core's additive zeros change no bit."""
    _, dit = _tiny_dits()
    monkeypatch.setattr(train_parity_ops, "AUTOCAST_RMS_NORM_IN_FP32", False)
    inputs = _inputs()
    mask = torch.ones(2, 5, dtype=torch.int64)
    unmasked = _sglang(dit, inputs)
    masked = _sglang(
        dit, inputs, encoder_attention_mask=mask, audio_encoder_attention_mask=mask
    )
    padded = mask.clone()
    padded[:, -2:] = 0
    partly = _sglang(dit, inputs, encoder_attention_mask=padded)
    assert all(map(torch.equal, unmasked, masked))
    assert not torch.equal(unmasked[0], partly[0])


def test_strided_latents_compute_as_dense_ones(monkeypatch):
    """The stage packs latents into a strided [B, S, C] view; the trainer's are dense."""
    _, dit = _tiny_dits()
    monkeypatch.setattr(train_parity_ops, "AUTOCAST_RMS_NORM_IN_FP32", False)
    inputs = _inputs()
    batch, tokens, channels = inputs["hidden_states"].shape
    strided = inputs["hidden_states"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    dense = _sglang(dit, inputs)
    packed = _sglang(dit, inputs, hidden_states=strided.to(BF16))
    assert all(map(torch.equal, dense, packed))


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(disable_a2v_cross_attn=False), "the audio-video cross-attention"),
        (dict(skip_video_self_attn_blocks=(0,)), "perturbed passes"),
        (dict(cached_prompt_kv=(1,)), "a cached prompt K/V"),
        (dict(video_memory_prefix_len=4), "sequence-parallel inputs"),
    ],
)
def test_calls_the_trainer_does_not_make_are_refused(kwargs, option):
    _, dit = _tiny_dits()
    with pytest.raises(train_parity.TrainParityError, match=re.escape(option)):
        _sglang(dit, _inputs(), **kwargs)


def test_rope_tables_are_ltx_cores():
    """ltx-core's float64 frequency grid (built on the CPU) and its split tables
    from bf16 video and fp32 audio positions."""
    _, dit = _tiny_dits()
    video = dit.rope.prepare_video_coords(2, 3, 4, 6, "cpu").to(BF16)
    audio = dit.audio_rope.prepare_audio_coords(2, 7, "cpu")
    for rope, positions, max_pos in (
        (dit.rope, video, [20, 2048, 2048]),
        (dit.audio_rope, audio, [20]),
    ):
        expected = precompute_freqs_cis(
            positions,
            dim=rope.dim,
            out_dtype=BF16,
            max_pos=max_pos,
            use_middle_indices_grid=True,
            num_attention_heads=rope.num_attention_heads,
            rope_type=LTXRopeType.SPLIT,
            freq_grid_generator=generate_freq_grid_np,
        )
        actual = rope.train_parity_tables(positions, torch.device("cpu"), BF16)
        assert all(map(torch.equal, actual, expected))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_split_rotary_emb_is_ltx_cores(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 10, 64, generator=generator).to(dtype)
    cos, sin = (torch.randn(2, 2, 10, 16, generator=generator).to(BF16) for _ in "cs")
    expected = apply_split_rotary_emb(x, cos, sin)
    assert torch.equal(train_parity_ops.split_rotary_emb(x, cos, sin), expected)


def test_the_stage_runs_the_video_stream_alone():
    """Under train_parity the denoising stage turns off the audio-video
    cross-attention for every DiT call, as the trainer runs video alone."""
    for numerics, disabled in (("train_parity", True), ("default", False)):
        stage = LTX2DenoisingStage.__new__(LTX2DenoisingStage)
        stage.server_args = SimpleNamespace(
            pipeline_config=SimpleNamespace(numerics=numerics)
        )
        ctx = SimpleNamespace(
            latent_num_frames_for_model=3,
            latent_height=4,
            latent_width=6,
            use_ltx23_legacy_one_stage=True,
        )
        inputs = SimpleNamespace(
            latent_model_input=None,
            audio_latent_model_input=None,
            timestep_video=None,
            timestep_audio=None,
            audio_num_frames_latent=7,
            video_coords=None,
            audio_coords=None,
        )
        kwargs = stage._build_ltx2_base_model_kwargs(
            ctx, SimpleNamespace(fps=24), inputs
        )
        assert kwargs.get("disable_a2v_cross_attn", False) is disabled
        assert kwargs.get("disable_v2a_cross_attn", False) is disabled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA autocast")
def test_dit_matches_ltx_core_under_cuda_autocast():
    """The trainer's forward itself: ltx-core under CUDA bf16 autocast."""
    reference, dit = _tiny_dits()
    reference, dit = reference.cuda(), dit.cuda()
    inputs = _inputs()
    inputs.update(
        {k: v.cuda() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    )
    frames, height, width, _ = inputs["grid"]
    sigma = inputs["timestep"].to(BF16) / 1000
    positions = dit.rope.prepare_video_coords(2, frames, height, width, "cuda")
    with (
        torch.no_grad(),
        torch.autocast("cuda", dtype=BF16),
        sdpa_kernel(SDPBackend.MATH),
    ):
        expected, _ = reference(
            video=Modality(
                latent=inputs["hidden_states"].to(BF16),
                sigma=sigma,
                timesteps=sigma[:, None],
                positions=positions.to(BF16),
                context=inputs["text"],
            ),
            audio=None,
            perturbations=None,
        )
    actual, _ = _sglang(dit, inputs)
    assert torch.equal(actual, expected)
