"""Who sees what of the tenants (inferd/api/middleware/auth.py, telemetry/metrics.py): without --metrics-key,
/metrics and /dashboard/data stay open for the aggregates, but the tenants' names, tiers, quotas and usage need the
metrics or the admin key; the dashboard page runs only its own script and cannot be framed. A real server on an
echo worker."""

from __future__ import annotations

import json

import httpx
import pytest
from gw import bearer, completion, make_keys

ADMIN = "tenant-metrics-admin-key"


@pytest.fixture(scope="module")
def server(serve, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = make_keys(path, {"acme": {"tpm": 100_000, "tier": "interactive"}, "globex": {}, "initech": {}})
    srv = serve("--keys", str(path), "--admin-key", ADMIN)
    for tenant in ("acme", "globex"):  # initech sends nothing
        assert completion(srv, keys[tenant], "hello", 2).status_code == 200
    srv.keys = keys
    return srv


def _metrics(server, headers=None) -> str:
    r = httpx.get(server.url + "/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.text


def _data(server, headers=None) -> dict:
    r = httpx.get(server.url + "/dashboard/data", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_without_a_key_hide_the_tenants(server):
    for headers in (None, bearer(server.keys["acme"])):  # nobody, or a tenant: the aggregates only
        text = _metrics(server, headers)
        assert "inferd_requests_total" in text and "inferd_gateway_admissions_total" in text
        assert "tenant=" not in text and "acme" not in text and "globex" not in text
    text = _metrics(server, bearer(ADMIN))
    assert 'inferd_tenant_tokens_total{tenant="acme"}' in text
    assert 'inferd_tenant_quota{limit="tpm",tenant="acme"}' in text
    assert 'inferd_tenant_tier{tenant="acme",tier="interactive"}' in text


def test_a_tenant_that_sent_nothing_has_its_series_at_zero(server):
    """Every tenant the keys file names is exported from the start (panels and absent() alerts see it idle)."""
    text = _metrics(server, bearer(ADMIN))
    for family in ("inferd_tenant_tokens_total", "inferd_tenant_service_total", "inferd_tenant_open_requests",
                   "inferd_tenant_reserved_tokens"):
        assert f'{family}{{tenant="initech"}} 0.0' in text, family


def test_the_dashboards_data_without_the_metrics_or_admin_key_hides_the_tenants(server):
    for headers in (None, bearer(server.keys["acme"])):  # nobody, or a tenant: no tenant's row, its own included
        open_view = _data(server, headers)
        assert open_view["tenants_visible"] is False
        assert open_view["tenant_tokens_in_quota_window"] == {}
        assert not [k for k in open_view["current"] if "tenant" in k]
        assert "acme" not in json.dumps(open_view) and "globex" not in json.dumps(open_view)
        assert any(k.startswith("inferd_requests_total") for k in open_view["current"])
    keyed = _data(server, bearer(ADMIN))
    assert keyed["tenants_visible"] is True
    assert keyed["tenant_tokens_in_quota_window"]["acme"] > 0
    assert 'inferd_tenant_tier{tenant="globex",tier="standard"}' in keyed["current"]


def test_the_dashboard_page_runs_only_its_own_script_and_cannot_be_framed(server):
    r = httpx.get(server.url + "/dashboard", timeout=10)
    policy = r.headers["content-security-policy"]
    assert "unsafe-inline" not in policy and "frame-ancestors 'none'" in policy
    assert "script-src 'sha256-" in policy and "style-src 'sha256-" in policy
    assert r.headers["x-frame-options"] == "DENY"
