"""Keys and quotas through a real `inferd serve --keys` (echo worker): 401s, reloads without a restart, 429s with
their headers, request_too_large, and the refund of the unused reservation. Token counts, not timings: the rate
window is 600 s, so a bucket refills only ~0.17-3 tokens per second and the tolerances say so."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from gw import completion, make_keys

from inferd.gateway.tenants import create_key, revoke_key

WINDOW = 600.0
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def keyed(serve, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = make_keys(path, {"refund": {"tpm": 2000}, "tok": {"tpm": 100}, "req": {"rpm": 3},
                            "free": {}, "bulk": {"tier": "batch"}, "gone": {}})
    server = serve("--keys", str(path), "--metrics-key", "quota-metrics-key", "--rate-window", str(WINDOW),
                   "--max-model-len", "1024")
    return server, keys, path


def remaining_tokens(r: httpx.Response) -> int:
    return int(r.headers["x-ratelimit-remaining-tokens"])


def test_refund_gives_back_the_unused_reservation(keyed):
    """max_tokens 500, stopped after 20 tokens (a stop token the echo worker reaches at its 20th output): 480 tokens
    of quota come back."""
    server, keys, _ = keyed
    prompt = list(range(1000, 1019)) + [7777] + list(range(2000, 2010))  # 30 tokens, 7777 is the 20th
    started = time.monotonic()
    first = completion(server, keys["refund"], prompt, 500, stop_token_ids=[7777])
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (30, 20)
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    assert first.headers["x-ratelimit-limit-tokens"] == "2000"
    assert 2000 - 530 <= remaining_tokens(first) <= 2000 - 530 + 1  # reserved at admission: prompt + max_tokens
    second = completion(server, keys["refund"], [5], 1)
    elapsed = time.monotonic() - started
    refill = 2000 / WINDOW * elapsed
    gained = remaining_tokens(second) - remaining_tokens(first)  # 480 back, this request's 2 taken, plus refill
    assert 480 - 2 - 1 <= gained <= 480 - 2 + refill + 1, (gained, refill)


def test_over_tpm_is_429_with_retry_after_and_headers(keyed):
    server, keys, _ = keyed
    ok = completion(server, keys["tok"], [1] * 10, 60)  # 70 of 100
    assert ok.status_code == 200, ok.text
    refused = completion(server, keys["tok"], [1] * 10, 60)  # needs 70, ~30 left
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "rate_limit_exceeded")
    assert "tokens" in error["message"] and "tok" in error["message"]
    retry = int(refused.headers["Retry-After"])
    needed = 70 - remaining_tokens(refused)
    assert abs(retry - needed / (100 / WINDOW)) <= 7  # whole seconds, rounded up, refill while it ran
    assert refused.headers["x-ratelimit-limit-tokens"] == "100"
    assert refused.headers["x-ratelimit-reset-tokens"].endswith("s")
    small = completion(server, keys["tok"], [1] * 5, 5)  # what still fits is admitted: nothing was taken by the 429
    assert small.status_code == 200, small.text


def test_a_request_larger_than_the_whole_tpm_is_request_too_large(keyed):
    server, keys, _ = keyed
    r = completion(server, keys["tok"], [1] * 10, 200)
    assert r.status_code == 429
    error = r.json()["error"]
    assert error["code"] == "request_too_large"
    assert "210" in error["message"] and "100" in error["message"]  # both numbers
    assert "Retry-After" not in r.headers  # waiting would not help


def test_over_rpm_is_429_naming_requests(keyed):
    server, keys, _ = keyed
    statuses = [completion(server, keys["req"], [1], 1).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    r = completion(server, keys["req"], [1], 1)
    assert r.status_code == 429 and "requests" in r.json()["error"]["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert r.headers["x-ratelimit-limit-requests"] == "3" and r.headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.parametrize("auth", [None, "Bearer", "Bearer hello", "Basic abc",
                                  "Bearer sk-inferd-000000000000-" + "a" * 43])
def test_missing_malformed_and_unknown_keys_are_401(keyed, auth):
    server, _, _ = keyed
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401


def _poll_status(server, key: str, want: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status = completion(server, key, [1], 1).status_code
        if status == want:
            return
        assert time.monotonic() < deadline, f"still {status}, never {want}"
        time.sleep(0.05)


def test_keys_file_changes_take_effect_without_a_restart(keyed):
    server, keys, path = keyed
    new_key, _ = create_key(str(path), "newcomer")  # the file changes: noticed by the server's poll
    _poll_status(server, new_key, 200)
    assert completion(server, keys["gone"], [1], 1).status_code == 200
    revoke_key(str(path), keys["gone"])
    os.kill(server.proc.pid, signal.SIGHUP)  # and SIGHUP reloads at once
    _poll_status(server, keys["gone"], 401)
    r = completion(server, keys["gone"], [1], 1)
    assert "revoked" in r.json()["error"]["message"]
    assert completion(server, keys["free"], [1], 1).status_code == 200  # the others still work
    assert server.proc.poll() is None  # SIGHUP did not stop it


def test_a_tenant_may_ask_for_a_lower_tier_never_a_higher(keyed):
    server, keys, _ = keyed
    down = completion(server, keys["free"], [1], 1, headers={"x-inferd-tier": "batch"})
    assert down.status_code == 200 and down.headers["x-inferd-tier"] == "batch"
    assert completion(server, keys["free"], [1], 1).headers["x-inferd-tier"] == "standard"
    up = completion(server, keys["bulk"], [1], 1, headers={"x-inferd-tier": "interactive"})
    assert up.status_code == 403 and up.json()["error"]["code"] == "tier_not_allowed"
    bad = completion(server, keys["free"], [1], 1, headers={"x-inferd-tier": "gold"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-inferd-tier"
    for value in ("0", "-1", "nan", "soon", "99999"):
        r = completion(server, keys["free"], [1], 1, headers={"x-inferd-queue-timeout": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-inferd-queue-timeout", value


def test_metrics_count_tokens_per_tenant(keyed):
    server, keys, _ = keyed
    before = server.metrics().get('inferd_tenant_tokens_total{tenant="free"}', 0.0)
    assert completion(server, keys["free"], [1, 2, 3], 4).status_code == 200
    assert server.metrics()['inferd_tenant_tokens_total{tenant="free"}'] == before + 7
