"""The msgpack protocol: round trips, and malformed bytes rejected with a message saying why."""

import pickle

import msgpack
import pytest

from megatron.core.inference.coordinator.messages import (
    MessageKind,
    ProtocolError,
    check_output,
    decode,
    encode,
    error_output,
    sampling_params_from_dict,
    sampling_params_to_dict,
    submitted_request_id,
)
from megatron.core.inference.engines.requests import RequestOutput
from megatron.core.inference.sampling import InvalidSamplingParamsError, SamplingParams


def test_submit_round_trips_with_sampling_params():
    params = SamplingParams(temperature=0.5, top_k=3, seed=2**63, max_tokens=7, stop=["\n", "END"], logprobs=True)
    data = encode(
        MessageKind.SUBMIT, request_id="r1", prompt_tokens=[1, 2, 3], sampling_params=sampling_params_to_dict(params)
    )
    kind, payload = decode(data)
    assert kind is MessageKind.SUBMIT
    assert payload["request_id"] == "r1" and payload["prompt_tokens"] == [1, 2, 3]
    assert sampling_params_from_dict(payload["sampling_params"]) == params


def test_garbage_and_pickle_are_rejected():
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode(b"\xc1")
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode(pickle.dumps(["submit", {}]))
    with pytest.raises(ProtocolError, match=r"2-element array \[kind, payload map\]"):
        decode(msgpack.packb({"kind": "submit"}))


def test_unknown_kind_and_missing_keys_are_named():
    with pytest.raises(ProtocolError, match="unknown message kind 'launch'; accepted: submit, abort"):
        decode(msgpack.packb(["launch", {}]))
    with pytest.raises(ProtocolError, match=r"abort message needs keys \['request_id'\]; missing \['request_id'\]"):
        decode(msgpack.packb(["abort", {"id": "x"}]))
    with pytest.raises(ProtocolError, match=r"submit message needs keys .* missing \['sampling_params'\]"):
        encode(MessageKind.SUBMIT, request_id="r", prompt_tokens=[])


def test_values_msgpack_cannot_hold_are_refused_at_encode():
    with pytest.raises(ProtocolError, match="abort message holds a value msgpack cannot encode"):
        encode(MessageKind.ABORT, request_id=object())


def test_unknown_sampling_field_is_a_sampling_error():
    with pytest.raises(InvalidSamplingParamsError, match=r"unknown sampling parameters \['beam_width'\]"):
        sampling_params_from_dict({"beam_width": 4})


def test_outputs_are_checked_on_arrival():
    output = error_output("r", {"type": "X", "message": "m", "details": {}}, prompt_tokens=3)
    assert check_output(output) is output
    with pytest.raises(ProtocolError, match="request output lacks 'generated_tokens'"):
        check_output({k: v for k, v in output.items() if k != "generated_tokens"})
    with pytest.raises(ProtocolError, match="unknown finish_reason 'done'"):
        check_output({**output, "finish_reason": "done"})
    with pytest.raises(ProtocolError, match="finish_reason exactly when it is finished"):
        check_output({**output, "finished": False})


def test_engine_outputs_carry_their_text_through_msgpack():
    output = RequestOutput("r", [104, 105], [-0.5, -1.5], "hi", True, "stop", None, None, 3, 2)
    _, payload = decode(encode(MessageKind.OUTPUTS, outputs=[output.to_dict()]))
    (arrived,) = payload["outputs"]
    assert RequestOutput.from_dict(check_output(arrived)) == output
    with pytest.raises(ProtocolError, match="request output field 'new_text' has type int"):
        check_output({**arrived, "new_text": 5})
    assert check_output(error_output("r", None))["new_text"] == ""


def test_field_types_are_checked_on_arrival_and_a_bad_submit_keeps_its_request_id():
    bad_params = msgpack.packb(["submit", {"request_id": "r", "prompt_tokens": [1], "sampling_params": "greedy"}])
    with pytest.raises(ProtocolError, match="submit message field 'sampling_params' has type str"):
        decode(bad_params)
    assert submitted_request_id(bad_params) == "r"  # so that the submit is still answered
    text = msgpack.packb(["submit", {"request_id": "r", "prompt_tokens": "123", "sampling_params": {}}])
    assert decode(text)[1]["prompt_tokens"] == "123"  # a prompt is the coordinator's to refuse (PromptTypeError)
    with pytest.raises(ProtocolError, match="unknown control signal 'explode'; accepted: pause, resume, stop"):
        decode(msgpack.packb(["control", {"signal": "explode"}]))
    with pytest.raises(ProtocolError, match="stats message field 'query_id' has type bool"):
        decode(msgpack.packb(["stats", {"query_id": True}]))
    assert submitted_request_id(b"\xc1") is None
    assert submitted_request_id(msgpack.packb(["abort", {"request_id": "r"}])) is None
