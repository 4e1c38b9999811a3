"""The Grafana dashboard (deploy/grafana/inferd.json): a dashboard model Grafana imports (title, uid, a Prometheus
datasource variable, panels with targets, unique ids), and every metric its PromQL reads is one a real server
exports: names are taken from the expressions and looked up in the /metrics of `inferd serve` (the session's
tiny_server). A renamed metric fails here instead of leaving an empty panel."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)

DASHBOARD = "deploy/grafana/inferd.json"

# PromQL words that are not metric names: aggregations, functions (a name followed by "(" is dropped anyway),
# binary operators and modifiers, and the literals Inf/NaN
PROMQL_WORDS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "group",
                "count_values", "limitk", "limit_ratio", "by", "without", "on", "ignoring", "group_left",
                "group_right", "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}


@pytest.fixture(scope="module")
def dashboard(repo) -> dict:
    return json.loads((repo / DASHBOARD).read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(query)
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: string literals, label matchers {...}, range and subquery
    selectors [...], grouping clauses `by (...)` & co. and $variables removed, then every identifier that is not a
    function call (followed by "(") nor a PromQL word. label_values(METRIC, label) (a Grafana variable query) reads
    METRIC."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\blabel_values\s*\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,[^)]*\)", r" \1 ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", text):
        if m.group(2) is None and m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(inferd_time_to_first_token_seconds_bucket{job=~"$job",'
            'route!="/metrics"}[$__rate_interval])))')
    assert metric_names(expr) == {"inferd_time_to_first_token_seconds_bucket"}
    assert metric_names('count by (version) (max by (worker, version) (inferd_worker_up{job=~"$job"}) == 1)') == \
        {"inferd_worker_up"}
    assert metric_names("sum(rate(a_total[5m])) / on(x) group_left(y) b offset 5m > bool 0.5e3") == {"a_total", "b"}
    assert metric_names("label_values(inferd_desired_workers, job)") == {"inferd_desired_workers"}


def test_the_dashboard_has_a_dashboards_shape(dashboard):
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    shown = [p for p in panels(dashboard) if p["type"] != "row"]
    assert shown and {p["type"] for p in shown} <= {"timeseries", "stat"}
    for p in shown:
        assert p["title"] and p["targets"], p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == p["datasource"], p["title"]
            assert expr_balanced(t["expr"]), (p["title"], t["expr"])


def expr_balanced(expr: str) -> bool:
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', "", expr):
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            if depth[closing[ch]] < 0:
                return False
    return not any(depth.values())


def exported_names(text: str) -> set[str]:
    """The series names a /metrics page has, or will have once observed: each sample's name, and the names a
    `# TYPE` line announces (a labelled family with no sample yet prints only its HELP and TYPE lines): a counter's
    NAME and NAME_total, a histogram's or summary's _bucket/_sum/_count."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind == "counter":
                names.add(name if name.endswith("_total") else name + "_total")
            elif kind in ("histogram", "gaugehistogram"):
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            elif kind == "summary":
                names |= {name + "_sum", name + "_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def test_every_metric_the_dashboard_reads_is_exported(dashboard, tiny_server):
    used = set().union(*(metric_names(e) for e in expressions(dashboard)))
    assert len(used) >= 20 and all(name.startswith("inferd_") for name in used), sorted(used)
    # the engine's gauges appear with the worker's first heartbeat (0.1 s here): wait for them, a few seconds at most
    deadline = time.monotonic() + 30
    while True:
        exported = exported_names(httpx.get(tiny_server.url + "/metrics", timeout=10).text)
        missing = used - exported
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, f"the dashboard reads metrics the server does not export: {sorted(missing)}"


def sampled_names(text: str) -> set[str]:
    """The series names a /metrics page has a sample of (a labelled family announced by its TYPE line alone is not
    one: a panel or an absent() alert over it sees nothing)."""
    return {re.split(r"[{\s]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_series_the_dashboard_reads_has_a_sample_before_any_request(dashboard, tiny_server):
    """On a server that has served no generation (this module alone starts the session's tiny_server fresh), every
    series the dashboard reads has a sample: labelled ones exported at zero for every known label value (tiers,
    admission outcomes, finish and replay reasons, routes). Per-tenant series are left out: tenants come from a keys
    file, which tiny_server has none of (tests/gateway/test_tenant_metrics.py checks an idle tenant's)."""
    used = {name for e in expressions(dashboard) for name in metric_names(e) if not name.startswith("inferd_tenant_")}
    assert {"inferd_gateway_admissions_total", "inferd_queue_requests", "inferd_replays_total"} <= used
    # the workers' and engine's series appear with the worker's first heartbeat (0.1 s here)
    deadline = time.monotonic() + 30
    while True:
        missing = used - sampled_names(tiny_server_metrics_text(tiny_server))
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, f"series the dashboard reads with no sample on an idle server: {sorted(missing)}"


def tiny_server_metrics_text(server) -> str:
    headers = {"Authorization": f"Bearer {server.metrics_key}"} if server.metrics_key else None
    return httpx.get(server.url + "/metrics", headers=headers, timeout=10).text


def test_the_dashboard_covers_the_operators_questions(dashboard):
    """The series the issue asks for are on it (a panel removed by mistake fails here)."""
    used = set().union(*(metric_names(e) for e in expressions(dashboard)))
    wanted = {"inferd_queue_requests", "inferd_queue_tokens", "inferd_worker_requests_running",
              "inferd_worker_kv_usage", "inferd_time_to_first_token_seconds_bucket",
              "inferd_time_per_output_token_seconds_bucket", "inferd_e2e_request_latency_seconds_bucket",
              "inferd_prompt_tokens_total", "inferd_generation_tokens_total", "inferd_gateway_admissions_total",
              "inferd_tenant_tokens_total", "inferd_worker_up", "inferd_desired_workers",
              "inferd_embedding_requests_total"}
    assert not wanted - used, sorted(wanted - used)
