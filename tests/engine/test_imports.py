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
