"""The tokenizer class transformers' AutoTokenizer picks for a model folder, remembered on disk.

Why: `from transformers import AutoTokenizer` imports torch (its config classes do), ~2 s of CPU on a 2-core host,
while the class it picks (for a local folder: from tokenizer_config.json, config.json and the tokenizer files) needs
none: the API process, which never runs the model, would pay it at every start. So the first load of a folder goes
through AutoTokenizer and the class it returned is written down; later loads call that class's from_pretrained, which
is what AutoTokenizer itself ends with. The entry is keyed by the folder's absolute path, the name, size and mtime of
every file in it, and the versions of transformers and tokenizers: any change there goes through AutoTokenizer again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_FORMAT = 1


def _key(folder: str) -> str:
    from importlib.metadata import version

    files = sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                   for entry in os.scandir(folder) if entry.is_file())
    raw = json.dumps([os.path.abspath(folder), files, version("transformers"), version("tokenizers"), _FORMAT])
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:40]


def _entry(cache_root: Path, folder: str) -> Path:
    return cache_root / "tokenizer-classes" / f"{_key(folder)}.json"


def remembered_class(cache_root: Path, folder: str) -> type | None:
    """The class AutoTokenizer picked for `folder` when nothing in it has changed since, else None."""
    try:
        with open(_entry(cache_root, folder), encoding="utf-8") as f:
            entry = json.load(f)
        module, name = entry["module"], entry["name"]
        if not (isinstance(module, str) and module.startswith("transformers.") and isinstance(name, str)):
            return None  # only transformers' own classes are ever written here
        cls = getattr(importlib.import_module(module), name)
        return cls if isinstance(cls, type) else None
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None


def remember_class(cache_root: Path, folder: str, hf: Any) -> None:
    """Writes down the class of `hf` (AutoTokenizer's pick for `folder`), atomically; a failure only costs the next
    start the AutoTokenizer import."""
    cls = type(hf)
    tmp = None
    try:
        target = _entry(cache_root, folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"module": cls.__module__, "name": cls.__qualname__}, f)
        os.replace(tmp, target)
        tmp = None
    except OSError:
        logger.debug("could not remember the tokenizer class of %s", folder, exc_info=True)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
