"""inferd.engine and inferd.models must run on a GPU image that has only PyTorch and transformers."""

from __future__ import annotations

import subprocess
import sys


def test_engine_and_models_import_no_web_stack():
    code = ("import sys, inferd.engine, inferd.models.build, inferd.models.loader, inferd.models.tokenizer; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'fastapi', 'pydantic', 'starlette', 'uvicorn', 'httpx', 'redis', 'prometheus_client'}); "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"


def test_the_api_process_modules_import_no_torch():
    """The API process's modules (and `inferd`'s parsers) import without torch: importing it costs ~1.3 s of every
    server start before the worker is even spawned. (Loading a tokenizer through transformers imports it later,
    on a thread, beside the worker's start.)"""
    code = ("import sys, inferd.api.app, inferd.api.server, inferd.cluster.pool, inferd.cluster.remote, "
            "inferd.gateway.admission, inferd.models.tokenizer, inferd.bench.profile, inferd.engine.request; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
