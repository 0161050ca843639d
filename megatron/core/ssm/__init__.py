"""Mamba-2: torch reference ops (SSD scan and step update, causal conv, gated norm), kernel switch
(Triton kernels on CUDA), mixer and layer."""

from megatron.core.ssm.backends import MixerWeights, SSMBackendError, get_ssm_backend
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaDims, MambaInferenceContext, MambaMixer
from megatron.core.ssm.mixer_reference import causal_conv1d_silu, gated_rms_norm
from megatron.core.ssm.ssd_reference import ssd_chunked_scan, ssd_step

__all__ = [
    "MixerWeights",
    "SSMBackendError",
    "get_ssm_backend",
    "MambaLayer",
    "MambaLayerSubmodules",
    "MambaDims",
    "MambaInferenceContext",
    "MambaMixer",
    "causal_conv1d_silu",
    "gated_rms_norm",
    "ssd_chunked_scan",
    "ssd_step",
]
