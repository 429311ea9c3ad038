"""Which model's KV this is: an identity two engines must share to exchange KV.

Two checkpoints of the same shape (a base model and its fine-tune) have the
same KV geometry; reading one's KV into the other silently gives wrong
answers. ``model_identity`` is a SHA-256 over

- the model's configuration (vLLM's ``hf_config`` as JSON), and
- a fingerprint of the weight files: per file (sorted by name) its name and
  size, its first 64 KiB (a safetensors file's header: every tensor's name,
  dtype, shape and offsets) and 16 samples of 4 KiB spread over the rest. A
  fine-tune changes nearly every tensor, so nearly every sample; reading ~130
  KiB per file keeps this to milliseconds at engine start however big the
  model is.

A model that is not a local directory (a hub id vLLM resolved itself) is
identified by its name and revision instead of its bytes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

ENGINE_EPOCH_ENV = "PDSERVE_ENGINE_EPOCH"
"""One start of an engine: set by the engine actor before vLLM starts, so that its scheduler and every worker
process agree; a process started without it draws its own."""


def engine_epoch() -> str:
    """This start of the engine (hex): signed into the KV parameters it issues and answered in its handshakes and
    pins, so a reader never reads through a mapping of another start of the same engine id and port."""
    return os.environ.setdefault(ENGINE_EPOCH_ENV, secrets.token_hex(8))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
HEAD_BYTES = 64 * 1024
SAMPLES = 16
SAMPLE_BYTES = 4096


def weights_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """SHA-256 hex of the weight files' names, sizes, heads and samples (see the module's docstring)."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(HEAD_BYTES))
            if size > HEAD_BYTES:
                span = size - HEAD_BYTES
                for i in range(SAMPLES):
                    f.seek(HEAD_BYTES + span * i // SAMPLES)
                    digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def model_identity(model: str, config_json: str, revision: str | None = None) -> str:
    """The identity of ``model`` (a directory or a hub id) whose configuration is ``config_json``."""
    digest = hashlib.sha256(config_json.encode())
    if Path(model).is_dir():
        digest.update(b"weights\0" + weights_fingerprint(model).encode())
    else:
        digest.update(f"hub\0{model}\0{revision or ''}".encode())
    return digest.hexdigest()


def peer_name(engine_id: str, tp_rank: int) -> str:
    """The name of an engine's rank (a reader's name in pins, releases and READ notifications)."""
    return f"{engine_id}/rank{tp_rank}"


def mapping_name(engine_id: str, tp_rank: int, epoch: str) -> str:
    """The transport's name of one start of a remote rank: a mapping of another start is never used."""
    return f"{peer_name(engine_id, tp_rank)}@{epoch}" if epoch else peer_name(engine_id, tp_rank)
