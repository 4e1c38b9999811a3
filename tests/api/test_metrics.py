"""/metrics: every family the issue names is exported, and the counters move by exactly what a request did."""

from __future__ import annotations

import httpx

FAMILIES = ["inferd_requests_total", "inferd_time_to_first_token_seconds_count",
            "inferd_time_per_output_token_seconds_count", "inferd_e2e_request_latency_seconds_count",
            "inferd_prompt_tokens_total", "inferd_generation_tokens_total", "inferd_num_requests_running",
            "inferd_num_requests_waiting", "inferd_kv_blocks_in_use", "inferd_kv_blocks_total",
            "inferd_prefix_cache_hit_tokens_total", "inferd_prefix_cache_query_tokens_total",
            "inferd_preemptions_total", "inferd_engine_step_seconds_count", "inferd_engine_steps_total",
            "inferd_server_dispatch_seconds_count", "inferd_server_token_write_seconds_count"]


def _value(m: dict, family: str) -> float:
    return sum(v for k, v in m.items() if k == family or k.startswith(family + "{"))


def test_metrics_families_and_deltas(tiny_server):
    prompt = list(range(2000, 2040))  # 40 tokens: two full 16-token blocks can be cached
    body = {"model": tiny_server.model, "prompt": prompt, "max_tokens": 7, "ignore_eos": True, "stream": True}
    before = tiny_server.metrics()
    for _ in range(2):
        r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers=tiny_server.headers, timeout=60)
        assert r.status_code == 200
    # the engine's gauges and counters reach the server with the worker's heartbeats: a heartbeat sent before the
    # second request was admitted also says 0 running, so wait until its prefix-cache hit shows as well
    hits_before = _value(before, "inferd_prefix_cache_hit_tokens_total")
    after = tiny_server.wait_metrics(lambda m: _value(m, "inferd_num_requests_running") == 0
                                     and _value(m, "inferd_prefix_cache_hit_tokens_total") - hits_before >= 32
                                     and _value(m, "inferd_kv_blocks_in_use") == 0)
    for family in FAMILIES:
        assert any(k == family or k.startswith(family + "{") for k in after), family

    def delta(family):
        return _value(after, family) - _value(before, family)

    assert delta("inferd_generation_tokens_total") == 14
    assert delta("inferd_prompt_tokens_total") == 80
    assert delta("inferd_time_to_first_token_seconds_count") == 2
    assert delta("inferd_e2e_request_latency_seconds_count") == 2
    assert delta("inferd_time_per_output_token_seconds_count") == 2
    assert delta("inferd_server_dispatch_seconds_count") == 2
    assert 2 <= delta("inferd_server_token_write_seconds_count") <= 14  # one per chunk with text
    assert delta('inferd_requests_total{route="/v1/completions",status="200"}') == 2
    assert delta("inferd_prefix_cache_hit_tokens_total") >= 32  # the second request reused two blocks
    assert _value(after, "inferd_kv_blocks_in_use") == 0
