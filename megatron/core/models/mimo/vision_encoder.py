"""A small vision transformer over image patches, built from our parallel layers.

Images ``[b, C, H, W]`` are cut into ``(H/p) * (W/p)`` non-overlapping patches of ``p x p``
pixels; each flattened patch goes through a column-parallel patch embedding (gathered, so
every TP rank holds the whole hidden vector), gets a learned position embedding and then
passes a bidirectional :class:`TransformerBlock`. Output: ``[num_patches, b, hidden]``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, init_rng_scope
from megatron.core.transformer.init_methods import init_method
from megatron.core.transformer.norms import mark_replicated
from megatron.core.transformer.spec import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock


def get_vision_layer_spec() -> ModuleSpec:
    """The local GPT layer with unmasked (bidirectional) self-attention."""
    spec = get_gpt_layer_local_spec()
    attention = dataclasses.replace(spec.submodules.self_attention, params={"attn_mask_type": "no_mask"})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[b, C, H, W] -> [b, (H/p)*(W/p), C*p*p]``, patches in row-major order."""
    b, c, h, w = images.shape
    p = patch_size
    patches = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // p) * (w // p), c * p * p)


class VisionEncoder(nn.Module):
    """ViT encoder: ``forward(images [b, C, H, W]) -> [num_patches, b, config.hidden_size]``.

    Weights are created inside ``init_rng_scope`` keys ``"patch_embedding"``,
    ``"vision_position_embedding"`` and the block's ``"layer{n}"`` / ``"final_norm"``, so the
    encoder is layout-invariant like the language models (give it its own ``init_seed``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        image_size: int,
        patch_size: int,
        in_channels: int = 3,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__()
        if patch_size < 1 or image_size % patch_size:
            raise ConfigError(f"image_size ({image_size}) must be a positive multiple of patch_size ({patch_size})")
        if config.sequence_parallel:
            raise ConfigError("the vision encoder does not support sequence_parallel; set it False in its config")
        self.config = config
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.image_size, self.patch_size, self.in_channels = image_size, patch_size, in_channels
        self.num_patches = (image_size // patch_size) ** 2
        with init_rng_scope(config, "patch_embedding"):
            self.patch_embedding = ColumnParallelLinear(
                in_channels * patch_size**2,
                config.hidden_size,
                config=config,
                init_method=init_method(config),
                bias=True,
                gather_output=True,
                pg_collection=self.pg_collection,
            )
        with init_rng_scope(config, "vision_position_embedding"):
            table = torch.zeros(self.num_patches, config.hidden_size, dtype=torch.float32)
            if config.perform_initialization:
                init_method(config)(table)
        self.position_embeddings = mark_replicated(nn.Parameter(table.to(config.params_dtype)))
        self.decoder = TransformerBlock(config, get_vision_layer_spec(), True, True, self.pg_collection)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        expected = (self.in_channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images must have shape [b, {', '.join(map(str, expected))}], got {tuple(images.shape)}")
        patches = patchify(images.to(self.config.params_dtype), self.patch_size)
        hidden, _ = self.patch_embedding(patches)
        hidden = (hidden + self.position_embeddings).transpose(0, 1).contiguous()
        return self.decoder(hidden)
