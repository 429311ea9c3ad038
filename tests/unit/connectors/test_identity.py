"""connectors.identity: the model identity in the KV compatibility hash (a fine-tune is another model)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from connectors.identity import model_identity, weights_fingerprint
from connectors.worker import check_servable

CONFIG = json.dumps({"hidden_size": 64, "num_hidden_layers": 2})


def checkpoint(root: Path, name: str, weights: bytes, config: str = CONFIG) -> Path:
    model = root / name
    model.mkdir()
    (model / "config.json").write_text(config)
    (model / "model.safetensors").write_bytes(weights)
    return model


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return checkpoint(tmp_path, "base", bytes(range(256)) * 4096)  # 1 MiB


def test_the_same_checkpoint_in_two_places_is_one_model(base: Path, tmp_path: Path) -> None:
    copy = checkpoint(tmp_path, "copy", (base / "model.safetensors").read_bytes())
    assert model_identity(str(base), CONFIG) == model_identity(str(copy), CONFIG)


def test_a_fine_tune_of_the_same_shape_is_another_model(base: Path, tmp_path: Path) -> None:
    weights = bytearray((base / "model.safetensors").read_bytes())
    for offset in range(70_000, len(weights), 1000):  # most tensors moved a little; header untouched
        weights[offset] ^= 1
    tuned = checkpoint(tmp_path, "tuned", bytes(weights))
    assert weights_fingerprint(base) != weights_fingerprint(tuned)
    assert model_identity(str(base), CONFIG) != model_identity(str(tuned), CONFIG)


def test_another_configuration_is_another_model(base: Path) -> None:
    other = json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "rope_theta": 1e6})
    assert model_identity(str(base), CONFIG) != model_identity(str(base), other)


def test_a_hub_model_is_identified_by_name_and_revision() -> None:
    assert model_identity("org/model", CONFIG, "abc") == model_identity("org/model", CONFIG, "abc")
    assert model_identity("org/model", CONFIG, "abc") != model_identity("org/model", CONFIG, "def")
    assert model_identity("org/model", CONFIG) != model_identity("org/model-tuned", CONFIG)


def test_a_hybrid_model_is_refused_when_the_engine_starts() -> None:
    groups = [SimpleNamespace(kv_cache_spec=FullAttention()), SimpleNamespace(kv_cache_spec=SlidingWindow())]
    with pytest.raises(ValueError, match=r"has 2 \(FullAttention, SlidingWindow: a hybrid model\)"):
        check_servable(SimpleNamespace(kv_cache_groups=groups), "decode-0")
    check_servable(SimpleNamespace(kv_cache_groups=groups[:1]), "decode-0")


class FullAttention:
    pass


class SlidingWindow:
    pass
