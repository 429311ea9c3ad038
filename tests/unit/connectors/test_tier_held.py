"""What an engine answers about its KV tiers (``connectors.tier.held``): the engine core's own block hashes
and file names, chunks counted in order up to the first missing one, layouts written whole."""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.request import Request

from connectors.tier import LAYOUT_ENV
from connectors.tier.held import TierLayout, _hashable, block_hashes, held_tokens, read_layouts, write_layout

ALGO = "sha256_cbor"


def engine_hashes(tokens: list[int], per_hash: int, salt: str | None = None) -> list[bytes]:
    """The block hashes vLLM's engine core gives a request (its request block hasher)."""
    hash_fn = get_hash_fn_by_name(ALGO)
    init_none_hash(hash_fn)
    request = Request(
        "r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
        block_hasher=get_request_block_hasher(per_hash, hash_fn),
    )  # fmt: skip
    return [bytes(h) for h in request.block_hashes]


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_block_hashes_are_the_engine_cores(salt: str | None) -> None:
    tokens = list(range(1000, 1042))  # 10 full blocks of 4 and a partial one
    ours = block_hashes(tokens, 4, ALGO, salt)
    assert ours == engine_hashes(tokens, 4, salt)
    assert len(ours) == 10
    assert block_hashes(tokens, 4, ALGO, "another") != ours  # the salt is in the chain


def test_hashes_seeded_at_random_per_process_are_not_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert block_hashes(list(range(8)), 4, "xxhash") is None
    assert block_hashes(list(range(8)), 4, ALGO) is not None  # sha256: the same seed in every process


def mapper(root: Path) -> FileMapper:
    return FileMapper(
        root_dir=str(root), model_name="m", tokens_per_hash=4, blocks_per_file=1, tp_size=1, pp_size=1,
        pcp_size=1, dcp_size=1, rank=0, dtype="bfloat16",
        kv_cache_groups=[{"tokens_per_block": 4, "layer_names": ["layers.0.attn"]}],
    )  # fmt: skip


def store(files: FileMapper, block_hash: bytes, group: int = 0) -> None:
    path = Path(files.get_file_name(make_offload_key(block_hash, group)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"entry")


def test_chunks_are_counted_in_order_up_to_the_first_missing_one(tmp_path: Path) -> None:
    files = mapper(tmp_path)
    layout = TierLayout("shared", files.base_path, files.rank, 4, ((0, 2),))  # chunks of 2 blocks, 8 tokens
    hashes = block_hashes(list(range(500, 540)), 4, ALGO)  # 10 blocks: 5 chunks
    assert held_tokens(layout, hashes) == 0

    for last in (1, 3, 7):  # chunks 0, 1 and 3 (a chunk's key is its last block's hash)
        store(files, hashes[last])
    assert held_tokens(layout, hashes) == 16  # chunk 2 is missing: the engine would load 0 and 1 only
    assert layout.file_name(hashes[1], 0) == files.get_file_name(make_offload_key(hashes[1], 0))


def test_every_kv_cache_group_must_hold_a_chunk(tmp_path: Path) -> None:
    files = mapper(tmp_path)
    layout = TierLayout("shared", files.base_path, files.rank, 4, ((0, 1), (1, 1)))
    hashes = block_hashes(list(range(12)), 4, ALGO)
    for h in hashes:
        store(files, h, 0)
    store(files, hashes[0], 1)
    assert held_tokens(layout, hashes) == 4


def test_a_layout_is_written_whole_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SimpleNamespace(
        blocks_per_chunk=2,
        tokens_per_hash=16,
        config=SimpleNamespace(groups=[SimpleNamespace(group_id=0, tokens_per_block=16)]),
    )
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    assert write_layout("shared", "/kv/base", 0, spec) is None  # nobody asked for it
    monkeypatch.setenv(LAYOUT_ENV, str(tmp_path / "layouts"))
    write_layout("shared", "/kv/base", 0, spec)
    write_layout("node", "/dev/shm/kv/base", 0, spec)

    assert read_layouts(tmp_path / "layouts") == [
        TierLayout("node", "/dev/shm/kv/base", 0, 16, ((0, 2),)),
        TierLayout("shared", "/kv/base", 0, 16, ((0, 2),)),
    ]
    assert sorted(p.name for p in (tmp_path / "layouts").iterdir()) == ["node.json", "shared.json"]  # no temp file
    assert read_layouts(tmp_path / "none") == []
    # private: they name the tier's directories and the model
    assert stat.S_IMODE((tmp_path / "layouts").stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "layouts").iterdir()} == {0o600}


def test_only_prompts_the_engine_hashes_from_their_tokens_are_looked_up() -> None:
    text = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    assert _hashable({"messages": [text, {"role": "user", "content": "plain"}]})
    assert not _hashable({"messages": [image]})
    assert _hashable({"prompt": "x"})
    assert not _hashable({"prompt": "x", "prompt_embeds": "..."})
