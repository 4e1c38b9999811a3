"""The Batch API's store: `/v1/files` and `/v1/batches` as OpenAI defines them, durable. The runner that runs the
lines is batch_runner.py, the validation of an input file batch_input.py, how one line runs batch_lines.py, the
routes routes/files.py and routes/batches.py.

State lives in SQLite (`STATE_DIR/batches.sqlite3`, WAL) and files on disk (`STATE_DIR/files/`): a batch's lines
are stored at validation, each line's result is recorded once (an UPDATE guarded by the line still being pending),
and a server killed at any point resumes where it was when it starts again: a line that was running at the crash runs
again, a batch that was finalizing is finalized again, so every custom_id appears exactly once in the output or the
error file. A finished batch's lines are deleted with the transaction that finishes it (its output and error files
hold them), a deleted file takes what is stored for it, a finished batch and its output go after the retention
period, and the database gives the freed pages back to the filesystem (incremental auto_vacuum, the WAL truncated
after each big delete). Everything is the server's owner's alone: the folders 0700, the files 0600.

Owners are tenant identities (Tenant.identity: "key:NAME" or "builtin:NAME"), never bare names, so that a keys-file
tenant can never be mistaken for a built-in one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import MAX_ACTIVE_BATCHES_PER_TENANT, MAX_BATCH_WINDOW_S
from .errors import APIError, invalid

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINISHED = ("completed", "failed", "expired", "cancelled")
_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
DB_NAME = "batches.sqlite3"
STORE_CHUNK_BYTES = 4 << 20  # a validated file's lines are written this much per transaction ...
DELETE_CHUNK_LINES = 500  # ... and a finished batch's deleted this many at a time: the WAL holds a transaction whole
WAL_LIMIT_BYTES = 64 << 20  # the WAL is cut back to this after a checkpoint (a big batch's lines can make it large)
SCHEMA_VERSION = 1  # PRAGMA user_version: 1 = tenants stored as identities ("key:NAME", "builtin:NAME")

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
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant);
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
    """SQLite and the files folder. Every method is synchronous (a lock around one connection) and the API process
    calls them in a thread (asyncio.to_thread): none runs on the event loop.

    storage_quota: the bytes of files (uploads and outputs) one tenant may keep; an upload past it is refused (an
    output file is always written: its batch ran). The lines of a running batch are held in the database on top of
    that, until the batch finishes."""

    def __init__(self, state_dir: str | os.PathLike, storage_quota: int | None = None):
        self.dir = Path(state_dir)
        self.files_dir = self.dir / "files"
        self.storage_quota = storage_quota
        private_dir(self.dir)
        private_dir(self.files_dir)
        db_path = self.dir / DB_NAME
        for suffix in ("", "-wal", "-shm"):  # SQLite gives the -wal and -shm it creates the database's mode
            private_file(Path(f"{db_path}{suffix}"), create=not suffix)
        self._db = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        fresh = not self._db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone()
        if fresh or self._db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
            # pages freed by deletes go back to the filesystem (PRAGMA incremental_vacuum); a database made before
            # takes the setting with one VACUUM
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            if not fresh:
                self._db.execute("VACUUM")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        self._db.execute("PRAGMA secure_delete=ON")  # a deleted tenant's data is zeroed, not left in free pages
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._migrate()
        self._drop_orphans()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, args: tuple = ()) -> list[dict]:
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

    def _migrate(self) -> None:
        """Databases written before tenants were stored as identities held bare names; those of the built-in
        tenants ("anonymous", "default", the only ones a keys file could not have meant) become theirs."""
        def upgrade(db):
            if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
                return
            for table in ("files", "batches"):
                db.execute(f"UPDATE {table} SET tenant = CASE WHEN tenant IN ('anonymous', 'default') "
                           f"THEN 'builtin:' || tenant ELSE 'key:' || tenant END")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

        self._tx(upgrade)

    def _drop_orphans(self) -> None:
        """Files on disk that no row names (a crash between writing an output file and recording it, or in the middle
        of an upload), and the lines of batches that finished or are gone (a database written before lines were
        deleted with their batch)."""
        known = {r["id"] for r in self._q("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)
            else:
                private_file(path)
        marks = ", ".join("?" * len(ACTIVE))
        for row in self._q(f"SELECT DISTINCT batch_id FROM lines WHERE batch_id NOT IN (SELECT id FROM batches "
                           f"WHERE status IN ({marks}))", ACTIVE):
            self.drop_lines(row["batch_id"])
        self.reclaim()

    def drop_lines(self, batch_id: str) -> None:
        """Deletes a batch's lines, DELETE_CHUNK_LINES per transaction with a checkpoint after each: secure_delete
        writes every freed page, and one transaction would put the whole batch through the WAL."""
        while True:
            gone = self._tx(lambda db: db.execute(
                "DELETE FROM lines WHERE batch_id = ? AND line_no IN (SELECT line_no FROM lines WHERE batch_id = ? "
                "ORDER BY line_no LIMIT ?)", (batch_id, batch_id, DELETE_CHUNK_LINES)).rowcount)
            with self._lock:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            if gone < DELETE_CHUNK_LINES:
                return

    def reclaim(self) -> None:
        """Gives the pages that deletes freed back to the filesystem, and truncates the WAL (a big batch's lines or
        their deletion pass through it whole)."""
        with self._lock:
            self._db.executescript("PRAGMA incremental_vacuum;")  # a script: stepped to the end (execute frees a page)
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    # ---- files ----------------------------------------------------------------------------------------------
    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, tenant: str, purpose: str, filename: str, source_path: Path) -> dict:
        """Moves source_path (a complete file in the state dir's filesystem) in as a new file: a 429
        storage_quota_exceeded when the tenant's files would be over the quota with it."""
        file_id = "file-" + secrets.token_hex(12)
        size = source_path.stat().st_size
        row = {"id": file_id, "tenant": tenant, "purpose": purpose, "filename": filename, "bytes": size,
               "created_at": _now()}

        def insert(db):
            if self.storage_quota is not None:
                used = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?",
                                  (tenant,)).fetchone()[0]
                if used + size > self.storage_quota:
                    raise quota_exceeded(self.storage_quota, used, size)
            os.replace(source_path, self.path(file_id))
            db.execute("INSERT INTO files VALUES (:id, :tenant, :purpose, :filename, :bytes, :created_at)", row)

        try:
            self._tx(insert)
        except BaseException:
            self.path(file_id).unlink(missing_ok=True)
            raise
        return row

    def count_files(self, tenant: str) -> int:
        return self._q("SELECT COUNT(*) AS n FROM files WHERE tenant = ?", (tenant,))[0]["n"]

    def storage_used(self, tenant: str) -> int:
        return self._q("SELECT COALESCE(SUM(bytes), 0) AS n FROM files WHERE tenant = ?", (tenant,))[0]["n"]

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
        """The file, its bytes on disk and the lines of the batches it was the input of (none while one runs: the
        input of a running batch cannot be deleted)."""
        self.get_file(tenant, file_id)
        marks = ", ".join("?" * len(ACTIVE))

        def delete(db):
            busy = db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({marks})",
                              (file_id, *ACTIVE)).fetchone()
            if busy:
                raise invalid(f"the file is the input of batch {busy[0]}, which is still running", param="file_id")
            db.execute("DELETE FROM lines WHERE batch_id IN (SELECT id FROM batches WHERE input_file_id = ?)",
                       (file_id,))
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))

        self._tx(delete)
        self.path(file_id).unlink(missing_ok=True)
        self.reclaim()

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
            if cur.rowcount == 1 and status in FINISHED:
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            return cur.rowcount == 1

        return self._tx(update)

    def store_lines(self, batch_id: str, lines: list[tuple[int, str, str]]) -> bool:
        """The validated lines (line number, custom_id, body JSON), and in_progress; False if the batch left
        validating meanwhile (cancelled). Written a few megabytes per transaction, so that the WAL (which holds a
        transaction whole) stays small; a crash in between leaves the batch validating, validated again at start."""
        def still_validating(db) -> bool:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            return row is not None and row[0] == "validating"

        def clear(db):
            if still_validating(db):
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))  # a validation cut short by a crash
                return True
            return False

        def insert(chunk):
            def run(db):
                if not still_validating(db):
                    return False
                db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, 'pending', NULL)",
                               [(batch_id, n, cid, body) for n, cid, body in chunk])
                return True
            return run

        def start(db):
            if not still_validating(db):
                return False
            db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ? WHERE id = ?",
                       (_now(), len(lines), batch_id))
            return True

        if not self._tx(clear):
            return False
        chunk, size = [], 0
        for item in lines:
            chunk.append(item)
            size += len(item[2])
            if size >= STORE_CHUNK_BYTES:
                if not self._tx(insert(chunk)):
                    return False
                chunk, size = [], 0
        if chunk and not self._tx(insert(chunk)):
            return False
        return self._tx(start)

    def pending_lines(self, batch_id: str, exclude: set[int], limit: int) -> list[dict]:
        """Up to limit pending lines not in exclude, first in the file first (only those are read whole: a body can
        be as large as an HTTP request's)."""
        query = "SELECT line_no FROM lines WHERE batch_id = ? AND status = 'pending' ORDER BY line_no LIMIT ?"
        numbers = [r["line_no"] for r in self._q(query, (batch_id, limit + len(exclude)))]
        chosen = [n for n in numbers if n not in exclude][:limit]
        if not chosen:
            return []
        marks = ", ".join("?" * len(chosen))
        return self._q(f"SELECT line_no, custom_id, body FROM lines WHERE batch_id = ? AND line_no IN ({marks}) "
                       f"ORDER BY line_no", (batch_id, *chosen))

    def with_pending(self, batch_ids: list[str]) -> set[str]:
        """Those of the batches that have a line still to run."""
        return {b for b in batch_ids if self._q("SELECT 1 FROM lines WHERE batch_id = ? AND status = 'pending' "
                                                "LIMIT 1", (b,))}

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

    def finalize(self, batch: dict, final_status: str, unfinished_code: str | None,
                 errors: list[dict] | None = None) -> None:
        """Writes the output and error files (lines in input order; lines never run: an error with
        unfinished_code, for an expired or cancelled batch or one whose tenant is gone), moves the batch to
        final_status (with the batch's errors, if given) in one transaction, then deletes its lines. Idempotent: a
        crash before that transaction leaves the batch as it was (its files orphans, dropped at start)."""
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
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(file_id))
            made[key] = {"id": file_id, "tenant": batch["tenant"], "purpose": "batch_output",
                         "filename": f"{batch_id}_{suffix}.jsonl", "bytes": self.path(file_id).stat().st_size,
                         "created_at": _now()}
        unrun = sum(1 for r in rows if r["status"] == "pending") if unfinished_code else 0
        del rows, out_lines, err_lines
        stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at",
                 "failed": "failed_at"}[final_status]

        def commit(db):
            if db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()[0] in FINISHED:
                return False
            for f in made.values():
                db.execute("INSERT INTO files VALUES (:id, :tenant, :purpose, :filename, :bytes, :created_at)", f)
            db.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, error_file_id = ?, "
                       f"failed = failed + ?, errors = COALESCE(?, errors) WHERE id = ?",
                       (final_status, _now(), made.get("output_file_id", {}).get("id"),
                        made.get("error_file_id", {}).get("id"), unrun, json.dumps(errors) if errors else None,
                        batch_id))
            return True

        if not self._tx(commit):
            for f in made.values():
                self.path(f["id"]).unlink(missing_ok=True)
        self.drop_lines(batch_id)  # the output and error files hold them now (after a crash here: dropped at start)
        self.reclaim()

    def sweep(self, retention_s: float, now: float | None = None) -> int:
        """Deletes the batches that finished more than retention_s ago, with their output and error files (their
        input, the tenant's upload, stays until the tenant deletes it). Returns how many went."""
        cutoff = (time.time() if now is None else now) - retention_s
        marks = ", ".join("?" * len(FINISHED))

        def delete(db):
            old = db.execute(f"SELECT id, output_file_id, error_file_id FROM batches WHERE status IN ({marks}) AND "
                             f"COALESCE(completed_at, failed_at, expired_at, cancelled_at) <= ?",
                             (*FINISHED, cutoff)).fetchall()
            files = [f for _, out, err in old for f in (out, err) if f]
            for batch_id, _, _ in old:
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
                db.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
            for file_id in files:
                db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            return len(old), files

        count, files = self._tx(delete)
        for file_id in files:
            self.path(file_id).unlink(missing_ok=True)
        if count:
            self.reclaim()
        return count


def private_dir(path: Path) -> None:
    """A folder only the server's user may enter (made so, or set so if it was there)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def private_file(path: Path, create: bool = False) -> None:
    """A file only the server's user may read (made so when create, or set so if it was there)."""
    if create:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    try:
        os.chmod(path, 0o600)
    except FileNotFoundError:
        pass


def quota_exceeded(quota: int, used: int, size: int) -> APIError:
    return APIError(429, f"this tenant's files take {used} bytes and the upload {size} more: over its storage quota "
                    f"of {quota} bytes (--batch-storage-per-tenant); delete files first", "insufficient_quota",
                    param="file", code="storage_quota_exceeded")


_UNFINISHED = {"batch_expired": "This request could not be executed before the completion window expired.",
               "batch_cancelled": "This request was not executed: the batch was cancelled.",
               "tenant_gone": "This request was not executed: the batch's tenant no longer exists on this server."}


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
