"""The KV tier's own parts: entry format, crash safety, LRU budget, the tier's key file and what older tiers
left, block keys, and the CPU copy worker."""

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
from vllm.v1.kv_offload.tiering.base import TransferJob

from connectors.tier.cleanup import KEY_TMP_AGE_S, Removed, remove_stale
from connectors.tier.fs_tier import PdserveFsTier, _CountingLookup, namespace
from connectors.tier.key import KEY_FILE, encode_key, load_tier_key
from connectors.tier.spec import CpuTierWorker
from connectors.tier.store import (
    HEADER,
    VERSION,
    CorruptEntry,
    EntryStore,
    LruIndex,
    entry_mac,
    read_entry,
    write_entry,
)
from contract.auth import SECRET_ENV, new_secret
from contract.errors import UnsafeDirectory
from contract.private_files import private_dir

BLOCK = 4096


KEY = bytes(range(32))
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


def test_an_entry_written_under_another_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "e.bin"
    write(path, payload(3), key=os.urandom(32))
    with pytest.raises(CorruptEntry, match="another tier key"):
        read(path, buffer())
    assert not path.exists()


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


def test_an_entry_of_format_2_is_refused_by_its_version(tmp_path: Path) -> None:
    """Format 2 was MAC'd under a key of the cluster secret: even one whose MAC a key holder made is refused."""
    path = tmp_path / "v2.bin"
    data = payload(9)
    write(path, data)
    path.write_bytes(path.read_bytes()[:4] + struct.pack("<H", 2) + path.read_bytes()[6:])
    with pytest.raises(CorruptEntry, match="version 2"):
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
    assert (magic, version, length, mac) == (b"PDKV", VERSION, BLOCK, entry_mac(KEY, NAME, BLOCK, payload(6)))
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


def test_a_tier_key_file_others_may_read_fails_the_engines_start(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    load_tier_key(private_dir(root, "KV tier directory"))
    (root / KEY_FILE).chmod(0o644)
    with pytest.raises(UnsafeDirectory, match=rf"KV tier 'shared' key file {re.escape(str(root / KEY_FILE))}: "):
        tier_at(root)


# --- the tier's own key: a tier outlives its cluster, and trusts only its owner -------------------


@pytest.fixture
def open_umask():
    """A umask that takes nothing away: the modes must come from how each file is created."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_the_key_file_is_made_once_private_and_read_back(tmp_path: Path, open_umask) -> None:
    root = private_dir(tmp_path / "kv", "KV tier directory")
    first = load_tier_key(root)
    path = root / KEY_FILE
    assert first.path == path and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    made = path.read_bytes()
    assert load_tier_key(root) == first and path.read_bytes() == made  # read, not made again
    assert re.fullmatch(rb"pdserve kv tier key v1\n[0-9a-f]{64}\n", made)
    assert re.fullmatch(r"[0-9a-f]{8}", first.key_id) and len(first.entry_key) == 32
    assert first.entry_key.hex() not in made.decode() and first.key_id not in made.decode()  # derived, not shown
    assert "entry_key" not in repr(first)
    assert sorted(p.name for p in root.iterdir()) == [KEY_FILE]  # no temporary file left
    other = private_dir(tmp_path / "other", "KV tier directory")
    assert load_tier_key(other).entry_key != first.entry_key  # every tier directory has a key of its own


def test_engines_opening_a_new_tier_at_once_agree_on_its_key(tmp_path: Path) -> None:
    """Threads race on the link that makes the file; processes too (each its own python, started together)."""
    for attempt in range(20):
        root = private_dir(tmp_path / f"threads-{attempt}", "KV tier directory")
        start, keys = threading.Barrier(8), []

        def open_tier(root: Path = root, start: threading.Barrier = start, keys: list = keys) -> None:
            start.wait()
            keys.append(load_tier_key(root))

        threads = [threading.Thread(target=open_tier) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(keys) == 8 and len({k.entry_key for k in keys}) == 1
        assert [p.name for p in root.iterdir()] == [KEY_FILE]

    import subprocess
    import sys

    root, go = private_dir(tmp_path / "processes", "KV tier directory"), tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from connectors.tier.key import load_tier_key\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.001)\n"
        "print(load_tier_key(Path(sys.argv[1])).key_id)\n"
    )
    repo = Path(__file__).resolve().parents[3]
    engines = [
        subprocess.Popen([sys.executable, "-c", code, str(root), str(go)], stdout=subprocess.PIPE, text=True, cwd=repo)
        for _ in range(6)
    ]
    time.sleep(0.5)  # every process imported and waiting
    go.touch()
    ids = {engine.communicate(timeout=60)[0].strip() for engine in engines}
    assert ids == {load_tier_key(root).key_id} and all(engine.returncode == 0 for engine in engines)


def test_without_hard_links_the_key_file_is_made_in_place_and_a_short_one_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem without hard links the file is created with O_EXCL and written: a reader that finds it
    shorter than a key file (its writer between the two) waits for it, and then agrees with the writer."""

    def no_hard_links(*args, **kwargs) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    root = private_dir(tmp_path / "kv", "KV tier directory")
    made = load_tier_key(root)
    assert load_tier_key(root) == made and sorted(p.name for p in root.iterdir()) == [KEY_FILE]
    assert stat.S_IMODE(made.path.stat().st_mode) == 0o600

    whole = encode_key(os.urandom(32))
    made.path.write_bytes(whole[:10])  # another engine's, half written
    finisher = threading.Timer(0.3, made.path.write_bytes, [whole])
    finisher.start()
    try:
        assert load_tier_key(root).entry_key == load_tier_key(root).entry_key != made.entry_key
    finally:
        finisher.join()
    made.path.write_bytes(whole[:10])  # a writer that died half way: refused once the wait is over
    with pytest.raises(UnsafeDirectory, match="not a pdserve KV tier key"):
        load_tier_key(root)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o606, 0o644])
def test_a_key_file_others_may_read_or_write_is_refused_naming_it(tmp_path: Path, mode: int) -> None:
    root = private_dir(tmp_path / "kv", "KV tier directory")
    key = load_tier_key(root)
    key.path.chmod(mode)
    why = rf"KV tier key file {re.escape(str(key.path))}: its group or everyone may read or write it \(mode {mode:o}"
    with pytest.raises(UnsafeDirectory, match=why):
        load_tier_key(root)
    assert stat.S_IMODE(key.path.stat().st_mode) == mode  # refused, not narrowed: the key may be others' by now


def test_a_key_file_of_another_user_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = private_dir(tmp_path / "kv", "KV tier directory")
    key = load_tier_key(root)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(key.path).st_uid + 1)  # as if another user had made it
    with pytest.raises(UnsafeDirectory, match=rf"KV tier key file {re.escape(str(key.path))}: owned by uid \d+"):
        load_tier_key(root)


def test_a_key_file_that_is_a_link_or_not_a_key_is_refused_naming_it(tmp_path: Path) -> None:
    root = private_dir(tmp_path / "kv", "KV tier directory")
    elsewhere = tmp_path / "elsewhere.key"
    elsewhere.write_bytes(encode_key(os.urandom(32)))
    elsewhere.chmod(0o600)
    (root / KEY_FILE).symlink_to(elsewhere)  # a link is not followed: whoever owns its target chose the key
    with pytest.raises(UnsafeDirectory, match=rf"{re.escape(str(root / KEY_FILE))}: a symbolic link"):
        load_tier_key(root)
    (root / KEY_FILE).unlink()
    (root / KEY_FILE).write_bytes(b"pdserve kv tier key v1\n" + b"zz" * 32 + b"\n")
    (root / KEY_FILE).chmod(0o600)
    with pytest.raises(UnsafeDirectory, match=rf"{re.escape(str(root / KEY_FILE))}: not a pdserve KV tier key"):
        load_tier_key(root)


def offloading_spec() -> SimpleNamespace:
    """What ``PdserveFsTier`` and vLLM's ``FileMapper`` read of an ``OffloadingSpec``: one group, one block a chunk."""
    config = SimpleNamespace(
        groups=[SimpleNamespace(group_id=0, tokens_per_block=4, layer_names=["layers.0.attn"])],
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, is_parallelism_agnostic=True),
        model=SimpleNamespace(name="m", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=4),
        canonical_layout=False,
        replicated_layout=False,
        kv_cache_layout=None,
    )
    return SimpleNamespace(config=config, blocks_per_chunk=1, tokens_per_hash=4)


class EngineTier:
    """A ``PdserveFsTier`` as an engine core opens it, over a primary tier of ``chunks`` chunks, with the jobs
    vLLM's tiering manager would submit."""

    def __init__(self, root: Path, chunks: int = 4) -> None:
        self.primary = bytearray(chunks * BLOCK)
        view = memoryview(self.primary).cast("B", [chunks, BLOCK])
        spec = offloading_spec()
        self.tier = PdserveFsTier(spec, view, "fs", root_dir=str(root), max_bytes=100 * BLOCK, name="shared")
        self._jobs = 0

    def _run(self, submit, keys: list[bytes]) -> object:
        self._jobs += 1
        job = TransferJob(self._jobs, keys, np.arange(len(keys)), submit == "load", ReqContext(req_id="r"))
        (self.tier.submit_load if submit == "load" else self.tier.submit_store)(job)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if done := [r for r in self.tier.get_finished_jobs() if r.job_id == job.job_id]:
                return done[0]
            time.sleep(0.005)
        raise AssertionError(f"job {job.job_id} did not finish")

    def store(self, keys: list[bytes], chunks: list[bytes]) -> None:
        for i, chunk in enumerate(chunks):
            self.primary[i * BLOCK : (i + 1) * BLOCK] = chunk
        assert self._run("store", keys).success

    def load(self, keys: list[bytes]) -> tuple[object, list[bytes]]:
        """The job's result and the chunks it put in the primary tier."""
        self.primary[:] = bytes(len(self.primary))
        result = self._run("load", keys)
        return result, [bytes(self.primary[i * BLOCK : (i + 1) * BLOCK]) for i in range(len(keys))]

    def path(self, key: bytes) -> Path:
        return Path(self.tier.file_mapper.get_file_name(key))

    def close(self) -> None:
        self.tier.shutdown()


def test_a_restarted_cluster_loads_what_the_one_before_stored_and_refuses_what_others_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cluster 1 stores a prompt's chunks; cluster 2 (a new cluster secret, as every `pdserve up` makes) loads
    them all. An entry altered on disk, or written whole with a key other than the tier's, is refused: the
    load stops there, the blocks before it count as loaded, the rest are recomputed, and the bad entry is
    deleted so that the recomputed block is stored again."""
    keys = chain_keys(list(range(300, 316)))  # 4 chained blocks
    chunks = [bytes(payload(i)) for i in range(4)]
    root = tmp_path / "kv"
    first = EngineTier(root)
    first.store(keys, chunks)
    first.close()

    monkeypatch.setenv(SECRET_ENV, new_secret().reveal())  # pdserve down, pdserve up: another cluster secret
    second = EngineTier(root)
    try:
        result, loaded = second.load(keys)
        assert result.success and loaded == chunks
        assert second.tier.entries.take_counters().loaded_bytes == 4 * (HEADER.size + BLOCK)

        altered = second.path(keys[2])
        data = bytearray(altered.read_bytes())
        data[HEADER.size + 100] ^= 0x01  # one bit of the KV
        altered.write_bytes(bytes(data))
        result, loaded = second.load(keys)
        assert not result.success and list(result.successful_keys) == keys[:2]  # blocks 2, 3: recomputed
        assert loaded[:2] == chunks[:2] and not altered.exists()
        assert second.tier.entries.take_counters().corrupt == 1

        second.store(keys[2:3], chunks[2:3])  # the recomputed block, stored again
        foreign = second.path(keys[1])
        foreign.unlink()  # planted by someone who cannot read the key file: a valid entry under another key
        write_entry(foreign, payload(99), key=os.urandom(32), name=second.tier.entries.name_of(foreign))
        result, loaded = second.load(keys)
        assert not result.success and list(result.successful_keys) == keys[:1]  # block 1 on: recomputed
        assert loaded[0] == chunks[0] and not foreign.exists()
    finally:
        second.close()


def test_a_tier_needs_no_cluster_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV)
    tier = EngineTier(tmp_path / "kv")
    tier.close()
    assert (tmp_path / "kv" / KEY_FILE).exists()


def old_tier(root: Path, key_id: str) -> dict[str, Path]:
    """A tier directory as older pdserves and other keys left it, beside the current namespace and things that
    are not the tier's."""
    layout = "m_0123456789ab_r0/abc/de_g0"
    made = {
        "v1": root / "pdserve-v1-cpu-4096" / layout / "abcdef.bin",
        "v2": root / "pdserve-v2-cpu-4096" / layout / "abcdef.bin",
        "v2-tmp": root / "pdserve-v2-cpu-4096" / layout / f"abcdef.bin.{'e' * 32}.tmp",
        "v2-notes": root / "pdserve-v2-cuda-8192" / "notes.txt",  # the user's, in a namespace of ours
        "v2-entry-beside-notes": root / "pdserve-v2-cuda-8192" / layout / "abcdef.bin",
        "old-key": root / f"pdserve-v{VERSION}-deadbeef-cpu-4096" / layout / "abcdef.bin",
        "current": root / f"pdserve-v{VERSION}-{key_id}-cpu-4096" / layout / "abcdef.bin",
        "newer": root / f"pdserve-v{VERSION + 1}-cafef00d-cpu-4096" / layout / "abcdef.bin",
        "not-ours": root / "backups" / "pdserve-v2-cpu-4096" / "abcdef.bin",
        "named-like-ours": root / "pdserve-v2-cpu-4096-mine.txt",
        "outside": root.parent / "outside" / "abcdef.bin",
    }
    for path in made.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 100)
    (root / "pdserve-v1-cpu-8192").symlink_to(made["outside"].parent)  # a link: never followed
    return made


def test_namespaces_of_older_formats_and_keys_are_removed_and_nothing_else(tmp_path: Path, caplog) -> None:
    root = private_dir(tmp_path / "kv", "KV tier directory")
    key = load_tier_key(root)
    made = old_tier(root, key.key_id)
    with caplog.at_level("INFO", logger="connectors.tier.cleanup"):
        removed = remove_stale(root, key.key_id, "KV tier 'shared'")
    gone = {"v1", "v2", "v2-tmp", "v2-entry-beside-notes", "old-key"}
    assert {name for name, path in made.items() if not path.exists()} == gone  # what a link leads to stays too
    assert not (root / "pdserve-v1-cpu-4096").exists() and not (root / f"pdserve-v{VERSION}-deadbeef-cpu-4096").exists()
    assert sorted(p.name for p in (root / "pdserve-v2-cuda-8192").iterdir()) == ["notes.txt"]  # the user's file stays
    assert (removed.namespaces, removed.files, removed.bytes, removed.foreign_files) == (4, 5, 500, 1)
    assert (
        f"KV tier 'shared' at {root}: cleaned 4 namespace(s) of an older entry format or key" in caplog.text
        and "removed 5 files (500 bytes); left 1 file(s) the tier did not write" in caplog.text
    )
    assert remove_stale(root, key.key_id) == Removed(namespaces=1, foreign_files=1)  # the one with notes.txt


def test_a_tier_cleans_its_directory_when_an_engine_opens_it(tmp_path: Path, caplog) -> None:
    root = private_dir(tmp_path / "kv", "KV tier directory")
    made = old_tier(root, load_tier_key(root).key_id)
    dead_writer = root / f"{KEY_FILE}.4242.0badc0de.tmp"  # a key file's writer that died
    dead_writer.write_bytes(b"")
    os.utime(dead_writer, (time.time() - KEY_TMP_AGE_S - 1,) * 2)
    with caplog.at_level("INFO"):
        EngineTier(root).close()
    assert not made["v2"].exists() and not made["old-key"].exists() and not dead_writer.exists()
    assert made["current"].exists() and made["newer"].exists() and made["not-ours"].exists()
    assert "cleaned 4 namespace(s)" in caplog.text


def test_a_key_file_replaced_makes_the_old_keys_entries_stale(tmp_path: Path) -> None:
    """Removing the key file is how a user makes a tier forget: the next engine makes a new key, and what the
    old key MAC'd is removed, not left to take space."""
    root = tmp_path / "kv"
    keys, chunks = chain_keys(list(range(300, 308))), [bytes(payload(i)) for i in range(2)]
    first = EngineTier(root)
    first.store(keys, chunks)
    old = first.path(keys[0])
    first.close()
    (root / KEY_FILE).unlink()
    second = EngineTier(root)
    try:
        assert not old.exists() and not (root / old.relative_to(root).parts[0]).exists()
        assert second.path(keys[0]) != old and not second.path(keys[0]).exists()  # a miss: computed, stored anew
    finally:
        second.close()


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
        root_dir=str(root / namespace(block_bytes, "0123abcd")),
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

    code = (
        "from tests.unit.connectors.test_kv_tier import chain_keys; print(chain_keys(list(range(100, 116)))[-1].hex())"
    )
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
