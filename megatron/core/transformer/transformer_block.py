"""The stack of transformer layers held by one pipeline stage (plus the final norm on the last)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def virtual_pipeline_size(config: TransformerConfig) -> int:
    """Model chunks per pipeline rank: ``config.virtual_pipeline_model_parallel_size`` (None is 1)."""
    return config.virtual_pipeline_model_parallel_size or 1


def virtual_stage_index(config: TransformerConfig, pp_rank: int, pp_size: int, vp_stage: int | None) -> int:
    """Position of chunk ``vp_stage`` of rank ``pp_rank`` in the pipeline of ``pp_size x V``
    (virtual) stages: ``vp_stage * pp_size + pp_rank``, as Megatron interleaves them.
    ``vp_stage`` must be given exactly when the config asks for virtual stages."""
    vp_size = virtual_pipeline_size(config)
    if vp_stage is None and config.virtual_pipeline_model_parallel_size is not None:
        raise PipelineLayoutError(
            f"virtual_pipeline_model_parallel_size is {vp_size}: pass vp_stage (0..{vp_size - 1}) to say which "
            "model chunk to build"
        )
    if vp_stage is not None and not (isinstance(vp_stage, int) and 0 <= vp_stage < vp_size):
        raise PipelineLayoutError(
            f"vp_stage={vp_stage!r} is outside virtual_pipeline_model_parallel_size "
            f"({config.virtual_pipeline_model_parallel_size}); accepted: 0..{vp_size - 1}"
        )
    return (vp_stage or 0) * pp_size + pp_rank


def is_first_virtual_stage(config: TransformerConfig, pp_rank: int, pp_size: int, vp_stage: int | None) -> bool:
    """Whether chunk ``vp_stage`` of rank ``pp_rank`` is the first stage of the whole pipeline."""
    return virtual_stage_index(config, pp_rank, pp_size, vp_stage) == 0


def is_last_virtual_stage(config: TransformerConfig, pp_rank: int, pp_size: int, vp_stage: int | None) -> bool:
    """Whether chunk ``vp_stage`` of rank ``pp_rank`` is the last stage of the whole pipeline."""
    return virtual_stage_index(config, pp_rank, pp_size, vp_stage) == pp_size * virtual_pipeline_size(config) - 1


def stage_layer_counts(config: TransformerConfig, pp_size: int) -> list[int]:
    """Layers of each (virtual) pipeline stage, in pipeline order: the even split of
    :func:`num_layers_per_stage`, or with ``num_layers_in_first_pipeline_stage`` /
    ``num_layers_in_last_pipeline_stage`` those ends and the rest shared evenly by the other
    stages (Megatron's uneven split; no virtual stages)."""
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        return [num_layers_per_stage(config, pp_size)] * (pp_size * virtual_pipeline_size(config))
    if config.virtual_pipeline_model_parallel_size is not None or pp_size < 2:
        raise PipelineLayoutError(
            "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage need "
            f"pipeline_model_parallel_size > 1 (got {pp_size}) and no virtual pipeline stages"
        )
    middle = pp_size - (first is not None) - (last is not None)
    rest = config.num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle == 0 and rest) or (middle and (rest % middle or rest < middle)):
        raise PipelineLayoutError(
            f"num_layers ({config.num_layers}) less the first stage's ({first}) and the last stage's ({last}) "
            f"layers must split evenly, at least one each, over the other {middle} pipeline stage(s)"
        )
    counts = [rest // middle if middle else 0] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def num_layers_per_stage(config: TransformerConfig, pp_size: int) -> int:
    """Layers on each (virtual) pipeline stage: ``num_layers / (pp_size x V)`` (it must divide,
    >= 1 each)."""
    stages = pp_size * virtual_pipeline_size(config)
    if config.num_layers % stages or config.num_layers < stages:
        if config.virtual_pipeline_model_parallel_size is None:
            raise PipelineLayoutError(
                f"num_layers ({config.num_layers}) must be a positive multiple of pipeline_model_parallel_size "
                f"({pp_size}) so that every stage holds the same number of layers"
            )
        raise PipelineLayoutError(
            f"num_layers ({config.num_layers}) must be a positive multiple of pipeline_model_parallel_size "
            f"({pp_size}) x virtual_pipeline_model_parallel_size ({config.virtual_pipeline_model_parallel_size}) "
            f"= {stages} so that every virtual stage holds the same number of layers"
        )
    return config.num_layers // stages


def stage_layer_numbers(config: TransformerConfig, pp_rank: int, pp_size: int, vp_stage: int | None = None) -> range:
    """Global layer numbers (from 1) of chunk ``vp_stage`` of stage ``pp_rank`` (may be empty)."""
    counts = stage_layer_counts(config, pp_size)
    index = virtual_stage_index(config, pp_rank, pp_size, vp_stage)
    offset = sum(counts[:index])
    return range(offset + 1, offset + counts[index] + 1)


def layer_offset(config: TransformerConfig, pp_rank: int, pp_size: int, vp_stage: int | None = None) -> int:
    """Number of layers before chunk ``vp_stage`` of stage ``pp_rank``; its first global layer
    number is ``offset + 1``."""
    return stage_layer_numbers(config, pp_rank, pp_size, vp_stage).start - 1


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
        if full_recompute:
            hidden_states = self._recomputed_forward(hidden_states, attention_mask, rotary_pos_emb)
        else:
            for layer in self.layers:
                hidden_states = layer(
                    hidden_states,
                    attention_mask=attention_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    inference_context=inference_context,
                )
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _recomputed_forward(self, hidden_states, attention_mask, rotary_pos_emb) -> torch.Tensor:
        """Full recompute by ``config.recompute_method``: ``block`` checkpoints the first
        ``recompute_num_layers`` layers one by one and runs the rest plainly; ``uniform`` (and
        None) checkpoints each run of ``recompute_num_layers`` (default 1) layers as one unit,
        keeping only its input."""
        count = self.config.recompute_num_layers or 1
        layers = list(self.layers)
        if self.config.recompute_method == "block":
            for layer in layers[:count]:
                hidden_states = checkpoint(layer, hidden_states, attention_mask, rotary_pos_emb)
            return _run_layers(layers[count:])(hidden_states, attention_mask, rotary_pos_emb)
        for start in range(0, len(layers), count):
            group = layers[start : start + count]
            hidden_states = checkpoint(_run_layers(group), hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states


def _run_layers(layers: list[nn.Module]):
    """A function running ``layers`` one after the other (one checkpointed unit)."""

    def run(hidden_states, attention_mask, rotary_pos_emb):
        for layer in layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        return hidden_states

    return run


class TransformerBlock(StageLayerStack):
    """This (virtual) stage's transformer layers (``num_layers / (pp x V)`` of them, or the
    uneven split of :func:`stage_layer_counts`, numbered globally; chunk ``vp_stage`` of rank p
    holds virtual stage ``vp_stage * pp + p``) and, on the last stage, the final norm."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: ModuleSpec | Sequence[ModuleSpec],
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
    ):
        pg_collection = resolve_pg_collection(pg_collection)
        pp_rank, pp_size = pg_collection.rank("pp"), pg_collection.size("pp")

        def layer_spec(number: int) -> ModuleSpec:  # one spec for all layers, or one per global layer
            return spec[number - 1] if isinstance(spec, (list, tuple)) else spec

        super().__init__(
            config,
            list(stage_layer_numbers(config, pp_rank, pp_size, vp_stage)),
            lambda number: build_module(
                layer_spec(number), config=config, layer_number=number, pg_collection=pg_collection
            ),
            pre_process,
            post_process,
        )
