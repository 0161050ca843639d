"""Issue 19, item 19: a pipeline stage that cannot size its inference cache shares why through
the capacity negotiation. With only ``num_blocks`` given, the Mamba stage of a two-stage hybrid
engine (2 gloo ranks) cannot size its state; instead of raising alone while the attention stage
waits out the negotiation timeout, both stages raise the same CapacityError naming the Mamba
stage and its reason."""

from megatron.core.inference.contexts import CapacityError
from megatron.core.inference.engines import DynamicInferenceEngine
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.inference.engines.common import hybrid_model
from tests.unit_tests.models.hybrid.common import collection

REASON = (
    "cannot size its inference cache: a stage with Mamba layers needs buffer_size_bytes, mamba_budget_bytes or "
    "max_requests to size its state"
)


def _build_with_only_num_blocks():
    pg = collection(pp=2)
    model = hybrid_model(pg, pattern="*-|M-", pipeline_model_parallel_size=2)
    try:
        DynamicInferenceEngine(model, block_size=4, num_blocks=32, max_sequence_length=32, pg_collection=pg)
    except CapacityError as err:
        return type(err).__name__, err.limiting_stage, str(err)
    return None


def test_a_stage_that_cannot_size_its_cache_names_itself_and_its_reason_on_every_stage():
    attention_stage, mamba_stage = run_distributed(_build_with_only_num_blocks, 2, timeout_s=120)
    assert attention_stage == (
        "CapacityError",
        1,
        f"pipeline stage 1 (a remote stage; this is stage 0) {REASON}",
    )
    assert mamba_stage == ("CapacityError", 1, f"pipeline stage 1 (this stage) {REASON}")
