"""MambaMixer against HuggingFace's NemotronH Mamba-2 mixer, its decode path against its own
whole-sequence path, and its configuration and backend checks."""

import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.ssm.backends import SSMBackendError, TorchSSMBackend, get_ssm_backend
from megatron.core.ssm.mamba_mixer import MambaDims, MambaMixer
from tests.unit_tests.dist_harness import run_distributed

HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, CONV, CHUNK = 32, 8, 8, 2, 8, 4, 4


def mamba_config(**overrides):
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        mamba_num_heads=HEADS,
        mamba_head_dim=HEAD_DIM,
        mamba_num_groups=GROUPS,
        mamba_state_dim=STATE,
        mamba_d_conv=CONV,
        mamba_chunk_size=CHUNK,
        add_bias_linear=False,
        normalization="RMSNorm",
    )
    return TransformerConfig(**(base | overrides))


def single_rank_collection():
    return ProcessGroupCollection.from_layout(RankLayout.for_world(1))


def hf_mixer():
    config = NemotronHConfig(
        hidden_size=HIDDEN,
        mamba_num_heads=HEADS,
        mamba_head_dim=HEAD_DIM,
        n_groups=GROUPS,
        ssm_state_size=STATE,
        conv_kernel=CONV,
        chunk_size=CHUNK,
        layers_block_type=["linear_attention"],
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
    )
    torch.manual_seed(0)
    mixer = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():  # make every parameter non-trivial
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return mixer


def load_from_hf(ours: MambaMixer, hf: NemotronHMamba2Mixer):
    with torch.no_grad():
        ours.in_proj.weight.copy_(hf.in_proj.weight)
        ours.conv1d_weight.copy_(hf.conv1d.weight)
        ours.conv1d_bias.copy_(hf.conv1d.bias)
        ours.A_log.copy_(hf.A_log)
        ours.D.copy_(hf.D)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.norm.weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)


class StateContext:
    """A minimal MambaInferenceContext: one pair of state tensors for one layer."""

    def __init__(self, dims: MambaDims, batch: int, decode: bool = False):
        self.conv_state = torch.zeros(batch, *dims.conv_state_shape())
        self.ssm_state = torch.zeros(batch, *dims.ssm_state_shape())
        self.decode = decode

    def is_decode_only(self):
        return self.decode

    def mamba_states(self, layer_number):
        assert layer_number == 1
        return self.conv_state, self.ssm_state


def _compare_with_hf():
    hf = hf_mixer()
    ours = MambaMixer(mamba_config(), layer_number=1, pg_collection=single_rank_collection(), ssm_backend="torch")
    load_from_hf(ours, hf)
    x = torch.randn(3, 10, HIDDEN, generator=torch.Generator().manual_seed(1))  # [b, s, h]
    with torch.no_grad():
        want = hf(x)
        got, bias = ours(x.transpose(0, 1).contiguous())
    assert bias is None
    return (got.transpose(0, 1) - want).abs().max().item(), want.abs().max().item()


def test_mixer_matches_hf_nemotron_h_mixer():
    ((diff, scale),) = run_distributed(_compare_with_hf, 1)
    assert scale > 0.1 and diff <= 1e-5 * scale


def _decode_matches_scan():
    torch.manual_seed(3)
    ours = MambaMixer(mamba_config(), layer_number=1, pg_collection=single_rank_collection(), ssm_backend="torch")
    x = torch.randn(9, 2, HIDDEN)  # [s, b, h]
    with torch.no_grad():
        full, _ = ours(x)
        ctx = StateContext(ours.dims, batch=2)
        first, _ = ours(x[:3], inference_context=ctx)  # prefill, shorter than the conv window + 1
        second, _ = ours(x[3:6], inference_context=ctx)  # prefill continuing from the states
        ctx.decode = True
        steps = [ours(x[t : t + 1], inference_context=ctx)[0] for t in range(6, 9)]
    got = torch.cat([first, second, *steps])
    return (got - full).abs().max().item(), full.abs().max().item()


def test_prefill_and_decode_continue_the_whole_sequence_output():
    ((diff, scale),) = run_distributed(_decode_matches_scan, 1)
    assert diff <= 1e-5 * scale


def _decode_rejects_multiple_tokens():
    ours = MambaMixer(mamba_config(), layer_number=1, pg_collection=single_rank_collection(), ssm_backend="torch")
    ctx = StateContext(ours.dims, batch=1, decode=True)
    with pytest.raises(ValueError, match="a decode step takes one token per request, got sequence length 2"):
        ours(torch.randn(2, 1, HIDDEN), inference_context=ctx)
    return True


def test_decode_step_rejects_more_than_one_token():
    assert run_distributed(_decode_rejects_multiple_tokens, 1) == [True]


def test_heads_and_groups_must_split_over_tp():
    with pytest.raises(ConfigError) as err:
        MambaDims.from_config(mamba_config(mamba_num_groups=1), tp_size=2)
    assert "mamba_num_groups (1) must be divisible by tensor_model_parallel_size (2)" in str(err.value)
    with pytest.raises(
        ConfigError, match=r"mamba_num_heads \(8\) must be divisible by tensor_model_parallel_size \(3\)"
    ):
        MambaDims.from_config(mamba_config(), tp_size=3)


def test_state_shapes_are_tp_local():
    dims = MambaDims.from_config(mamba_config(), tp_size=2)
    assert dims.conv_state_shape() == ((HEADS * HEAD_DIM + 2 * GROUPS * STATE) // 2, CONV - 1)
    assert dims.ssm_state_shape() == (HEADS // 2, HEAD_DIM, STATE)
    assert dims.in_proj_sizes == [64, 64, 16, 16, 8]


def test_backend_switch_on_cpu():
    assert isinstance(get_ssm_backend(torch.device("cpu")), TorchSSMBackend)
    assert isinstance(get_ssm_backend(torch.device("cpu"), "torch"), TorchSSMBackend)
    with pytest.raises(SSMBackendError, match="SSM backend 'triton' needs CUDA tensors"):
        get_ssm_backend(torch.device("cpu"), "triton")
    with pytest.raises(SSMBackendError, match="unknown SSM backend 'cuda'; accepted: auto, torch, triton"):
        get_ssm_backend(torch.device("cpu"), "cuda")
