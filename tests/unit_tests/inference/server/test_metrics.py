"""/metrics through prometheus-client: request timings, tokens, per-status counts, engine gauges,
and the prefix-cache hit rate of a real engine."""

import openai
from prometheus_client.parser import text_string_to_metric_families

from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.server.metrics import ServerMetrics
from tests.unit_tests.inference.engines.common import gpt_model
from tests.unit_tests.transformer.single_rank import on_single_rank

from ..coordinator.cluster import wait_until
from ..coordinator.engine_double import HashEngine
from .harness import TOKENIZER, openai_server, sample, scrape


def test_a_request_is_timed_counted_and_labelled_by_status():
    engine = HashEngine(step_delay_s=0.002)
    with openai_server([engine], max_in_flight_per_request=2) as (server, coordinator):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        api.completions.create(model="megatron", prompt="abc", max_tokens=5, n=3)
        chunks = list(api.completions.create(model="megatron", prompt="de", max_tokens=4, stream=True))
        assert len(chunks) == 4
        try:
            api.completions.create(model="other", prompt="abc")
        except openai.NotFoundError:
            pass
        samples = scrape(server.url)
    assert sample(samples, "megatron_requests_total", endpoint="/v1/completions", status="200") == 2
    assert sample(samples, "megatron_requests_total", endpoint="/v1/completions", status="404") == 1
    assert sample(samples, "megatron_requests_by_status_class_total", endpoint="/v1/completions", status_class="4xx")
    assert sample(samples, "megatron_prompt_tokens_total") == 3 + 2
    assert sample(samples, "megatron_generation_tokens_total") == 3 * 5 + 4
    # One first token and one end per request served, a queue time per choice (4 choices: 3 + 1),
    # an inter-token gap per token after each choice's first.
    assert sample(samples, "megatron_time_to_first_token_seconds_count") == 2
    assert sample(samples, "megatron_e2e_request_latency_seconds_count") == 2
    assert sample(samples, "megatron_request_queue_time_seconds_count") == 4
    assert sample(samples, "megatron_inter_token_latency_seconds_count") == 3 * 4 + 3
    assert sample(samples, "megatron_inter_token_latency_seconds_sum") > 0
    assert sample(samples, "megatron_e2e_request_latency_seconds_bucket", le="+Inf") == 2
    assert sample(samples, "megatron_requests_running") == 0
    assert sample(samples, "megatron_queue_depth") == 0
    # The engine's latest periodic report (it may predate the last request's end).
    assert 0 <= sample(samples, "megatron_engine_kv_usage_fraction", engine="engine-0") <= 1
    assert sample(samples, "megatron_prefix_cache_hit_rate") is None  # the server was not told the block size


def test_the_prefix_cache_hit_rate_is_cached_over_all_prompt_tokens():
    metrics = ServerMetrics(kv_block_size=4)
    stats = {
        "unrouted": 1,
        "engines": [
            {"engine_id": "a", "pending": 2, "stats": {"prefix_cache_hits": 3, "prefill_tokens_computed": 8}},
            {"engine_id": "b", "pending": 0, "stats": {"prefix_cache_hits": 1, "prefill_tokens_computed": 4}},
        ],
    }
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(stats).decode())}
    assert families["megatron_prefix_cache_hit_rate"].samples[0].value == 4 * 4 / (4 * 4 + 12)
    assert families["megatron_queue_depth"].samples[0].value == 3
    assert {s.labels["engine"]: s.value for s in families["megatron_engine_prefix_cache_hits"].samples} == {
        "a": 3,
        "b": 1,
    }
    families = {f.name for f in text_string_to_metric_families(metrics.render(None).decode())}
    assert "megatron_queue_depth" not in families and "megatron_requests" in families


@on_single_rank
def test_a_real_engine_reports_its_kv_use_and_prefix_cache_hits(pg):
    engine = DynamicInferenceEngine(
        gpt_model(pg),
        max_tokens_per_step=32,
        block_size=4,
        num_blocks=64,
        max_requests=8,
        max_sequence_length=48,
        tokenizer=TOKENIZER,
        pg_collection=pg,
        enable_prefix_caching=True,
    )
    prompt = list(range(1, 14))  # three full blocks and one token
    with openai_server([engine], kv_block_size=4) as (server, _):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            api.completions.create(model="megatron", prompt=prompt, max_tokens=2, temperature=0)
        # Engines report their stats periodically: wait for the report after the second prefill.
        wait_until(
            lambda: sample(scrape(server.url), "megatron_engine_prefix_cache_hits", engine="engine-0"),
            "the engine to report its prefix-cache hits",
        )
        samples = scrape(server.url)
    # The second request finds the first one's three full prompt blocks and computes one token.
    assert sample(samples, "megatron_engine_prefix_cache_hits", engine="engine-0") == 3
    assert sample(samples, "megatron_engine_prefill_tokens_computed", engine="engine-0") == 13 + 1
    assert sample(samples, "megatron_prefix_cache_hit_rate") == 12 / (12 + 14)
    assert 0 <= sample(samples, "megatron_engine_kv_usage_fraction", engine="engine-0") <= 1
