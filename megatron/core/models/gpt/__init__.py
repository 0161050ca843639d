"""GPT models."""

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel", "get_gpt_decoder_layer_specs", "get_gpt_layer_local_spec", "get_gpt_mtp_block_spec"]
