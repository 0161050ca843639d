"""Mamba-2: torch reference SSD scan and step update, kernel switch, mixer and layer."""

from megatron.core.ssm.backends import SSMBackendError, get_ssm_backend
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaDims, MambaInferenceContext, MambaMixer
from megatron.core.ssm.ssd_reference import ssd_chunked_scan, ssd_step

__all__ = [
    "SSMBackendError",
    "get_ssm_backend",
    "MambaLayer",
    "MambaLayerSubmodules",
    "MambaDims",
    "MambaInferenceContext",
    "MambaMixer",
    "ssd_chunked_scan",
    "ssd_step",
]
