"""The interleaved (virtual-stage) 1F1B schedule on two ranks: the losses and gradients of a
single-process loop, its pass order, its bubble as measured from the timeline, and its errors."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    BACKWARD,
    FORWARD,
    ScheduleError,
    forward_backward_pipelining_with_interleaving,
    get_forward_backward_func,
    interleaved_order,
    microbatch_group_error,
)
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.pipeline_parallel.interleaved_toy import pipelined, plain_loop


def check_against_plain_loop(results, num_layers, num_microbatches, pp):
    ref_losses, ref_grads = plain_loop(num_layers, num_microbatches)
    seen = set()
    for rank, losses, grads, _ in results:
        assert losses == (pytest.approx(ref_losses, rel=1e-6) if rank == pp - 1 else [])
        for index, layer_grads in grads.items():
            seen.add(index)
            for got, want in zip(layer_grads, ref_grads[index], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert seen == set(range(num_layers))


@pytest.mark.parametrize("vp,num_microbatches", [(2, 2), (2, 4), (3, 6)])
def test_interleaved_matches_single_process(vp, num_microbatches):
    num_layers = 2 * vp * 2
    results = run_distributed(pipelined, 2, 2, vp, num_layers, num_microbatches)
    check_against_plain_loop(results, num_layers, num_microbatches, 2)


def test_interleaved_forward_only_returns_the_losses():
    ref_losses, _ = plain_loop(4, 4)
    results = run_distributed(pipelined, 2, 2, 2, 4, 4, True)
    assert results[1][1] == pytest.approx(ref_losses, rel=1e-6)
    assert results[0][1] == [] and results[0][2] == {}


def test_pass_order_warms_up_alternates_and_cools_down():
    order = interleaved_order(2, 0, 2, 4)
    # rank 0 of PP2 x V2: 2 * (2 - 0 - 1) + (2 - 1) * 2 = 4 warm-up forwards over chunk 0 then 1
    assert order[:4] == [(FORWARD, 0, 0), (FORWARD, 0, 1), (FORWARD, 1, 0), (FORWARD, 1, 1)]
    assert order[4:6] == [(FORWARD, 0, 2), (BACKWARD, 1, 0)]
    assert order[-1] == (BACKWARD, 0, 3)
    for rank in range(2):
        passes = interleaved_order(2, rank, 2, 4)
        assert sorted(passes) == sorted(
            (kind, c, m) for kind in (FORWARD, BACKWARD) for c in range(2) for m in range(4)
        )
        for chunk in range(2):
            for microbatch in range(4):
                assert passes.index((FORWARD, chunk, microbatch)) < passes.index((BACKWARD, chunk, microbatch))


def _simulated_idle_fractions(pp, vp, num_microbatches, forward_s=1.0, backward_s=2.0, group_size=None):
    """Replay every rank's pass order with free communication: a pass starts when its rank is
    free and its input (previous virtual stage's forward, next one's backward) is done."""
    orders = {rank: interleaved_order(pp, rank, vp, num_microbatches, group_size=group_size) for rank in range(pp)}
    finished, clock, busy, position = {}, [0.0] * pp, [0.0] * pp, [0] * pp
    last_stage = pp * vp - 1
    while any(position[rank] < len(orders[rank]) for rank in range(pp)):
        progressed = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                kind, chunk, microbatch = orders[rank][position[rank]]
                stage = chunk * pp + rank
                if kind == FORWARD:
                    source = stage - 1 if stage > 0 else None
                else:
                    source = stage + 1 if stage < last_stage else stage
                needs = None
                if source is not None:
                    source_kind = FORWARD if source == stage else kind
                    needs = (source % pp, source_kind, source // pp, microbatch)
                if needs is not None and needs not in finished:
                    break
                duration = (forward_s if kind == FORWARD else backward_s) / vp
                clock[rank] = max(clock[rank], finished.get(needs, 0.0)) + duration
                busy[rank] += duration
                finished[rank, kind, chunk, microbatch] = clock[rank]
                position[rank] += 1
                progressed = True
        assert progressed, "the pass orders deadlock"
    return [1 - busy[rank] / max(clock) for rank in range(pp)]


@pytest.mark.parametrize("pp,vp,num_microbatches", [(2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_pass_order_has_exactly_the_interleaved_bubble(pp, vp, num_microbatches):
    expected = (pp - 1) / (vp * num_microbatches + pp - 1)
    assert _simulated_idle_fractions(pp, vp, num_microbatches) == pytest.approx([expected] * pp, abs=1e-9)


def test_micro_batch_groups_follow_megatrons_table():
    # PP2 x V2, five micro-batches in groups of three: chunk 0 on 0-2, chunk 1 on 0-2, then the
    # last group (3, 4) through chunk 0 and chunk 1; backwards from the last chunk
    forwards = [(c, m) for kind, c, m in interleaved_order(2, 0, 2, 5, forward_only=True, group_size=3)]
    assert forwards == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (0, 3), (0, 4), (1, 3), (1, 4)]
    order = interleaved_order(2, 0, 2, 5, group_size=3)
    # warm-up 2 (2 - 0 - 1) + (2 - 1) 3 = 5 forwards, then the first backward is chunk 1's micro-batch 0
    assert [kind for kind, _, _ in order[:7]] == [FORWARD] * 6 + [BACKWARD] and order[6] == (BACKWARD, 1, 0)
    assert interleaved_order(2, 1, 2, 4, group_size=2) == interleaved_order(2, 1, 2, 4)


def test_every_valid_micro_batch_group_runs_without_deadlock():
    """Every group size Megatron accepts, for PP 2-4, V 2-3 and up to 12 micro-batches: the pass
    orders of all ranks complete (the replay asserts progress) and every rank works."""
    valid = 0
    for pp in (2, 3, 4):
        for vp in (2, 3):
            for num_microbatches in range(pp, 13):
                for group_size in range(pp, num_microbatches + 1):
                    if microbatch_group_error(pp, num_microbatches, group_size) is None:
                        idle = _simulated_idle_fractions(pp, vp, num_microbatches, group_size=group_size)
                        assert all(0 <= fraction < 1 for fraction in idle)
                        valid += 1
    assert valid > 100


@pytest.mark.parametrize(
    "pp,num_microbatches,group_size,message",
    [
        (2, 3, 1, "pipeline_model_parallel_size (2) <= G <= num_microbatches (3); got G = 1"),
        (2, 3, 4, "pipeline_model_parallel_size (2) <= G <= num_microbatches (3); got G = 4"),
        (4, 10, 4, "last group of micro-batches (10 % 4 = 2) must be empty or hold at least"),
    ],
)
def test_micro_batch_groups_megatron_refuses(pp, num_microbatches, group_size, message):
    assert message in microbatch_group_error(pp, num_microbatches, group_size)


def test_three_micro_batches_in_one_group_match_the_single_process_loop():
    results = run_distributed(pipelined, 2, 2, 2, 8, 3, False, 0.0, 3)
    check_against_plain_loop(results, 8, 3, 2)


def test_measured_bubble_matches_the_formula():
    """Sleep-padded layers (forward 0.2 s, backward 0.4 s) make compute dominate; the idle
    share the ranks measure from their timelines is (p - 1) / (v m + p - 1)."""
    pp, vp, num_microbatches = 2, 2, 4
    results = run_distributed(pipelined, pp, pp, vp, pp * vp, num_microbatches, False, 0.2)
    idle_fractions = [idle_fraction for _, _, _, idle_fraction in results]
    assert sum(idle_fractions) / pp == pytest.approx((pp - 1) / (vp * num_microbatches + pp - 1), abs=0.05)


def _bad_calls():
    pgc = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    common = dict(forward_step_func=None, model=chunks, tensor_shape=(1, 1, 2), pg_collection=pgc)
    messages = []
    for kwargs in (
        dict(num_microbatches=3, data_iterator=[iter([]), iter([])]),
        dict(num_microbatches=2, data_iterator=iter([])),
        dict(num_microbatches=2, data_iterator=[iter([]), iter([])], no_sync_func=[None]),
    ):
        with pytest.raises(ScheduleError) as error:
            forward_backward_pipelining_with_interleaving(**common, **kwargs)
        messages.append(str(error.value))
    return messages


def test_bad_arguments_are_typed_errors():
    assert get_forward_backward_func(2, 2) is forward_backward_pipelining_with_interleaving
    with pytest.raises(ScheduleError, match="needs pipeline_model_parallel_size > 1"):
        get_forward_backward_func(1, 2)
    messages = run_distributed(_bad_calls, 2)[0]
    assert "last group of micro-batches (3 % 2 = 1) must be empty" in messages[0]
    assert "a list of one data iterator per model chunk (2)" in messages[1]
    assert "one callable per model chunk (2)" in messages[2]
