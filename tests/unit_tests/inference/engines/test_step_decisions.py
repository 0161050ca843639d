"""The fixed tensor layout of a step's decisions: every field round-trips bit-exactly (fp32
log-probs, -inf, tiny values, top log-probs), empty decisions take no prompt room, and decisions
that do not fit the layout are refused by name."""

import math
import re
import struct

import pytest
import torch

from megatron.core.inference.engines.step_decisions import Decision, DecisionLayout


def fp32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def test_decisions_round_trip_bit_exactly_through_one_int64_tensor():
    layout = DecisionLayout(max_tokens=3, max_next_drafts=2, prompt_log_prob_capacity=(4, 0, 2))
    decisions = [
        Decision(prompt_log_probs=[fp32(-0.1), -math.inf, fp32(-1e-30)], tokens=[7], log_probs=[fp32(-2.5)]),
        Decision(tokens=[1, 2, 3], log_probs=[fp32(-1 / 3), -math.inf, 0.0], accepted_drafts=2, next_drafts=[4, 5]),
        Decision(prompt_log_probs=[fp32(-7.25), fp32(-8.5)]),  # still prefilling: no token yet
    ]
    packed = layout.pack(decisions)
    assert packed.dtype == torch.int64 and packed.shape == (layout.size,) == (3 * (4 + 3 + 2 + 3) + 6,)
    unpacked = layout.unpack(packed.clone())
    assert unpacked == decisions
    bits = [struct.pack("d", v) for d in unpacked for v in d.log_probs + d.prompt_log_probs]
    assert bits == [struct.pack("d", v) for d in decisions for v in d.log_probs + d.prompt_log_probs]


def test_top_log_probs_round_trip_for_the_requests_that_asked():
    layout = DecisionLayout(
        max_tokens=2, max_next_drafts=1, prompt_log_prob_capacity=(0, 0, 1), top_log_prob_widths=(2, 0, 3)
    )
    decisions = [
        Decision(
            tokens=[5, 6],
            log_probs=[fp32(-0.5), -math.inf],
            accepted_drafts=1,
            next_drafts=[9],
            top_log_probs=[[(5, fp32(-0.5)), (1, fp32(-2.0))], [(2, fp32(-0.25)), (6, -math.inf)]],
        ),
        Decision(tokens=[3], log_probs=[fp32(-1.5)]),
        Decision(prompt_log_probs=[fp32(-3.0)]),  # prefilling: no token, so no top rows
    ]
    assert layout.size == 3 * (4 + 2 + 1) + 2 * 2 * (2 + 0 + 3) + 3 * 2 + 1
    assert layout.unpack(layout.pack(decisions)) == decisions
    with pytest.raises(ValueError, match=re.escape("1 top log-prob rows) does not fit the layout")):
        layout.pack([decisions[0], decisions[1], Decision(tokens=[4], log_probs=[0.0], top_log_probs=[[(4, 0.0)]])])


def test_a_receiving_stage_gets_an_empty_tensor_of_the_layout_size():
    layout = DecisionLayout(max_tokens=1, max_next_drafts=0, prompt_log_prob_capacity=(0, 5))
    assert layout.empty().shape == (2 * (4 + 1) + 2 + 5,) and layout.empty().dtype == torch.int64


@pytest.mark.parametrize(
    "decision,problem",
    [
        (Decision(tokens=[1, 2, 3], log_probs=[0.0, 0.0, 0.0]), "3 tokens, 3 log-probs, 0 drafts, 0 prompt log-probs"),
        (Decision(tokens=[1], log_probs=[]), "1 tokens, 0 log-probs"),
        (Decision(tokens=[1], log_probs=[0.0], next_drafts=[1, 2]), "1 tokens, 1 log-probs, 2 drafts"),
        (Decision(prompt_log_probs=[0.0] * 3), "0 tokens, 0 log-probs, 0 drafts, 3 prompt log-probs"),
    ],
)
def test_decisions_that_do_not_fit_the_layout_are_refused(decision, problem):
    layout = DecisionLayout(max_tokens=2, max_next_drafts=1, prompt_log_prob_capacity=(2,))
    with pytest.raises(ValueError, match=re.escape(f"decision 0 ({problem}")) as error:
        layout.pack([decision])
    assert (
        "does not fit the layout (at most 2 tokens with one log-prob each, 1 drafts, 2 prompt log-probs, 0 top "
        "log-probs per token)" in str(error.value)
    )
    with pytest.raises(ValueError, match="2 decisions for a layout of 1 requests"):
        layout.pack([decision, decision])
    with pytest.raises(ValueError, match=re.escape(f"packed decisions are int64 [{layout.size}], got torch.float32")):
        layout.unpack(torch.zeros(layout.size))
