"""StructuredOutputParams: one grammar per request, checked where it is built, and carried by
SamplingParams through the coordinator's wire form unchanged."""

import pytest

from megatron.core.inference.coordinator.messages import sampling_params_from_dict, sampling_params_to_dict
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.structured_output import InvalidStructuredOutputError, StructuredOutputParams


def test_sampling_params_carry_the_grammar_through_their_wire_form():
    grammar = StructuredOutputParams(json_schema='{"type":"integer"}', prefix="<a>", suffix="</a>", strict=False)
    params = SamplingParams(temperature=0.5, structured_output=grammar)
    wire = sampling_params_to_dict(params)
    assert wire["structured_output"] == {
        "json_schema": '{"type":"integer"}',
        "json_object": False,
        "prefix": "<a>",
        "suffix": "</a>",
        "strict": False,
    }
    assert sampling_params_from_dict(wire) == params
    assert sampling_params_from_dict(sampling_params_to_dict(SamplingParams())).structured_output is None


@pytest.mark.parametrize(
    "value, message",
    [
        ({}, "structured output needs exactly one of json_schema (JSON text) or json_object=True"),
        (
            {"json_schema": "{}", "json_object": True},
            "structured output needs exactly one of json_schema (JSON text) or json_object=True",
        ),
        ({"json_schema": {"type": "object"}}, "json_schema must be JSON text, got dict"),
        ({"json_object": True, "prefix": 3}, "prefix must be a string, got 3"),
        ({"json_object": True, "regex": "a+"}, "unknown structured output fields ['regex']"),
    ],
)
def test_a_bad_grammar_description_is_refused_where_it_is_built(value, message):
    with pytest.raises(InvalidStructuredOutputError) as error:
        SamplingParams(structured_output=value)
    assert str(error.value).startswith(message)
