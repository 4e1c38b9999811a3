"""The live dashboard (/dashboard): a real headless Chromium (Debian's `chromium`, driven by playwright) loads the page
from a real server under load. No console error; every number the page shows with a `data-key` is that sample of
/metrics (bracketed by scrapes before and after the poll under load, equal once the server is quiet); the percentiles
it shows are histogram_quantile of /metrics' own buckets (computed here, independently); 429s and 503s show as
admission outcomes. The screenshot goes to tmp_path, and to $INFERD_DASHBOARD_PNG when set (docs/dashboard.png is
made that way)."""

from __future__ import annotations

import math
import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from inferd.api.dashboard import histogram_quantile, sample_key
from servers import kill_group, start_server

pytestmark = pytest.mark.timeout(180)

CHROMIUM = "/usr/bin/chromium"
METRICS_KEY = "dash-metrics-key-42"
# Chromium as the machine allows it: no sandbox (root), no GPU, and none of the background traffic that a closed
# network refuses
CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TENANTS = {"alice": {"tier": "interactive", "tpm": 100000, "max_concurrency": 8},
           "bulk": {"tier": "batch"},
           "stingy": {"tpm": 40}}  # asks for more than its whole quota every time: 429 request_too_large
# (predicates passed to the page are functions: the page's Content-Security-Policy forbids eval of a string)
# counted when the request ends, so a scrape and the page's own poll move them: never compared
_SELF_COUNTED = ('inferd_requests_total{route="/metrics"', 'inferd_requests_total{route="/dashboard/data"')
_COUNTER = re.compile(r"_(total|count|sum|bucket)(\{|$)")


@pytest.fixture(scope="module")
def dash_server(tiny_llama_dir, tmp_path_factory):
    from inferd.gateway.tenants import create_key

    folder = tmp_path_factory.mktemp("dashboard")
    keys = {name: create_key(str(folder / "keys.json"), name, **limits)[0] for name, limits in TENANTS.items()}
    server = start_server(tiny_llama_dir, folder / "serve.log", "--max-model-len", "256", "--heartbeat-interval",
                          "0.1", "--keys", str(folder / "keys.json"), "--metrics-key", METRICS_KEY,
                          "--max-num-seqs", "2", "--worker-queue-depth", "0", "--max-queue-requests", "2",
                          "--tenant-queue-share", "1", model_name="tiny-dash")
    yield server, keys
    kill_group(server.proc)


def scrape(server) -> dict[str, float]:
    return server.metrics({"Authorization": f"Bearer {METRICS_KEY}"})


class Load:
    """Clients on threads: alice and bulk stream completions (10 at once: more than the worker's 2 slots and the
    line's 2 places hold, so some get 503), stingy asks for more than its token quota (429)."""

    def __init__(self, server, keys):
        self.server, self.keys = server, keys
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self.client, args=(tenant, i), daemon=True)
                        for i, tenant in enumerate(["alice"] * 4 + ["bulk"] * 6 + ["stingy"])]

    def client(self, tenant: str, i: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                body = {"prompt": f"tenant {tenant} request {i}-{n}", "max_tokens": 60 if tenant == "stingy" else 80,
                        "stream": True, "ignore_eos": True}
                with client.stream("POST", self.server.url + "/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {self.keys[tenant]}"}) as r:
                    for _ in r.iter_lines():
                        pass
                self.statuses.append(r.status_code)
                if r.status_code != 200:
                    self.stop.wait(0.05)  # a refused client comes back soon, not in a tight loop

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def shown(page) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """(data-key -> (data-value, text), data-derived -> (data-value, text)) of the page as rendered."""
    rows = page.eval_on_selector_all(
        "[data-key],[data-derived]",
        "els => els.map(e => [e.dataset.key || null, e.dataset.derived || null, e.dataset.value, e.textContent])")
    keyed, derived = {}, {}
    for key, name, value, text in rows:
        (keyed if key is not None else derived)[key if key is not None else name] = (value, text)
    return keyed, derived


def poll_once(page, server) -> tuple[dict, dict, dict, dict]:
    """With the page paused: scrape, make the page poll once and render, scrape. -> (before, after, keyed, derived)"""
    polls = int(page.get_attribute("body", "data-polls") or 0)
    before = scrape(server)
    page.click("#refresh")
    page.wait_for_function("n => Number(document.body.dataset.polls || 0) > n", arg=polls, timeout=10000)
    after = scrape(server)
    keyed, derived = shown(page)
    return before, after, keyed, derived


def quantile_from_metrics(m: dict[str, float], family: str, q: float) -> float | None:
    """histogram_quantile over a /metrics histogram's cumulative buckets, written here from Prometheus' definition:
    the rank q*count falls in the first bucket whose count reaches it; linear inside it from its lower bound."""
    buckets = sorted((float(re.search(r'le="([^"]+)"', k)[1]), v) for k, v in m.items()
                     if k.startswith(family + "_bucket{"))
    total = buckets[-1][1]
    if total == 0:
        return None
    rank, lo, lo_count = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo
            return lo + (bound - lo) * (rank - lo_count) / (count - lo_count) if count > lo_count else bound
        lo, lo_count = bound, count


def parse_text(text: str) -> float | None:
    text = text.strip()
    if text == "–":
        return None
    if text.endswith("%"):
        return float(text[:-1]) / 100
    if text.endswith(" ms"):
        return float(text[:-3]) / 1000
    if text.endswith(" s"):
        return float(text[:-2])
    return float(text)


def check_text(value: float, text: str) -> None:
    """The text is the value as the page rounds it (integers exactly)."""
    parsed = parse_text(text)
    if float(value).is_integer() and not text.endswith(("%", "s")):
        assert parsed == value, (value, text)
    else:
        assert parsed == pytest.approx(value, rel=0.06, abs=1e-3), (value, text)


def test_quantile_and_keys_by_hand():
    # 10 observations: 4 <= 0.1, 8 <= 0.2, 10 <= 0.4. p50: rank 5 in (0.1, 0.2]: 0.1 + 0.1 * (5-4)/(8-4) = 0.125
    buckets = [(0.1, 4.0), (0.2, 8.0), (0.4, 10.0), (math.inf, 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.125)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.2 + 0.2 * (9.9 - 8) / 2)
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.05)  # first bucket: from 0
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 2.0)]) == 0.1  # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert sample_key("m", {"a": 'x"y\\z\n'}) == 'm{a="x\\"y\\\\z\\n"}'


def test_dashboard_in_a_real_browser_under_load(dash_server, tmp_path):
    from playwright.sync_api import sync_playwright

    server, keys = dash_server
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    # the data is behind the metrics key; the page itself is open
    assert httpx.get(server.url + "/dashboard/data").status_code == 401
    tenant = {"Authorization": f"Bearer {keys['alice']}"}  # a tenant's key is no metrics key
    assert httpx.get(server.url + "/dashboard/data", headers=tenant).status_code == 401
    page_response = httpx.get(server.url + "/dashboard")
    assert page_response.status_code == 200 and "connect-src 'self'" in page_response.headers["content-security-policy"]
    assert httpx.get(server.url + "/dashboard/data?window=0",
                     headers={"Authorization": f"Bearer {METRICS_KEY}"}).status_code == 400

    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in (
                "error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}"))
            page.on("request", lambda r: None if r.url.startswith((server.url, "data:")) else
                    problems.append(f"request off the server: {r.url}"))
            with Load(server, keys) as load:
                page.goto(server.url + f"/dashboard#key={METRICS_KEY}")
                page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1", timeout=15000)
                page.click("#pause")
                busy_seen = False
                for _ in range(40):  # under load: counters lie between the scrapes around the poll
                    before, after, keyed, _ = poll_once(page, server)
                    for key, (value, _text) in keyed.items():
                        if _COUNTER.search(key) and not key.startswith(_SELF_COUNTED) and value:
                            assert before.get(key, 0.0) <= float(value) <= after[key], (key, before.get(key), value)
                    running = keyed.get('inferd_num_requests_running{model="tiny-dash"}', ("", ""))[0]
                    busy_seen = busy_seen or (running not in ("", "0") and float(running) > 0)
                    outcomes = {k for k, (v, _text) in keyed.items()  # every outcome is shown from the start, at 0
                                if k.startswith("inferd_gateway_admissions_total") and v and float(v) > 0}
                    if busy_seen and {'inferd_gateway_admissions_total{outcome="overloaded"}',
                                      'inferd_gateway_admissions_total{outcome="rate_limited_too_large"}'} <= outcomes:
                        break
                    time.sleep(0.2)
                assert busy_seen, "the page never showed a running request under load"
                page.screenshot(path=str(tmp_path / "dashboard-under-load.png"), full_page=True)
            assert {200, 429, 503} <= set(load.statuses), sorted(set(load.statuses))

            # quiet: the shown numbers equal /metrics (polls until two scrapes around a poll agree)
            deadline = time.monotonic() + 30
            while True:
                before, after, keyed, derived = poll_once(page, server)
                moving = {k for k in set(before) | set(after)
                          if before.get(k) != after.get(k) and not k.startswith(_SELF_COUNTED)}
                if not moving and after.get("inferd_gateway_open_requests") == 0:
                    break
                assert time.monotonic() < deadline, f"the server never went quiet: {sorted(moving)[:10]}"
                time.sleep(0.3)
            assert len(keyed) > 30, sorted(keyed)
            for key, (value, text) in keyed.items():
                if key.startswith(_SELF_COUNTED):
                    continue
                if key not in after:
                    assert value == "" and text == "–", (key, value, text)
                    continue
                assert float(value) == after[key], (key, value, after[key])
                check_text(after[key], text)
            for outcome in ("admitted", "rate_limited_too_large", "overloaded"):
                assert after[f'inferd_gateway_admissions_total{{outcome="{outcome}"}}'] > 0
                assert f'inferd_gateway_admissions_total{{outcome="{outcome}"}}' in keyed
            # the answers clients got, in the window (the server's whole life): 429s and 503s counted by outcome
            outcome = {k[len('inferd_gateway_admissions_total{outcome="'):-2]: v for k, v in after.items()
                       if k.startswith("inferd_gateway_admissions_total{")}
            got = {code: float(derived[f"admissions_in_window.status_{code}"][0]) for code in ("200", "429", "503")}
            assert got == {"200": outcome["admitted"],
                           "429": sum(v for k, v in outcome.items() if k.startswith("rate_limited_") or
                                      k == "queue_share"),
                           "503": sum(outcome.get(k, 0.0) for k in ("overloaded", "shed", "queue_timeout"))}, got
            # each tenant's quota is the keys file's, and its usage is there beside it
            assert float(keyed['inferd_tenant_quota{limit="tpm",tenant="stingy"}'][0]) == 40
            assert float(keyed['inferd_tenant_quota{limit="max_concurrency",tenant="alice"}'][0]) == 8
            assert float(keyed['inferd_tenant_tokens_total{tenant="alice"}'][0]) > 0
            # tier shares: each tier's share, seats, borrowed seats and preemptions as /metrics has them (checked with
            # every keyed number above), and its generated tokens in the window (the server's life)
            for tier in ("interactive", "standard", "batch"):
                for family in ("inferd_tier_share", "inferd_tier_seats", "inferd_tier_borrowed_seats",
                               "inferd_tier_preemptions_total"):
                    assert f'{family}{{tier="{tier}"}}' in keyed, (family, tier)
                assert float(derived[f"tier_tokens_in_window.{tier}"][0]) == after.get(
                    f'inferd_tier_generated_tokens_total{{tier="{tier}"}}', 0.0)
            assert after.get('inferd_tier_generated_tokens_total{tier="interactive"}', 0.0) > 0
            states = [k for k in after if k.startswith("inferd_worker_state{")]  # one worker, serving
            assert len(states) == 1 and 'state="serving"' in states[0], states
            worker = re.search(r'worker="([^"]+)"', states[0])[1]
            row = page.text_content("#workers")
            assert worker in row and "serving" in row and re.search(r'version="([^"]*)"', states[0])[1] in row
            assert f'inferd_worker_step_tokens{{worker="{worker}"}}' in keyed
            # percentiles over the window: the server is younger than the window, so they are the whole histogram's
            assert "the server's life" in page.text_content("#lat-window")
            for short, family in (("ttft", "inferd_time_to_first_token_seconds"),
                                  ("tpot", "inferd_time_per_output_token_seconds"),
                                  ("e2e", "inferd_e2e_request_latency_seconds")):
                for q in (0.5, 0.9, 0.99):
                    value, text = derived[f"latency.{short}.p{round(q * 100)}"]
                    expected = quantile_from_metrics(after, family, q)
                    assert expected is not None and float(value) == pytest.approx(expected, rel=1e-9), (short, q)
                    check_text(expected, text)
                assert float(derived[f"latency.{short}.count"][0]) == after[f"{family}_count"]

            page.select_option("#window", "60")  # another window: the page asks for it, and still renders
            page.wait_for_function("() => document.getElementById('lat-window').textContent.includes('60') || "
                                   "document.getElementById('lat-window').textContent.includes('life')")
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("INFERD_DASHBOARD_PNG"):
        shutil.copy(tmp_path / "dashboard-under-load.png", os.environ["INFERD_DASHBOARD_PNG"])
    assert not problems, problems
