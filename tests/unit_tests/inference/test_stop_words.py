"""Stop sequences: held-back partial matches, truncation before the first stop to complete, and
any split of the text gives the same emitted text and stop decision as a direct scan."""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.core.inference.stop_words import (
    InvalidStopSequencesError,
    StopCheck,
    StopSequenceFinishedError,
    StopSequenceMatcher,
    normalize_stop_sequences,
)


def reference(text, stops):
    """Scan end positions in order; stop at the first where a stop sequence ends (longest wins)."""
    for end in range(1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            return text[: end - max(map(len, ending))], True
    return text, False


def run(stops, pieces):
    matcher, emitted = StopSequenceMatcher(stops), []
    for piece in pieces:
        check = matcher.feed(piece)
        emitted.append(check.text)
        assert matcher.held_chars < max(map(len, stops))
        if check.stopped:
            return "".join(emitted), True
    return "".join(emitted) + matcher.finish(), False


def test_partial_stop_is_held_then_dropped_when_it_completes():
    matcher = StopSequenceMatcher(["</s>", "###"])
    assert matcher.feed("Hello #") == StopCheck("Hello ", stopped=False)
    assert matcher.held_chars == 1
    assert matcher.feed("## world") == StopCheck("", stopped=True)


def test_partial_stop_that_does_not_complete_is_emitted():
    matcher = StopSequenceMatcher(normalize_stop_sequences("###"))
    assert matcher.feed("a ##") == StopCheck("a ", stopped=False)
    assert matcher.feed(" b") == StopCheck("## b", stopped=False)
    assert matcher.feed("##") == StopCheck("", stopped=False)
    assert matcher.finish() == "##"


def test_stop_that_completes_first_wins_over_one_that_starts_first():
    assert StopSequenceMatcher(["abcd", "bc"]).feed("xabcd") == StopCheck("xa", stopped=True)
    assert StopSequenceMatcher(["bc", "abc"]).feed("xabcd") == StopCheck("x", stopped=True)


def test_no_stop_sequences_pass_everything_through():
    matcher = StopSequenceMatcher(normalize_stop_sequences(None))
    assert matcher.feed("anything") == StopCheck("anything", stopped=False)
    assert matcher.finish() == ""


def test_use_after_stop_is_refused():
    matcher = StopSequenceMatcher(["x"])
    assert matcher.feed("ax").stopped
    with pytest.raises(StopSequenceFinishedError, match="feed\\(\\) was called after the output stopped or finished"):
        matcher.feed("b")
    with pytest.raises(StopSequenceFinishedError, match="finish\\(\\) was called after the output stopped or finished"):
        matcher.finish()


@pytest.mark.parametrize("stop", ["", [""], ["a", 3], 5])
def test_invalid_stop_sequences_are_refused(stop):
    with pytest.raises(
        InvalidStopSequencesError, match="stop must be a non-empty string or a list of non-empty strings"
    ):
        normalize_stop_sequences(stop)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab#\n", max_size=20),
    stops=st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), min_size=1, max_size=3),
    data=st.data(),
)
def test_any_split_gives_the_same_text_and_decision(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in pairwise(bounds)]
    expected = reference(text, stops)
    assert run(stops, [text]) == expected
    assert run(stops, pieces) == expected
    assert run(stops, list(text)) == expected
