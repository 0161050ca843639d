"""CP2 on two real gloo processes: ring and all-gather attention equal SDPA on the whole
sequence (forward and backward, GQA); GPT and hybrid (``M*M-``) losses and gradients equal
CP1's; each rank's attention input is half the sequence with equal work; the batch sharding
of the data path; the typed refusals (attention dropout, masks, mismatched sizes, Mamba
heads that do not split, the inference engine)."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.engines.errors import EngineConfigError
from megatron.core.transformer.context_parallel import ContextParallelConfigError, get_batch_on_this_cp_rank
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.transformer.context_parallel import cp_cases

CP = 2


@pytest.mark.parametrize("kernel", ["torch", "sdpa"])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_attention_over_the_sharded_sequence_equals_sdpa(comm_type, kernel):
    for error, tolerance in run_distributed(cp_cases.attention_against_sdpa, CP, comm_type, kernel):
        assert error < tolerance


@pytest.mark.parametrize("family", ["gpt", "hybrid"])
def test_loss_and_gathered_gradients_equal_cp1(family):
    ((loss_1, grads_1),) = run_distributed(cp_cases.loss_and_gradients, 1, family, 1)
    loss_c, grads_c = run_distributed(cp_cases.loss_and_gradients, CP, family, CP)[0]
    assert loss_c == pytest.approx(loss_1, rel=1e-6)
    assert grads_c.keys() == grads_1.keys()
    for name, grad in grads_1.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_without_position_ids_each_rank_uses_the_global_positions_of_its_chunks():
    assert all(run_distributed(cp_cases.default_positions_are_global, CP, "gpt"))


def test_each_rank_attends_half_the_sequence_with_equal_work():
    results = run_distributed(cp_cases.attention_work_per_rank, CP)
    for lengths, work in results:
        assert lengths == [cp_cases.SEQ // CP] * 2  # both layers
        assert work == 2 * CP  # chunk pairs
    works = [work for _, work in results]
    assert max(works) - min(works) <= 1


def _batch_shards():
    group = dist.group.WORLD
    batch = {"tokens": torch.arange(8).view(1, 8), "loss_mask": torch.ones(1, 8), "name": "x"}
    mine = get_batch_on_this_cp_rank(batch, group)
    try:
        get_batch_on_this_cp_rank({"attention_mask": torch.ones(1, 1, 8, 8)}, group)
    except Exception as error:  # noqa: BLE001 - returned to the test for its exact type and message
        refused = error
    return mine["tokens"].tolist(), mine["loss_mask"].shape, mine["name"], type(refused).__name__, str(refused)


def test_the_data_path_shards_every_sequence_tensor_once():
    (rank0, rank1) = run_distributed(_batch_shards, CP)
    assert rank0[:3] == ([[0, 1, 6, 7]], (1, 4), "x")
    assert rank1[:3] == ([[2, 3, 4, 5]], (1, 4), "x")
    assert rank0[3] == "ContextParallelInputError"
    assert "batch entry 'attention_mask' of shape (1, 1, 8, 8) has no [b, s] layout" in rank0[4]


def _refusals():
    pg = cp_cases.collection(cp=CP)
    messages = {}

    def refused(name, build, error_type=ContextParallelConfigError):
        try:
            build()
        except error_type as error:
            messages[name] = str(error)

    refused("mismatch", lambda: cp_cases.build_model("gpt", pg, context_parallel_size=1))
    refused("mamba_heads", lambda: cp_cases.build_model("hybrid", pg, mamba_num_groups=1))
    model = cp_cases.build_model("gpt", pg)
    tokens = torch.zeros(1, cp_cases.SEQ // CP, dtype=torch.long)
    refused("mask", lambda: model(tokens, attention_mask=torch.zeros(1, 1, 16, 16, dtype=torch.bool)))
    refused("engine", lambda: DynamicInferenceEngine(model, num_blocks=8, pg_collection=pg), EngineConfigError)
    return messages


def test_features_that_cannot_shard_the_sequence_are_refused_with_typed_errors():
    messages = run_distributed(_refusals, CP)[0]
    assert messages == {
        "mismatch": "config.context_parallel_size (1) differs from the cp group size (2); build the config for the "
        "collection (ModelRecord.config_for does)",
        "mamba_heads": "mamba_num_heads (8) and mamba_num_groups (1) must be divisible by tensor_model_parallel_size "
        "x context_parallel_size (1 x 2): the Mamba scan runs on heads split over TP x CP",
        "mask": "context parallelism takes no explicit attention_mask (causal attention over the sharded sequence)",
        "engine": "inference runs at context parallel size 1, got 2; build the model and its process groups with "
        "context_parallel_size=1 (a checkpoint trained with CP loads at any CP)",
    }
