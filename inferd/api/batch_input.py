"""A Batch API input file's validation: each line alone, so that whatever one line holds (JSON nested past the
parser's recursion limit, a lone surrogate, a line of hundreds of megabytes) is that line's error and nothing more.
It runs in a thread (the runner calls it through asyncio.to_thread), reads the file a bounded chunk at a time, and
never holds more than one line of up to max_line_bytes (the server's --max-body-bytes, the limit an HTTP request's
body has) beside the validated lines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ..config import MAX_BATCH_LINES

MAX_ERRORS = 100  # the validation errors a batch reports: the first hundred say enough
_CHUNK = 1 << 20


def read_lines(f: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, the line without its newline, or None when it is over max_line_bytes: its bytes are
    skipped, never held)."""
    n = 0
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        n += 1
        if raw.endswith(b"\n"):
            yield n, raw[:-1]
        elif len(raw) <= max_line_bytes:  # the last line, without a newline
            yield n, raw
        else:  # over the limit: skip to the end of the line
            del raw
            while (chunk := f.readline(_CHUNK)) and not chunk.endswith(b"\n"):
                pass
            yield n, None


def parse_line(raw: bytes, n: int, endpoint: str) -> tuple[str, str]:
    """(custom_id, the body as JSON text) of one input line, or LineInvalid(code, message, param)."""
    try:
        item = json.loads(raw)
    except RecursionError:
        raise LineInvalid("invalid_json_line", f"line {n} is nested too deeply to parse") from None
    except ValueError as e:  # bad JSON, bad UTF-8
        raise LineInvalid("invalid_json_line", f"line {n} is not valid JSON: {e}") from None
    if not isinstance(item, dict):
        raise LineInvalid("invalid_request", f"line {n} must be a JSON object")
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > 512:
        raise LineInvalid("missing_required_parameter", f"line {n} needs a custom_id (a string of 1-512 "
                          "characters)", "custom_id")
    if item.get("method") != "POST":
        raise LineInvalid("invalid_method", f"line {n}: method must be POST", "method")
    if item.get("url") != endpoint:
        raise LineInvalid("mismatched_url", f"line {n}: url {_shown(item.get('url'))} is not the batch's endpoint "
                          f"{endpoint}", "url")
    if not isinstance(item.get("body"), dict):
        raise LineInvalid("invalid_request", f"line {n}: body must be a JSON object", "body")
    extra = set(item) - {"custom_id", "method", "url", "body"}
    if extra:
        raise LineInvalid("invalid_request", f"line {n}: unknown field(s) {', '.join(sorted(extra))}")
    try:
        body = json.dumps(item["body"], ensure_ascii=False)
    except RecursionError:
        raise LineInvalid("invalid_request", f"line {n}: body is nested too deeply", "body") from None
    try:  # JSON's \\ud800 escapes decode to lone surrogates, which are no Unicode text (nor storable as UTF-8)
        cid.encode("utf-8")
        body.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LineInvalid("invalid_unicode", f"line {n} holds a lone surrogate ({e.object[e.start:e.end]!a}): "
                          "not valid Unicode text") from None
    return cid, body


def _shown(value) -> str:
    """A client's value in an error message: ASCII (no lone surrogate reaches a response) and short."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."


class LineInvalid(Exception):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def parse_input(path: Path, endpoint: str, max_line_bytes: int
                ) -> tuple[list[tuple[int, str, str]], list[dict], int]:
    """(lines, errors, refused) of an input file: each line a JSON object {custom_id, method: POST, url: the batch's
    endpoint, body: an object} of at most max_line_bytes, custom_ids unique, at most MAX_BATCH_LINES. errors: OpenAI's
    batch error objects, each naming its line (1-based), the first MAX_ERRORS; refused: how many lines were bad.
    Blank lines are skipped. Raises only OSError (the file itself unreadable)."""
    lines, errors, seen = [], [], set()
    refused = 0

    def err(n: int | None, code: str, message: str, param: str | None = None) -> None:
        nonlocal refused
        refused += 1
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": n})

    with open(path, "rb") as f:
        for n, raw in read_lines(f, max_line_bytes):
            if raw is None:
                err(n, "request_too_large", f"line {n} is over the {max_line_bytes}-byte limit of a request "
                    "(--max-body-bytes)")
                continue
            if not raw.strip():
                continue
            if len(lines) >= MAX_BATCH_LINES:
                err(n, "too_many_lines", f"the file has more than {MAX_BATCH_LINES} requests (MAX_BATCH_LINES)")
                break
            try:
                cid, body = parse_line(raw, n, endpoint)
            except LineInvalid as e:
                err(n, e.code, e.message, e.param)
                continue
            except Exception as e:  # a line is never more than its own error, whatever it holds
                err(n, "invalid_request", f"line {n} could not be read: {type(e).__name__}")
                continue
            if cid in seen:
                err(n, "duplicate_custom_id", f"line {n}: the custom_id {_shown(cid)} is used by an earlier line",
                    "custom_id")
                continue
            seen.add(cid)
            lines.append((n, cid, body))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None,
                       "line": None})
    return lines, errors, refused
