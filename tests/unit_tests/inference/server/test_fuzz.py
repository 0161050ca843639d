"""Schema-driven fuzzing (schemathesis over the server's OpenAPI document): no 5xx, no crash."""

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from ..coordinator.engine_double import HashEngine
from .harness import openai_server, scripted_output

EXAMPLES_PER_OPERATION = 15


def test_generated_requests_never_get_a_server_error():
    engine = HashEngine(script=scripted_output, max_sequence_length=256)
    # A small default length keeps generated requests without max_tokens short.
    with openai_server([engine], default_max_tokens=4, max_prompt_tokens=200) as (server, coordinator):
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        seen_statuses = set()
        for result in schema.get_all_operations():
            operation = result.ok()
            # Only request bodies can be made invalid (a path's model id is any string; some routes take nothing).
            modes = [GenerationMode.POSITIVE] + (
                [GenerationMode.NEGATIVE] if operation.get_request_payload_content_types() else []
            )
            for mode in modes:

                @settings(
                    max_examples=EXAMPLES_PER_OPERATION,
                    deadline=None,
                    database=None,
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=operation.as_strategy(generation_mode=mode))
                def check(case):
                    response = case.call(base_url=server.url, timeout=10)
                    seen_statuses.add(response.status_code)
                    assert response.status_code < 500, (case.as_curl_command(), response.text)
                    if response.status_code >= 400:
                        assert set(response.json()["error"]) == {"message", "type", "param", "code"}

                check()
        assert {200, 400} <= seen_statuses
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        assert coordinator.router.routes == {}
        coordinator.router.check_invariants()
