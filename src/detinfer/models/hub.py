"""`resolve_model_path`: the one place a model argument becomes a local HF-format directory.

A model is named either by a directory (used as is) or by a Hugging Face hub id ("Qwen/Qwen3-0.6B"). A hub
id resolves through the optional `huggingface_hub` package, as with `transformers` and vLLM: its cache if
the snapshot is there, else a download of only the files detinfer reads (config, safetensors weights,
tokenizer). With HF_HUB_OFFLINE=1, or when the hub cannot be reached, only the cache is used; HF_HUB_CACHE /
HF_HOME choose the cache, and a token (HF_TOKEN, `hf auth login`) is picked up by huggingface_hub itself.
Every entry point that takes a model (LLMEngine, and through it LLM and the CLIs) calls this.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What the loader and tokenizer read (detinfer.models.loader, detinfer.models.tokenizer); nothing else is
# downloaded (no .bin / .pth / .gguf duplicates of the weights).
HUB_FILE_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
)
# "name" or "owner/name": letters, digits, '-', '_', '.'; no "--" or ".." (the hub's own rules), <= 96 chars.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def looks_like_hub_id(model: str) -> bool:
    return (isinstance(model, str) and len(model) <= 96 and bool(_HUB_ID.match(model))
            and "--" not in model and ".." not in model and not model.endswith("."))


def resolve_model_path(model: str | os.PathLike, revision: str | None = None) -> Path:
    """A local model directory for `model`: an existing directory, or a hub id resolved through the
    huggingface_hub cache (downloading if allowed). `revision`: a hub branch, tag or commit (hub ids only).

    Raises FileNotFoundError, saying why, when `model` is neither an existing directory nor a hub id that
    resolves (not cached and offline, unknown or gated repository, huggingface_hub not installed)."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a directory path or a Hugging Face hub id, got {type(model).__name__}")
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to hub ids; {path} is a local directory")
        return path
    if path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist ({path} is a file; a model is a "
                                "HF-format directory or a Hugging Face hub id)")
    if isinstance(model, os.PathLike) or not looks_like_hub_id(model):
        raise FileNotFoundError(f"model directory {path} does not exist (and {str(model)!r} is not a "
                                "Hugging Face hub id of the form 'owner/name')")
    return _snapshot(model, revision)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    try:
        import huggingface_hub
    except ImportError as e:
        # A FileNotFoundError (the model is not found as given), so callers report it like a missing directory.
        raise FileNotFoundError(f"model directory {repo_id} does not exist; loading {repo_id!r} as a Hugging "
                                "Face hub id needs the huggingface_hub package: pip install 'detinfer[hub]'") from e
    try:
        local = huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                  allow_patterns=list(HUB_FILE_PATTERNS))
    except (OSError, ValueError) as e:
        # huggingface_hub's errors derive from these: LocalEntryNotFoundError (not cached and offline or
        # unreachable), RepositoryNotFoundError / gated (HTTP errors), HFValidationError (a malformed id).
        raise FileNotFoundError(f"model {repo_id!r}: no such local directory, and as a Hugging Face hub id it "
                                f"could not be resolved ({type(e).__name__}: {_first_line(e)})") from e
    path = Path(local)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"hub model {repo_id!r} (snapshot {path}) has no config.json; detinfer loads "
                                "HF-format checkpoints (config.json + *.safetensors)")
    return path


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"
