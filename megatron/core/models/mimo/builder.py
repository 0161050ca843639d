"""Assembling a MIMO job on this rank: the modules it holds, their DDP wrappers and the bridges.

Providers keep the model choice with the caller: ``language_model_provider(pg_collection)``
returns the language model, ``modality_providers[name](pg_collection)`` a
:class:`ModalitySubmodule`; each is called only on ranks holding that module, with that
module's own collection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.core.config import TransformerConfig
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.mimo.bridge import EmbeddingBridge
from megatron.core.models.mimo.mimo_model import MimoModel, ModalitySubmodule
from megatron.core.models.mimo.projection import MultimodalProjection
from megatron.core.models.mimo.roles import LANGUAGE_MODEL, MimoRoles
from megatron.core.models.mimo.vision_encoder import VisionEncoder
from megatron.core.process_groups import ProcessGroupCollection


def build_mimo_model(
    collections: dict[str, ProcessGroupCollection],
    language_model_provider: Callable,
    modality_providers: dict[str, Callable],
    special_token_ids: dict[str, int],
) -> MimoModel:
    """The MimoModel of this rank (``collections`` names the modules it holds)."""
    language_model = None
    if LANGUAGE_MODEL in collections:
        language_model = language_model_provider(collections[LANGUAGE_MODEL])
    submodules = {
        name: provider(collections[name]) for name, provider in modality_providers.items() if name in collections
    }
    return MimoModel(language_model, submodules, special_token_ids)


def module_parts(model: MimoModel) -> dict[str, torch.nn.Module]:
    """Module name -> the part of ``model`` it names, for the modules this rank holds."""
    parts = {} if model.language_model is None else {LANGUAGE_MODEL: model.language_model}
    return parts | dict(model.modality_submodules.items())


def wrap_with_ddp(
    model: MimoModel, collections: dict[str, ProcessGroupCollection], ddp_config: DistributedDataParallelConfig
) -> dict[str, DistributedDataParallel]:
    """One DistributedDataParallel per held module, reducing over that module's ``dp_cp``."""
    return {
        name: DistributedDataParallel(part.config, ddp_config, part, pg_collection=collections[name])
        for name, part in module_parts(model).items()
    }


def build_bridges(
    roles: MimoRoles,
    language_micro_batch_size: int,
    sample_shapes: dict[str, tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    group=None,
) -> dict[str, EmbeddingBridge]:
    """One bridge per modality, from its grid to the language model's (built on every rank)."""
    return {
        name: EmbeddingBridge(
            roles.layouts[name],
            roles.layouts[LANGUAGE_MODEL],
            language_micro_batch_size,
            sample_shapes[name],
            dtype,
            device,
            group,
        )
        for name in roles.modality_names
    }


def image_submodule_provider(
    encoder_config: TransformerConfig, image_size: int, patch_size: int, language_hidden_size: int
) -> Callable[[ProcessGroupCollection], ModalitySubmodule]:
    """Provider of a ViT encoder over RGB images plus its projection to the language model's width."""

    def provide(pg_collection: ProcessGroupCollection) -> ModalitySubmodule:
        encoder = VisionEncoder(encoder_config, image_size, patch_size, pg_collection=pg_collection)
        projection = MultimodalProjection(
            encoder_config, encoder_config.hidden_size, language_hidden_size, pg_collection=pg_collection
        )
        return ModalitySubmodule(encoder, projection)

    return provide
