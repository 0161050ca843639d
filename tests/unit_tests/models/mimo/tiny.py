"""A tiny MIMO job (GPT language model + ViT over 8x8 images) shared by the MIMO tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.config import TransformerConfig
from megatron.core.datasets.synthetic_image_caption import SyntheticImageCaptionDataset
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.mimo import (
    LANGUAGE_MODEL,
    MimoRoles,
    build_bridges,
    build_mimo_model,
    forward_backward,
    image_submodule_provider,
    module_parts,
    wrap_with_ddp,
)
from megatron.core.tensor_parallel import gather_full_grad
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from megatron.training.data import microbatches

TOKENIZER = ByteLevelTokenizer()
IMAGE_TOKEN = TOKENIZER.vocab_size
VOCAB = TOKENIZER.vocab_size + 1
SEQ, IMAGE, PATCH = 24, 8, 4
NUM_IMAGE_TOKENS = (IMAGE // PATCH) ** 2
LM_HIDDEN = 32


def language_config(tp=1, gtp=1) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=LM_HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        generalized_tensor_parallel_size=gtp,
        init_seed=7,
    )


def encoder_config(tp=1, gtp=1) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        tensor_model_parallel_size=tp,
        generalized_tensor_parallel_size=gtp,
        init_seed=8,
    )


def dataset(num_samples=64) -> SyntheticImageCaptionDataset:
    return SyntheticImageCaptionDataset(num_samples, SEQ, IMAGE, NUM_IMAGE_TOKENS, TOKENIZER, IMAGE_TOKEN, seed=3)


def build_job(language: dict, encoder: dict, placement="colocated", micro_batch_size=2):
    """(roles, collections, model, ddp modules, bridges) of this rank."""
    roles = MimoRoles.build(
        dist.get_world_size(), language=language, modalities={"images": encoder}, placement=placement
    )
    collections = roles.build_collections()
    lm_cfg = language_config(language.get("tp", 1), language.get("gtp", 1))
    enc_cfg = encoder_config(encoder.get("tp", 1), encoder.get("gtp", 1))

    def language_model(pg):
        return GPTModel(lm_cfg, get_gpt_layer_local_spec(), VOCAB, SEQ, pg_collection=pg)

    model = build_mimo_model(
        collections,
        language_model,
        {"images": image_submodule_provider(enc_cfg, IMAGE, PATCH, LM_HIDDEN)},
        {"images": IMAGE_TOKEN},
    )
    ddp = wrap_with_ddp(model, collections, DistributedDataParallelConfig())
    bridges = build_bridges(roles, micro_batch_size, {"images": (NUM_IMAGE_TOKENS, LM_HIDDEN)})
    return roles, collections, model, ddp, bridges


def iterators(roles, collections, bridges, data, start=0):
    """This rank's language and image micro-batch iterators."""
    from megatron.core.models.mimo.roles import data_index, data_width

    me = dist.get_rank()
    language, images = None, {}
    if LANGUAGE_MODEL in collections:
        layout = roles.layouts[LANGUAGE_MODEL]
        language = microbatches(
            data,
            start_sample=start,
            micro_batch_size=bridges["images"].language_micro_batch_size,
            data_rank=data_index(layout, me),
            data_width=data_width(layout),
            device="cpu",
        )
    if "images" in collections:
        layout = roles.layouts["images"]
        images["images"] = microbatches(
            data,
            start_sample=start,
            micro_batch_size=bridges["images"].encoder_micro_batch_size,
            data_rank=data_index(layout, me),
            data_width=data_width(layout),
            device="cpu",
        )
    return language, images


def grads_after_one_batch(language: dict, encoder: dict, num_microbatches=2, micro_batch_size=2):
    """Mean loss over the global batch and the full gradient of every parameter (keys
    ``<module>.<param name>``), after DDP and finalize reductions."""
    roles, collections, model, ddp, bridges = build_job(language, encoder, micro_batch_size=micro_batch_size)
    lm_iter, image_iters = iterators(roles, collections, bridges, dataset())
    losses = forward_backward(model, bridges, lm_iter, image_iters, num_microbatches)
    grads = {}
    for name, part in module_parts(model).items():
        finalize_model_grads([ddp[name]], collections[name], part.config)
        for pname, param in part.named_parameters():
            grad = gather_full_grad(param, collections[name])
            # The vocabulary padding depends on TP: compare the real vocabulary rows only.
            grads[f"{name}.{pname}"] = grad[:VOCAB] if "word_embeddings" in pname or "output_layer" in pname else grad
    loss = torch.stack(losses).mean()
    group = collections[LANGUAGE_MODEL].dp_cp_gtp_or_dp_cp()
    dist.all_reduce(loss, group=group)
    return loss.item() / dist.get_world_size(group), grads
