"""The Batch API: `/v1/files` and `/v1/batches` as OpenAI defines them, durable, run through the gateway in the
batch tier.

State lives in SQLite (`STATE_DIR/batches.sqlite3`, WAL) and files on disk (`STATE_DIR/files/`): a batch's lines
are stored at validation, each line's result is recorded once (an UPDATE guarded by the line still being pending),
and a server killed at any point resumes where it was when it starts again: a line that was running at the crash runs
again, a batch that was finalizing is finalized again, so every custom_id appears exactly once in the output or the
error file.

The runner sends pending lines through the same admission as HTTP requests (the batch owner's quota, fair sharing,
the waiting line) in the `batch` tier, so interactive traffic goes first and preempts them on the workers; how many
lines it keeps in flight adapts to what the service takes: +1 after a served line, halved when the gateway answers
"busy" (503, 429), between 1 and `--batch-concurrency`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import (BATCH_BUSY_COOLDOWN_S, BATCH_RETRY_S, BUSY_BATCH_CONCURRENCY, DEFAULT_BATCH_CONCURRENCY, MAX_ACTIVE_BATCHES_PER_TENANT, MAX_BATCH_LINES,
                      MAX_BATCH_WINDOW_S, MAX_FILE_BYTES, MAX_FILES_PER_TENANT)
from .errors import APIError, invalid

log = logging.getLogger("inferd.batches")

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,6})([smh])$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL, errors TEXT, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT,
    error_file_id TEXT, total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    status TEXT NOT NULL, result TEXT, PRIMARY KEY (batch_id, line_no));
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, status);
"""


def window_seconds(window: str) -> int:
    """OpenAI's "24h", or (an inferd extension) any N s/m/h up to MAX_BATCH_WINDOW_S."""
    m = _WINDOW_RE.match(window) if isinstance(window, str) else None
    if m is None:
        raise invalid(f"completion_window must be '24h' (or N followed by s, m or h), got {window!r}",
                      param="completion_window")
    seconds = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds > MAX_BATCH_WINDOW_S:
        raise invalid(f"completion_window is over the limit of {MAX_BATCH_WINDOW_S} s", param="completion_window")
    return seconds


def _now() -> int:
    return int(time.time())


class BatchStore:
    """SQLite and the files folder. Every method is short and synchronous (a lock around one connection); the
    long ones (reading an input file, writing an output file) run in a thread (asyncio.to_thread)."""

    def __init__(self, state_dir: str | os.PathLike):
        self.dir = Path(state_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.dir / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._drop_orphans()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            cur = self._db.execute(sql, args)
            cols = [c[0] for c in cur.description] if cur.description else []
            return [dict(zip(cols, row)) for row in cur.fetchall()]

    def _tx(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return out

    def _drop_orphans(self) -> None:
        """Files on disk that no row names (a crash between writing an output file and recording it)."""
        known = {r["id"] for r in self._q("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    # ---- files ----------------------------------------------------------------------------------------------
    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, tenant: str, purpose: str, filename: str, source_path: Path) -> dict:
        """Moves source_path (a complete file in the state dir's filesystem) in as a new file."""
        file_id = "file-" + secrets.token_hex(12)
        size = source_path.stat().st_size
        os.replace(source_path, self.path(file_id))
        row = {"id": file_id, "tenant": tenant, "purpose": purpose, "filename": filename, "bytes": size,
               "created_at": _now()}
        self._tx(lambda db: db.execute("INSERT INTO files VALUES (:id, :tenant, :purpose, :filename, :bytes, "
                                       ":created_at)", row))
        return row

    def count_files(self, tenant: str) -> int:
        return self._q("SELECT COUNT(*) AS n FROM files WHERE tenant = ?", (tenant,))[0]["n"]

    def get_file(self, tenant: str, file_id: str) -> dict:
        rows = self._q("SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant))
        if not rows:
            raise APIError(404, f"No such File object: {file_id}", "invalid_request_error", param="file_id",
                           code="file_not_found")
        return rows[0]

    def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int) -> tuple[list, bool]:
        rows = self._q("SELECT * FROM files WHERE tenant = ? ORDER BY created_at DESC, id DESC", (tenant,))
        if purpose:
            rows = [r for r in rows if r["purpose"] == purpose]
        return _page(rows, after, limit)

    def delete_file(self, tenant: str, file_id: str) -> None:
        self.get_file(tenant, file_id)
        busy = self._q("SELECT id FROM batches WHERE input_file_id = ? AND status IN (?, ?, ?, ?)",
                       (file_id, *ACTIVE))
        if busy:
            raise invalid(f"the file is the input of batch {busy[0]['id']}, which is still running", param="file_id")
        self._tx(lambda db: db.execute("DELETE FROM files WHERE id = ?", (file_id,)))
        self.path(file_id).unlink(missing_ok=True)

    # ---- batches --------------------------------------------------------------------------------------------
    def create_batch(self, tenant: str, endpoint: str, input_file_id: str, window: str, metadata: dict | None
                     ) -> dict:
        seconds = window_seconds(window)
        now = _now()
        batch_id = "batch_" + secrets.token_hex(12)

        def insert(db):
            active = db.execute("SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN (?, ?, ?, ?)",
                                (tenant, *ACTIVE)).fetchone()[0]
            if active >= MAX_ACTIVE_BATCHES_PER_TENANT:
                raise APIError(429, f"this tenant already has {active} batches running, the limit "
                               f"(MAX_ACTIVE_BATCHES_PER_TENANT) is {MAX_ACTIVE_BATCHES_PER_TENANT}",
                               "rate_limit_exceeded", code="too_many_batches")
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute("INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, metadata, status,"
                       " created_at, expires_at, seq) VALUES (?, ?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
                       (batch_id, tenant, endpoint, input_file_id, window,
                        json.dumps(metadata) if metadata is not None else None, now, now + seconds, seq))

        self._tx(insert)
        return self.get_batch(tenant, batch_id)

    def get_batch(self, tenant: str | None, batch_id: str) -> dict:
        if tenant is None:
            rows = self._q("SELECT * FROM batches WHERE id = ?", (batch_id,))
        else:
            rows = self._q("SELECT * FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant))
        if not rows:
            raise APIError(404, f"No such Batch object: {batch_id}", "invalid_request_error", param="batch_id",
                           code="batch_not_found")
        return rows[0]

    def list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list, bool]:
        rows = self._q("SELECT * FROM batches WHERE tenant = ? ORDER BY seq DESC", (tenant,))
        return _page(rows, after, limit)

    def batches_in(self, *statuses: str) -> list[dict]:
        marks = ", ".join("?" * len(statuses))
        return self._q(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", statuses)

    def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...], **fields: Any) -> bool:
        """status (and its timestamp, and fields) if the batch is in one of only_from; False otherwise."""
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                 "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
                 "cancelled": "cancelled_at"}.get(status)
        values = dict(fields)
        if stamp:
            values[stamp] = _now()
        sets = ", ".join([f"{k} = ?" for k in values] + ["status = ?"])
        marks = ", ".join("?" * len(only_from))

        def update(db):
            cur = db.execute(f"UPDATE batches SET {sets} WHERE id = ? AND status IN ({marks})",
                             (*values.values(), status, batch_id, *only_from))
            return cur.rowcount == 1

        return self._tx(update)

    def store_lines(self, batch_id: str, lines: list[tuple[int, str, str]]) -> bool:
        """The validated lines (line number, custom_id, body JSON), and in_progress; False if the batch left
        validating meanwhile (cancelled)."""
        def insert(db):
            if db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()[0] != "validating":
                return False
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))  # a validation cut short by a crash
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, 'pending', NULL)",
                           [(batch_id, n, cid, body) for n, cid, body in lines])
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ? WHERE id = ?",
                       (_now(), len(lines), batch_id))
            return True

        return self._tx(insert)

    def pending_lines(self, batch_id: str, exclude: set[int], limit: int) -> list[dict]:
        rows = self._q("SELECT line_no, custom_id, body FROM lines WHERE batch_id = ? AND status = 'pending' "
                       "ORDER BY line_no LIMIT ?", (batch_id, limit + len(exclude)))
        return [r for r in rows if r["line_no"] not in exclude][:limit]

    def count_pending(self, batch_id: str) -> int:
        return self._q("SELECT COUNT(*) AS n FROM lines WHERE batch_id = ? AND status = 'pending'",
                       (batch_id,))[0]["n"]

    def record(self, batch_id: str, line_no: int, ok: bool, result: dict) -> bool:
        """A line's result, once: False if it was recorded before (or the batch ended)."""
        def update(db):
            cur = db.execute("UPDATE lines SET status = ?, result = ? WHERE batch_id = ? AND line_no = ? AND "
                             "status = 'pending'", ("ok" if ok else "error", json.dumps(result), batch_id, line_no))
            if cur.rowcount != 1:
                return False
            db.execute(f"UPDATE batches SET {'completed' if ok else 'failed'} = "
                       f"{'completed' if ok else 'failed'} + 1 WHERE id = ?", (batch_id,))
            return True

        return self._tx(update)

    def finalize(self, batch: dict, final_status: str, unfinished_code: str | None) -> None:
        """Writes the output and error files (lines in input order; lines never run: an error with
        unfinished_code, for an expired or cancelled batch) and moves the batch to final_status. Idempotent: a
        crash before the last transaction leaves the batch as it was (its files orphans, dropped at start)."""
        batch_id = batch["id"]
        rows = self._q("SELECT line_no, custom_id, status, result FROM lines WHERE batch_id = ? ORDER BY line_no",
                       (batch_id,))
        out_lines, err_lines = [], []
        for r in rows:
            if r["status"] == "ok":
                out_lines.append(r["result"])
            elif r["status"] == "error":
                err_lines.append(r["result"])
            elif unfinished_code is not None:
                err_lines.append(json.dumps(_line_error(r["custom_id"], unfinished_code,
                                                        _UNFINISHED[unfinished_code])))
        made = {}
        for key, lines, suffix in (("output_file_id", out_lines, "output"), ("error_file_id", err_lines, "error")):
            if not lines:
                continue
            file_id = "file-" + secrets.token_hex(12)
            tmp = self.files_dir / f".{file_id}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(file_id))
            made[key] = {"id": file_id, "tenant": batch["tenant"], "purpose": "batch_output",
                         "filename": f"{batch_id}_{suffix}.jsonl", "bytes": self.path(file_id).stat().st_size,
                         "created_at": _now()}
        unrun = sum(1 for r in rows if r["status"] == "pending") if unfinished_code else 0
        stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[final_status]

        def commit(db):
            if db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()[0] in \
                    ("completed", "expired", "cancelled", "failed"):
                return False
            for f in made.values():
                db.execute("INSERT INTO files VALUES (:id, :tenant, :purpose, :filename, :bytes, :created_at)", f)
            db.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, error_file_id = ?, "
                       f"failed = failed + ? WHERE id = ?",
                       (final_status, _now(), made.get("output_file_id", {}).get("id"),
                        made.get("error_file_id", {}).get("id"), unrun, batch_id))
            if unfinished_code:
                db.execute("UPDATE lines SET status = 'error' WHERE batch_id = ? AND status = 'pending'", (batch_id,))
            return True

        if not self._tx(commit):
            for f in made.values():
                self.path(f["id"]).unlink(missing_ok=True)


_UNFINISHED = {"batch_expired": "This request could not be executed before the completion window expired.",
               "batch_cancelled": "This request was not executed: the batch was cancelled."}


def _line_error(custom_id: str, code: str, message: str) -> dict:
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _page(rows: list[dict], after: str | None, limit: int) -> tuple[list, bool]:
    if after is not None:
        ids = [r["id"] for r in rows]
        rows = rows[ids.index(after) + 1:] if after in ids else []
    return rows[:limit], len(rows) > limit


def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(row: dict) -> dict:
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            "created_at": row["created_at"], "in_progress_at": row["in_progress_at"],
            "expires_at": row["expires_at"], "finalizing_at": row["finalizing_at"],
            "completed_at": row["completed_at"], "failed_at": row["failed_at"], "expired_at": row["expired_at"],
            "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None}


def parse_input(path: Path, endpoint: str) -> tuple[list[tuple[int, str, str]], list[dict]]:
    """(lines, errors) of an input file: each line a JSON object {custom_id, method: POST, url: the batch's
    endpoint, body: an object}, custom_ids unique, at most MAX_BATCH_LINES. errors: OpenAI's batch error objects,
    each naming its line (1-based). Blank lines are skipped."""
    lines, errors, seen = [], [], set()

    def err(n: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < 100:  # the first hundred say enough
            errors.append({"code": code, "message": message, "param": param, "line": n})

    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if len(lines) >= MAX_BATCH_LINES:
                err(n, "too_many_lines", f"the file has more than {MAX_BATCH_LINES} requests (MAX_BATCH_LINES)")
                break
            try:
                item = json.loads(raw)
            except ValueError as e:
                err(n, "invalid_json_line", f"line {n} is not valid JSON: {e}")
                continue
            if not isinstance(item, dict):
                err(n, "invalid_request", f"line {n} must be a JSON object")
                continue
            cid = item.get("custom_id")
            if not isinstance(cid, str) or not cid or len(cid) > 512:
                err(n, "missing_required_parameter", f"line {n} needs a custom_id (a string of 1-512 characters)",
                    "custom_id")
                continue
            if cid in seen:
                err(n, "duplicate_custom_id", f"line {n}: the custom_id {cid!r} is used by an earlier line",
                    "custom_id")
                continue
            seen.add(cid)
            if item.get("method") != "POST":
                err(n, "invalid_method", f"line {n}: method must be POST", "method")
                continue
            if item.get("url") != endpoint:
                err(n, "mismatched_url", f"line {n}: url {item.get('url')!r} is not the batch's endpoint {endpoint}",
                    "url")
                continue
            if not isinstance(item.get("body"), dict):
                err(n, "invalid_request", f"line {n}: body must be a JSON object", "body")
                continue
            extra = set(item) - {"custom_id", "method", "url", "body"}
            if extra:
                err(n, "invalid_request", f"line {n}: unknown field(s) {', '.join(sorted(extra))}")
                continue
            lines.append((n, cid, json.dumps(item["body"], ensure_ascii=False)))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None,
                       "line": None})
    return lines, errors


@dataclass
class LineOutcome:
    status: int  # the HTTP status the request would have had
    body: dict  # the response body, or the error body
    retry: bool = False  # the service was busy (503, 429): run the line again later


class BatchRunner:
    """Runs the pending lines of every in-progress batch, resumes after a restart, finalizes, expires, cancels.

    execute(tenant name, endpoint, body) -> LineOutcome runs one request through the gateway (the API process's
    own path, in the batch tier)."""

    def __init__(self, store: BatchStore, execute, max_concurrency: int = DEFAULT_BATCH_CONCURRENCY,
                 interactive_busy: Callable[[], int] = lambda: 0):
        self.store = store
        self.execute = execute
        # more important work (interactive, standard) running or waiting: lines are then sent one at a time, so that
        # the batch fills the capacity that work leaves idle instead of sharing every step with it
        self.interactive_busy = interactive_busy
        self.max_concurrency = max(1, max_concurrency)
        self.concurrency = min(4, self.max_concurrency)
        self._inflight: dict[tuple[str, int], asyncio.Task] = {}
        self._retry_at: dict[tuple[str, int], float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.lines_done = 0
        self._busy_at = float("-inf")  # when more important work was last seen

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._inflight.values()):
            task.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the batch runner failed a round; trying again")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.25)
            except asyncio.TimeoutError:
                pass

    async def _tick(self) -> None:
        store, now = self.store, time.time()
        for batch in store.batches_in("validating"):
            await self._validate(batch)
        for batch in store.batches_in("cancelling"):
            self._cancel_inflight(batch["id"])
            if not any(k[0] == batch["id"] for k in self._inflight):
                await asyncio.to_thread(store.finalize, batch, "cancelled", "batch_cancelled")
        for batch in store.batches_in("in_progress", "finalizing"):
            if batch["status"] == "in_progress" and now >= batch["expires_at"]:
                self._cancel_inflight(batch["id"])
                if not any(k[0] == batch["id"] for k in self._inflight):
                    await asyncio.to_thread(store.finalize, batch, "expired", "batch_expired")
                continue
            if batch["status"] == "finalizing" or store.count_pending(batch["id"]) == 0:
                if not any(k[0] == batch["id"] for k in self._inflight):
                    store.set_status(batch["id"], "finalizing", ("in_progress",))
                    await asyncio.to_thread(store.finalize, batch, "completed", None)
                continue
            if self.interactive_busy():
                self._busy_at = now
            quiet = now - self._busy_at >= BATCH_BUSY_COOLDOWN_S
            limit = self.concurrency if quiet else min(self.concurrency, BUSY_BATCH_CONCURRENCY)
            room = limit - len(self._inflight)
            if room <= 0:
                continue
            busy = {k[1] for k in self._inflight if k[0] == batch["id"]}
            waiting = {k[1] for k, t in self._retry_at.items() if k[0] == batch["id"] and t > now}
            for line in store.pending_lines(batch["id"], busy | waiting, room):
                key = (batch["id"], line["line_no"])
                self._retry_at.pop(key, None)
                self._inflight[key] = asyncio.get_running_loop().create_task(self._line(batch, line))

    def _cancel_inflight(self, batch_id: str) -> None:
        for key, task in list(self._inflight.items()):
            if key[0] == batch_id:
                task.cancel()

    async def _validate(self, batch: dict) -> None:
        path = self.store.path(batch["input_file_id"])
        if not path.exists():
            self.store.set_status(batch["id"], "failed", ("validating",), errors=json.dumps([
                {"code": "file_not_found", "message": "the input file is gone", "param": "input_file_id",
                 "line": None}]))
            return
        lines, errors = await asyncio.to_thread(parse_input, path, batch["endpoint"])
        if errors:
            self.store.set_status(batch["id"], "failed", ("validating",), errors=json.dumps(errors))
            return
        self.store.store_lines(batch["id"], lines)

    async def _line(self, batch: dict, line: dict) -> None:
        key = (batch["id"], line["line_no"])
        try:
            outcome = await self.execute(batch["tenant"], batch["endpoint"], json.loads(line["body"]))
            if outcome.retry:
                self.concurrency = max(1, self.concurrency // 2)
                self._retry_at[key] = time.time() + BATCH_RETRY_S
                return
            self.concurrency = min(self.max_concurrency, self.concurrency + 1)
            request_id = "batch_req_" + secrets.token_hex(12)
            result = {"id": request_id, "custom_id": line["custom_id"],
                      "response": {"status_code": outcome.status, "request_id": request_id, "body": outcome.body},
                      "error": None}
            self.store.record(batch["id"], line["line_no"], outcome.status == 200, result)
            self.lines_done += 1
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s line %d failed in the runner; it runs again", batch["id"], line["line_no"])
            self._retry_at[key] = time.time() + BATCH_RETRY_S
        finally:
            self._inflight.pop(key, None)
            self._wake.set()
