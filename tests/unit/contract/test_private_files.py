"""Files pdserve writes are private: 0600 files, 0700 directories, whatever the umask (``contract.private_files``),
and the places that write them: logs, the controller's snapshot, the state directory. The KV tier's entries and
its directory are checked in ``test_kv_tier.py``, the tiers' layouts in ``test_tier_held.py``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.errors import UnsafeDirectory
from contract.private_files import make_private_dirs, open_private, private_dir, write_private
from orchestrator import cluster
from orchestrator.event_log import SNAPSHOT_NAME, EventLog
from tests.unit.conftest import REPO_ROOT


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that takes nothing away: the modes must come from how each file is created."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_directories_and_their_missing_parents_are_made_0700(tmp_path: Path, open_umask) -> None:
    (tmp_path / "there").mkdir(mode=0o755)
    made = make_private_dirs(tmp_path / "there" / "a" / "b")
    assert made == tmp_path / "there" / "a" / "b"
    assert (mode(tmp_path / "there"), mode(tmp_path / "there" / "a"), mode(made)) == (0o755, 0o700, 0o700)
    assert make_private_dirs(made) == made  # there already: fine
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        make_private_dirs(tmp_path / "file")


def test_files_are_created_0600_and_replaced_whole(tmp_path: Path, open_umask) -> None:
    files = make_private_dirs(tmp_path / "files")  # beside the conftest's model cache
    os.close(open_private(files / "log", os.O_WRONLY | os.O_APPEND))
    (files / "state.json").write_text("old")
    (files / "state.json").chmod(0o644)
    write_private(files / "state.json", '{"new": 1}')
    assert (mode(files / "log"), mode(files / "state.json")) == (0o600, 0o600)
    assert (files / "state.json").read_text() == '{"new": 1}'
    assert sorted(p.name for p in files.iterdir()) == ["log", "state.json"]  # no temporary file left


def test_a_private_dir_is_made_checked_or_refused(tmp_path: Path, open_umask) -> None:
    assert mode(private_dir(tmp_path / "new" / "kv", "KV tier directory")) == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        private_dir(tmp_path / "file", "KV tier directory")
    (tmp_path / "open").mkdir(mode=0o777)
    with pytest.raises(UnsafeDirectory, match=r"KV tier directory .*open: writable by its group or by everyone"):
        private_dir(tmp_path / "open", "KV tier directory")
    assert mode(tmp_path / "open") == 0o777  # refused, not changed: the user decides what it should be


def test_an_actors_log_is_0600_in_directories_made_0700(tmp_path: Path) -> None:
    """``redirect_output`` takes over the process's stdout and stderr, so it runs in a process of its own."""
    log = tmp_path / "run" / "logs" / "engine-0.log"
    code = "import os, sys; os.umask(0); from orchestrator.logs import redirect_output; redirect_output(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(log)], check=True, cwd=REPO_ROOT)
    assert (mode(log), mode(log.parent), mode(log.parent.parent)) == (0o600, 0o700, 0o700)


def test_the_controllers_snapshot_is_0600(tmp_path: Path, open_umask) -> None:
    EventLog(tmp_path, lambda: {"phase": "ready"}).write()
    assert mode(tmp_path / SNAPSHOT_NAME) == 0o600
    assert EventLog(tmp_path, dict).read() == {"phase": "ready"}


def test_the_state_directory_and_its_lock_are_private(tmp_path: Path, monkeypatch, open_umask) -> None:
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path / "state" / "run"))
    with cluster._starting_lock():
        pass
    state = tmp_path / "state" / "run"
    assert (mode(tmp_path / "state"), mode(state), mode(state / "up.lock")) == (0o700, 0o700, 0o600)
    assert (state / "up.lock").read_text() == f"pid {os.getpid()}"
