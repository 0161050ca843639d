"""GPT (with MTP and tied embeddings) and hybrid models (four `|` segments) split PP2 x V2:
chunk v of rank p holds virtual stage v * PP + p, and one global batch through the interleaved
schedule gives the single-process losses and gradients."""

import dataclasses

import pytest

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_layer_pattern import HybridPatternError
from megatron.core.models.model_record import model_chunks_from_record
from megatron.core.transformer import PipelineLayoutError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.pipeline_parallel.interleaved_models import (
    RECORDS,
    check_layout_matches_single_process,
    losses_and_grads,
)


@pytest.mark.parametrize("family", ["gpt", "hybrid"])
def test_pp2_vp2_matches_single_process(family):
    reference = run_distributed(losses_and_grads, 1, family, 1, None, 4)[0]
    check_layout_matches_single_process(reference, run_distributed(losses_and_grads, 2, family, 2, 2, 4))


def _layer_numbers(pp, vp):
    from megatron.core import parallel_state

    pgc = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    layers = {}
    for family in RECORDS:
        chunks = model_chunks_from_record(RECORDS[family], pgc, vp)
        layers[family] = [
            (chunk.pre_process, chunk.post_process, chunk.decoder.layer_numbers, chunk.mtp is not None)
            for chunk in chunks
        ]
        layers[family + " symbols"] = [getattr(chunk.decoder, "layer_symbols", None) for chunk in chunks]
    return layers


def test_chunk_v_of_rank_p_holds_virtual_stage_v_pp_plus_p():
    rank0, rank1 = run_distributed(_layer_numbers, 2, 2, 2)
    assert rank0["gpt"] == [(True, False, [1, 2], False), (False, False, [5, 6], False)]
    assert rank1["gpt"] == [(False, False, [3, 4], False), (False, True, [7, 8], True)]
    assert rank0["hybrid"] == [(True, False, [1, 2], False), (False, False, [5, 6], False)]
    assert rank0["hybrid symbols"] == ["M*", "*M"] and rank1["hybrid symbols"] == ["M-", "-M"]


def _construction_errors():
    from megatron.core import parallel_state

    pgc = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    gpt_config = dataclasses.replace(
        RECORDS["gpt"].config,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        mtp_num_layers=None,
    )
    attempts = {
        "vp_stage out of range": lambda: GPTModel(
            gpt_config, get_gpt_layer_local_spec(), 64, 8, pg_collection=pgc, vp_stage=2
        ),
        "vp_stage missing": lambda: GPTModel(gpt_config, get_gpt_layer_local_spec(), 64, 8, pg_collection=pgc),
        "layers": lambda: model_chunks_from_record(RECORDS["gpt"], pgc, 3),
        "segments": lambda: model_chunks_from_record(RECORDS["hybrid"], pgc, 4),
    }
    errors = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except (PipelineLayoutError, HybridPatternError) as error:
            errors[name] = (type(error).__name__, str(error))
    return errors


def test_bad_virtual_stage_layouts_are_typed_errors():
    errors = run_distributed(_construction_errors, 2)[0]
    assert errors["vp_stage out of range"] == (
        "PipelineLayoutError",
        "vp_stage=2 is outside virtual_pipeline_model_parallel_size (2); accepted: 0..1",
    )
    assert errors["vp_stage missing"][1].startswith("virtual_pipeline_model_parallel_size is 2: pass vp_stage (0..1)")
    assert errors["layers"] == (
        "PipelineLayoutError",
        "num_layers (8) must be a positive multiple of pipeline_model_parallel_size (2) x "
        "virtual_pipeline_model_parallel_size (3) = 6 so that every virtual stage holds the same number of layers",
    )
    assert errors["segments"][0] == "HybridPatternError"
    assert (
        "has 4 pipeline segment(s) separated by '|', which do not divide evenly among 2 pipeline stage(s) x 4 "
        in (errors["segments"][1])
    )
