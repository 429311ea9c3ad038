"""The KV tier's own parts: entry format, crash safety, LRU budget, keys, and the CPU copy worker."""

from __future__ import annotations

import os
import re
import stat
import struct
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.file_mapper import FileMapper

from connectors.auth import SECRET_ENV, ClusterSecret, MissingSecret, engine_key, new_secret, tier_key
from connectors.errors import UnsafeDirectory
from connectors.tier.fs_tier import PdserveFsTier, _CountingLookup, namespace
from connectors.tier.spec import CpuTierWorker
from connectors.tier.store import HEADER, CorruptEntry, EntryStore, LruIndex, entry_mac, read_entry, write_entry
from tests.unit.conftest import TEST_SECRET

BLOCK = 4096


KEY = tier_key(TEST_SECRET)
NAME = "ns/e.bin"


def payload(seed: int, size: int = BLOCK) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())


def buffer(size: int = BLOCK) -> memoryview:
    return memoryview(bytearray(size))


def write(path: Path, data: memoryview, key: bytes = KEY, name: str = NAME, **kwargs) -> int:
    return write_entry(path, data, key=key, name=name, **kwargs)


def read(path: Path, out: memoryview, key: bytes = KEY, name: str = NAME) -> int:
    return read_entry(path, out, key=key, name=name)


def open_store(root: Path, max_bytes: int, **kwargs) -> EntryStore:
    return EntryStore(root, max_bytes, key=KEY, **kwargs)


# --- entries ------------------------------------------------------------------------------------


def test_entry_round_trip_and_existing_entry_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b.bin"
    assert write(path, payload(1)) == HEADER.size + BLOCK
    assert write(path, payload(2)) == 0  # the same key again: the first entry stays
    out = buffer()
    assert read(path, out) == HEADER.size + BLOCK
    assert bytes(out) == bytes(payload(1))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b[: len(b) // 2], "bytes, expected"),  # torn: the writer died half way
        (lambda b: b[:-1], "bytes, expected"),
        (lambda b: b[: HEADER.size + 10] + bytes([b[HEADER.size + 10] ^ 1]) + b[HEADER.size + 11 :], "wrong MAC"),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "wrong MAC"),  # a flipped bit of the MAC itself
        (lambda b: b"XXXX" + b[4:], "bad header"),
        (lambda b: b + b"\0", "bytes, expected"),
    ],
)
def test_a_damaged_entry_is_detected_and_deleted(tmp_path: Path, damage, reason: str) -> None:
    path = tmp_path / "e.bin"
    write(path, payload(3))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptEntry, match=reason):
        read(path, buffer())
    assert not path.exists()  # dropped, so the recomputed block is stored again


def test_an_entry_written_under_another_clusters_secret_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "e.bin"
    write(path, payload(3), key=tier_key(new_secret()))
    with pytest.raises(CorruptEntry, match="another cluster secret"):
        read(path, buffer())
    assert not path.exists()


def test_the_tier_key_is_its_own_derivation_of_the_secret() -> None:
    assert tier_key(TEST_SECRET) == tier_key(ClusterSecret(TEST_SECRET.reveal()))
    assert tier_key(TEST_SECRET) != tier_key(new_secret())
    assert tier_key(TEST_SECRET).hex() != engine_key(TEST_SECRET)  # holding the engine key gives nothing here


def test_a_valid_entry_moved_to_another_keys_name_is_refused(tmp_path: Path) -> None:
    """An entry is bound to its name: one engine's valid KV cannot be planted under another prompt's key."""
    mine, other = tmp_path / "mine.bin", tmp_path / "other.bin"
    write(mine, payload(3), name="ns/mine.bin")
    os.replace(mine, other)
    with pytest.raises(CorruptEntry, match="wrong MAC"):
        read(other, buffer(), name="ns/other.bin")


def test_an_entry_of_the_old_crc_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.bin"
    data = payload(9)
    version_1 = struct.pack("<4sHHQI12x", b"PDKV", 1, 0, BLOCK, zlib.crc32(data))  # what version 1 wrote
    path.write_bytes(version_1 + bytes(data))
    with pytest.raises(CorruptEntry, match="expected"):
        read(path, buffer())
    assert not path.exists()
    # the same header padded to the new size: refused by its version before any MAC is computed
    path.write_bytes(version_1 + bytes(HEADER.size - len(version_1)) + bytes(data))
    with pytest.raises(CorruptEntry, match="version 1"):
        read(path, buffer())


def test_a_missing_entry_is_a_plain_miss(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read(tmp_path / "none.bin", buffer())


def test_a_crashed_writer_leaves_no_entry_and_its_temp_file_is_removed_on_open(tmp_path: Path) -> None:
    path = tmp_path / "ns" / "k.bin"
    path.parent.mkdir(parents=True)
    tmp = path.with_name(path.name + ".deadbeef.tmp")
    tmp.write_bytes(b"half an entry")  # what a writer killed before its rename leaves
    with pytest.raises(FileNotFoundError):
        read(path, buffer())
    open_store(tmp_path, 10 * BLOCK)
    assert not tmp.exists()


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tier" / "k.bin"

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        write(path, payload(4))
    assert list(path.parent.iterdir()) == []


def test_concurrent_writers_of_one_key_leave_one_valid_entry(tmp_path: Path) -> None:
    path = tmp_path / "tier" / "same.bin"
    data = payload(5, 256 * 1024)
    errors: list[BaseException] = []

    def write_often() -> None:
        try:
            for _ in range(20):
                write(path, data)
                path.unlink(missing_ok=True)  # another engine evicting it between writes
            write(path, data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write_often) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    out = buffer(len(data))
    read(path, out)
    assert bytes(out) == bytes(data)
    assert [p.name for p in path.parent.iterdir()] == ["same.bin"]  # no temp files left


def test_header_carries_the_mac_of_the_name_and_payload(tmp_path: Path) -> None:
    path = tmp_path / "h.bin"
    write(path, payload(6))
    magic, version, _, length, mac = HEADER.unpack(path.read_bytes()[: HEADER.size])
    assert (magic, version, length, mac) == (b"PDKV", 2, BLOCK, entry_mac(KEY, NAME, BLOCK, payload(6)))
    assert entry_mac(KEY, "ns/other.bin", BLOCK, payload(6)) != mac


# --- private files and the directory the tier trusts --------------------------------------------


def test_entries_and_the_directories_made_for_them_are_private(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # the modes come from creation, not from a umask that happens to be strict
    try:
        entries = open_store(tmp_path / "made" / "ns", 10 * BLOCK, fsync=False)
        path = entries.root / "model" / "layers" / "k.bin"
        entries.write(path, payload(1))
    finally:
        os.umask(old_umask)
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "made", entries.root, path.parent, path)}
    assert modes == {tmp_path / "made": 0o700, entries.root: 0o700, path.parent: 0o700, path: 0o600}
    out = buffer()
    entries.read(path, out)
    assert bytes(out) == bytes(payload(1))


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_directory_others_can_write_is_refused_naming_it(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(mode)
    why = rf"{re.escape(str(root))}: writable by its group or by everyone \(mode {mode:o}\)"
    with pytest.raises(UnsafeDirectory, match=why):
        open_store(root, 10 * BLOCK)


def test_a_directory_of_another_user_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(root).st_uid + 1)  # as if another user owned it
    with pytest.raises(UnsafeDirectory, match=rf"{re.escape(str(root))}: owned by uid \d+, not this user"):
        open_store(root, 10 * BLOCK)


def test_a_directory_of_ours_that_others_may_read_is_narrowed(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o755)  # what an earlier pdserve left
    open_store(root, 10 * BLOCK)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def tier_at(root: Path) -> PdserveFsTier:
    """The tier as vLLM's offloading connector builds it in the engine core; the checks come before the spec
    is read, so a bare spec is enough to see what the engine's start does."""
    primary = memoryview(bytearray(2 * BLOCK)).cast("B", [2, BLOCK])
    return PdserveFsTier(SimpleNamespace(), primary, "fs", root_dir=str(root), max_bytes=10 * BLOCK, name="shared")


def test_a_tier_directory_others_can_write_fails_the_engines_start(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o775)
    with pytest.raises(UnsafeDirectory, match=rf"KV tier 'shared' directory {re.escape(str(root))}: writable by"):
        tier_at(root)


def test_a_tier_without_the_cluster_secret_fails_the_engines_start(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(MissingSecret, match=SECRET_ENV):
        tier_at(tmp_path / "kv")


# --- the byte budget ------------------------------------------------------------------------------


def test_lru_index_evicts_least_recently_used_first() -> None:
    index = LruIndex(max_bytes=300)
    for key in "abc":
        index.add(key, 100)
    index.touch("a")
    index.add("d", 100)
    assert list(index.over_budget(protect="d")) == ["b"]
    assert index.total_bytes == 300 and "a" in index and "b" not in index


def test_lru_index_never_evicts_the_protected_entry() -> None:
    index = LruIndex(max_bytes=100)
    index.add("big", 500)
    assert list(index.over_budget(protect="big")) == []
    with pytest.raises(ValueError, match="max_bytes"):
        LruIndex(0)


def test_store_stays_within_its_budget_and_counts_evictions(tmp_path: Path) -> None:
    entry = HEADER.size + BLOCK
    store = open_store(tmp_path, max_bytes=3 * entry, fsync=False)
    paths = [tmp_path / f"{i}.bin" for i in range(5)]
    for i, path in enumerate(paths[:3]):
        store.write(path, payload(i))
    store.read(paths[0], buffer())  # used: the oldest is now 1
    store.write(paths[3], payload(3))
    store.write(paths[4], payload(4))
    assert [p.exists() for p in paths] == [True, False, False, True, True]
    assert store.usage() == (3, 3 * entry)
    counters = store.take_counters()
    assert (counters.evictions, counters.evicted_bytes) == (2, 2 * entry)
    assert counters.stored_bytes == 5 * entry and counters.loaded_bytes == entry
    assert store.take_counters().evictions == 0  # counters are taken once


def test_store_counts_corrupt_entries_and_forgets_them(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_bytes=10 * BLOCK, fsync=False)
    path = tmp_path / "c.bin"
    store.write(path, payload(7))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptEntry):
        store.read(path, buffer())
    assert store.take_counters().corrupt == 1
    assert store.usage() == (0, 0)


def test_reopened_store_rebuilds_its_index_in_last_use_order(tmp_path: Path) -> None:
    entry = HEADER.size + BLOCK
    paths = [tmp_path / "x" / f"{i}.bin" for i in range(4)]
    for i, path in enumerate(paths):
        write(path, payload(i), fsync=False)
        os.utime(path, (1000 + 10 * i, 1000 + 10 * i))
    os.utime(paths[0], (2000, 2000))  # read last before the restart
    store = open_store(tmp_path, max_bytes=3 * entry)  # a smaller budget than what is on disk
    assert [p.exists() for p in paths] == [True, False, True, True]
    assert store.usage() == (3, 3 * entry)


def test_entries_written_by_another_engine_are_counted_when_read(tmp_path: Path) -> None:
    mine = open_store(tmp_path, max_bytes=10 * BLOCK, fsync=False)
    other = open_store(tmp_path, max_bytes=10 * BLOCK, fsync=False)
    path = tmp_path / "shared.bin"
    other.write(path, payload(8))
    mine.read(path, buffer())
    assert mine.usage() == (1, HEADER.size + BLOCK)


# --- keys -----------------------------------------------------------------------------------------


def chain_keys(tokens: list[int], block_tokens: int = 4, algo: str = "sha256_cbor") -> list[bytes]:
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    keys, parent = [], None
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start : start + block_tokens])
        keys.append(make_offload_key(parent, 0))
    return keys


def entry_path(root: Path, key: bytes, model: str = "m", block_bytes: int = BLOCK, dtype: str = "bfloat16") -> str:
    mapper = FileMapper(
        root_dir=str(root / namespace(block_bytes)),
        model_name=model,
        tokens_per_hash=4,
        blocks_per_file=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        rank=0,
        dtype=dtype,
        kv_cache_groups=[{"tokens_per_block": 4, "layer_names": ["layers.0.attn"]}],
    )
    return mapper.get_file_name(key)


def test_same_tokens_same_key_in_another_process_too(tmp_path: Path) -> None:
    tokens = list(range(100, 116))
    assert chain_keys(tokens) == chain_keys(list(tokens))
    assert entry_path(tmp_path, chain_keys(tokens)[-1]) == entry_path(tmp_path, chain_keys(tokens)[-1])
    # the hash is reproducible: no per-process seed (PYTHONHASHSEED unset, cryptographic hash)
    import subprocess
    import sys

    code = "from tests.unit.test_kv_tier import chain_keys; print(chain_keys(list(range(100, 116)))[-1].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path.cwd())
    assert out.stdout.strip() == chain_keys(tokens)[-1].hex()


def test_any_token_changes_the_key_of_its_block_and_all_later_ones() -> None:
    tokens = list(range(100, 116))
    changed = tokens.copy()
    changed[5] += 1
    a, b = chain_keys(tokens), chain_keys(changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_model_dtype_and_layout_are_part_of_the_key(tmp_path: Path) -> None:
    key = chain_keys(list(range(100, 108)))[-1]
    base = entry_path(tmp_path, key)
    assert entry_path(tmp_path, key, model="other-model") != base
    assert entry_path(tmp_path, key, dtype="float16") != base
    assert entry_path(tmp_path, key, block_bytes=2 * BLOCK) != base  # another engine layout


# --- the CPU copy worker --------------------------------------------------------------------------


class _Region:
    """What the worker uses of vLLM's SharedOffloadRegion: a strided view per tensor."""

    def __init__(self, chunks: int, row_bytes: int) -> None:
        self.memory = torch.zeros(chunks, row_bytes + 64, dtype=torch.int8)  # padded rows, like the real one
        self.offset = 0
        self.cleaned = False

    def create_next_worker_view(self, page: int) -> torch.Tensor:
        view = torch.as_strided(self.memory, (self.memory.shape[0], page), (self.memory.stride(0), 1), self.offset)
        self.offset += page
        return view

    def cleanup(self) -> None:
        self.cleaned = True


def kv_caches(layers: int = 2, blocks: int = 10, page: int = 32) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    tensors = [torch.randint(-128, 127, (blocks, page), dtype=torch.int8) for _ in range(layers)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(layers)]],
    )
    return caches, tensors


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_cpu_worker_stores_and_loads_blocks_exactly(blocks_per_chunk: int) -> None:
    caches, tensors = kv_caches()
    original = [t.clone() for t in tensors]
    region = _Region(chunks=6, row_bytes=2 * 32 * blocks_per_chunk)
    worker = CpuTierWorker(caches, blocks_per_chunk, region)  # type: ignore[arg-type]
    # blocks 3, 5, 6 of a request (logical blocks 1..3) into chunks; the first starts mid-chunk when 2 per chunk
    chunks = [4, 1, 2] if blocks_per_chunk == 1 else [4, 1]
    assert worker.submit_store(1, GPULoadStoreSpec([3, 5, 6], [3], [1]), BlockIDsLoadStoreSpec(chunks))
    for t in tensors:
        t.zero_()
    assert worker.submit_load(2, BlockIDsLoadStoreSpec(chunks), GPULoadStoreSpec([7, 8, 9], [3], [1]))
    for t, o in zip(tensors, original, strict=True):
        assert torch.equal(t[7:10], o[[3, 5, 6]])
        assert not t[:7].any()  # nothing else written
    results = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [(1, True, 3 * 2 * 32), (2, True, 3 * 2 * 32)]
    assert worker.get_finished() == []
    worker.wait({1, 2})
    worker.shutdown()
    assert region.cleaned


def test_cpu_worker_refuses_device_memory() -> None:
    caches, _ = kv_caches()
    on_device = torch.empty(10, 32, dtype=torch.int8, device="meta")
    caches.tensors[0] = CanonicalKVCacheTensor(tensor=on_device, page_size_bytes=32)
    with pytest.raises(ValueError, match="host memory"):
        CpuTierWorker(caches, 1, _Region(4, 64))  # type: ignore[arg-type]


def test_a_lookup_answers_at_once_unless_asked_to_wait_for_vllms_async_one(tmp_path: Path) -> None:
    (tmp_path / "stored").write_bytes(b"x")
    tier = SimpleNamespace(file_mapper=SimpleNamespace(get_file_name=lambda key: str(tmp_path / key)))
    request = ReqContext(req_id="r")
    at_once = _CountingLookup(tier, "fs", async_lookup=False)
    later = _CountingLookup(tier, "fs", async_lookup=True)
    try:
        assert (at_once.lookup("stored", request), at_once.lookup("new", request)) == (True, False)
        assert (at_once.hits, at_once.misses) == (1, 1)
        # vLLM's: "not yet" (the scheduler's RETRY: an engine step later), then the answer
        assert later.lookup("stored", request) is None
        later.flush()
        deadline = time.monotonic() + 5
        while (answer := later.lookup("stored", request)) is None and time.monotonic() < deadline:
            later.flush()
            time.sleep(0.01)
        assert answer is True and later.hits == 1
    finally:
        at_once.shutdown()
        later.shutdown()
