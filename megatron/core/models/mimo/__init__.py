"""MIMO: a language model with modality encoders, each module on its own rank grid."""

from megatron.core.models.mimo.bridge import BridgeError, EmbeddingBridge, to_language_differentiable
from megatron.core.models.mimo.builder import (
    build_bridges,
    build_mimo_model,
    image_submodule_provider,
    module_parts,
    wrap_with_ddp,
)
from megatron.core.models.mimo.checkpointing import load_mimo_state, mimo_sharded_state_dict
from megatron.core.models.mimo.mimo_model import (
    MimoInputError,
    MimoModel,
    ModalitySubmodule,
    place_modality_embeddings,
)
from megatron.core.models.mimo.optimizer import MimoOptimizer, get_mimo_optimizer
from megatron.core.models.mimo.projection import MultimodalProjection
from megatron.core.models.mimo.roles import LANGUAGE_MODEL, MimoRoles, MimoRolesError
from megatron.core.models.mimo.schedule import forward_backward, masked_mean_loss
from megatron.core.models.mimo.vision_encoder import VisionEncoder, get_vision_layer_spec, patchify

__all__ = [
    "BridgeError",
    "EmbeddingBridge",
    "LANGUAGE_MODEL",
    "MimoInputError",
    "MimoModel",
    "MimoOptimizer",
    "MimoRoles",
    "MimoRolesError",
    "ModalitySubmodule",
    "MultimodalProjection",
    "VisionEncoder",
    "build_bridges",
    "build_mimo_model",
    "image_submodule_provider",
    "load_mimo_state",
    "mimo_sharded_state_dict",
    "module_parts",
    "wrap_with_ddp",
    "forward_backward",
    "get_mimo_optimizer",
    "get_vision_layer_spec",
    "masked_mean_loss",
    "patchify",
    "place_modality_embeddings",
    "to_language_differentiable",
]
