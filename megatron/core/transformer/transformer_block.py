"""The stack of transformer layers held by one pipeline stage (plus the final norm on the last)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tensor_parallel import checkpoint, init_rng_scope
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec import ModuleSpec, build_module


class PipelineLayoutError(ConfigError):
    """The layers cannot be split over the pipeline stages as requested."""


def num_layers_per_stage(config: TransformerConfig, pp_size: int) -> int:
    """Layers on each pipeline stage: ``num_layers / pp_size`` (it must divide, >= 1 each)."""
    if config.num_layers % pp_size or config.num_layers < pp_size:
        raise PipelineLayoutError(
            f"num_layers ({config.num_layers}) must be a positive multiple of pipeline_model_parallel_size "
            f"({pp_size}) so that every stage holds the same number of layers"
        )
    return config.num_layers // pp_size


def layer_offset(config: TransformerConfig, pp_rank: int, pp_size: int) -> int:
    """Number of layers before stage ``pp_rank``; its first global layer number is ``offset + 1``."""
    return pp_rank * num_layers_per_stage(config, pp_size)


def check_no_virtual_pipeline(vp_stage: int | None) -> None:
    """Virtual (interleaved) pipeline stages are not supported yet."""
    if vp_stage is not None:
        raise PipelineLayoutError(f"virtual pipeline stages are not supported yet; got vp_stage={vp_stage}, pass None")


class StageLayerStack(nn.Module):
    """Layers of one pipeline stage with their global 1-based numbers (layer ``n`` built inside
    ``init_rng_scope(config, f"layer{n}")`` by ``build_layer(n)``) and, on the last stage, the
    final norm.

    The first stage takes ``hidden_states`` from the caller; later stages read the tensor
    given to :meth:`set_input_tensor` (sent by the previous stage).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_numbers: list[int],
        build_layer: Callable[[int], nn.Module],
        pre_process: bool = True,
        post_process: bool = True,
    ):
        super().__init__()
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(layer_numbers)
        layers = []
        for number in self.layer_numbers:
            with init_rng_scope(config, f"layer{number}"):
                layers.append(build_layer(number))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = None
        if post_process:
            with init_rng_scope(config, "final_norm"):
                self.final_layernorm = build_norm(config)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Hidden states [s, b, h] received from the previous pipeline stage."""
        self.input_tensor = input_tensor

    def compile_layers(self, **compile_kwargs) -> None:
        """``torch.compile`` each layer in place (keyword arguments go to ``Module.compile``).

        Regional compilation: the layers run the same code, so they share one compiled graph
        and compile time is that of one layer. TP/SP collectives break the graph, so they run
        outside the compiled regions; inside them the fused ops take their torch reference,
        which Inductor fuses with its neighbours.
        """
        for layer in self.layers:
            layer.compile(**compile_kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        inference_context=None,
    ) -> torch.Tensor:
        if not self.pre_process:
            if self.input_tensor is None:
                raise ValueError(
                    "this pipeline stage has no input: call set_input_tensor() with the previous "
                    "stage's hidden states before forward"
                )
            hidden_states = self.input_tensor
        full_recompute = self.config.recompute_granularity == "full" and self.training and inference_context is None
        for layer in self.layers:
            if full_recompute:
                hidden_states = checkpoint(layer, hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states = layer(
                    hidden_states,
                    attention_mask=attention_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    inference_context=inference_context,
                )
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


class TransformerBlock(StageLayerStack):
    """This stage's transformer layers (``num_layers / pp`` of them, numbered globally) and, on
    the last stage, the final norm."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: ModuleSpec,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
    ):
        check_no_virtual_pipeline(vp_stage)
        pg_collection = resolve_pg_collection(pg_collection)
        pp_rank, pp_size = pg_collection.rank("pp"), pg_collection.size("pp")
        offset = layer_offset(config, pp_rank, pp_size)
        super().__init__(
            config,
            list(range(offset + 1, offset + num_layers_per_stage(config, pp_size) + 1)),
            lambda number: build_module(spec, config=config, layer_number=number, pg_collection=pg_collection),
            pre_process,
            post_process,
        )
