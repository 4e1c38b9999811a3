"""The free-form `grammar` kind of structured outputs turned off, through real `inferd serve` processes (echo workers:
the refusal is the API's, before the request is admitted): server-wide with --no-grammar (400 grammar_disabled), per
tenant with allow_grammar: false in the keys file (403 grammar_not_allowed), on both endpoints, under every name the
kind has (structured_outputs.grammar, guided_grammar), in the Batch API too; the other kinds stay allowed."""

from __future__ import annotations

import json
import time

import pytest
from gw import bearer, completion, make_keys

pytestmark = pytest.mark.timeout(240)

GRAMMAR = 'root ::= "yes" | "no"'


def chat(server, key: str | None, **extra):
    import httpx

    body = {"model": server.model, "messages": [{"role": "user", "content": "Well?"}], "max_tokens": 4, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=bearer(key) if key else {}, timeout=60)


def assert_refused(r, status: int, code: str, param: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    assert error["type"] == ("permission_error" if status == 403 else "invalid_request_error")
    assert "grammar" in error["message"]


def test_no_grammar_refuses_the_kind_server_wide(serve):
    import httpx

    server = serve("--no-grammar", name="no-grammar")
    post = lambda **extra: httpx.post(server.url + "/v1/completions",  # noqa: E731
                                      json={"model": server.model, "prompt": "a b c", "max_tokens": 4, **extra},
                                      timeout=60)
    assert_refused(post(structured_outputs={"grammar": GRAMMAR}), 400, "grammar_disabled", "structured_outputs")
    assert_refused(post(guided_grammar=GRAMMAR), 400, "grammar_disabled", "guided_grammar")
    assert_refused(chat(server, None, structured_outputs={"grammar": GRAMMAR}), 400, "grammar_disabled",
                   "structured_outputs")
    # refused before it is parsed: an invalid grammar gets the same answer, not invalid_structured_output
    assert_refused(post(structured_outputs={"grammar": "root ::= "}), 400, "grammar_disabled", "structured_outputs")
    for allowed in ({"structured_outputs": {"regex": "[a-z]+"}}, {"structured_outputs": {"choice": ["a", "b"]}},
                    {"response_format": {"type": "json_object"}}, {}):
        r = post(**allowed)
        assert r.status_code == 200, (allowed, r.text)


def test_a_tenant_without_allow_grammar_is_refused_the_kind(serve, tmp_path):
    import httpx

    path = tmp_path / "keys.json"
    keys = make_keys(path, {"locked": {"allow_grammar": False}, "open": {}})
    assert '"allow_grammar": false' in path.read_text()  # stored in the keys file, only where it is off
    server = serve("--keys", str(path), "--state-dir", str(tmp_path / "state"), name="tenant-grammar")
    locked, open_ = keys["locked"], keys["open"]
    r = completion(server, locked, "a b c", 4, structured_outputs={"grammar": GRAMMAR})
    assert_refused(r, 403, "grammar_not_allowed", "structured_outputs")
    assert_refused(completion(server, locked, "a b c", 4, guided_grammar=GRAMMAR), 403, "grammar_not_allowed",
                   "guided_grammar")
    assert_refused(chat(server, locked, structured_outputs={"grammar": GRAMMAR}), 403, "grammar_not_allowed",
                   "structured_outputs")
    r = completion(server, locked, "a b c", 4, structured_outputs={"json": {"type": "object"}})
    assert r.status_code == 200, r.text  # the other kinds stay
    r = completion(server, open_, "a b c", 4, structured_outputs={"grammar": GRAMMAR})
    assert r.status_code == 200, r.text  # another tenant keeps it
    # the Batch API's lines are the tenant's requests too
    line = json.dumps({"custom_id": "g", "method": "POST", "url": "/v1/completions",
                       "body": {"model": server.model, "prompt": "a", "max_tokens": 2,
                                "structured_outputs": {"grammar": 'root ::= "x"'}}}) + "\n"
    files = httpx.post(server.url + "/v1/files", headers=bearer(locked), files={"file": ("in.jsonl", line)},
                       data={"purpose": "batch"}, timeout=60)
    assert files.status_code == 200, files.text
    batch = httpx.post(server.url + "/v1/batches", headers=bearer(locked), timeout=60,
                       json={"input_file_id": files.json()["id"], "endpoint": "/v1/completions",
                             "completion_window": "24h"}).json()
    deadline = time.monotonic() + 60
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = httpx.get(server.url + f"/v1/batches/{batch['id']}", headers=bearer(locked), timeout=60).json()
    assert batch["status"] == "completed", batch
    errors = httpx.get(server.url + f"/v1/files/{batch['error_file_id']}/content", headers=bearer(locked),
                       timeout=60).text
    [result] = [json.loads(line) for line in errors.splitlines()]
    assert result["response"]["status_code"] == 403
    assert result["response"]["body"]["error"]["code"] == "grammar_not_allowed"
