"""Files and directories only their owner may use: what pdserve writes holds prompts, keys and tokens.

KV tier entries are prompts' KV (their names say which prompts were asked),
logs name requests and engines, state files hold the cluster's token. So every
file pdserve creates is created 0600 and every directory 0700, by the mode
given to ``os.open`` / ``os.mkdir`` at creation: there is no moment when
another user could open it, as there would be with a chmod after the fact.
The umask only ever takes bits away from these, so none is needed to narrow
them. Files and directories that exist are left as they are, except where a
caller asks ``private_dir`` to vouch for one.

``private_dir`` is for a directory whose contents pdserve trusts (a KV tier's
root): one that exists must be this user's own and writable by nobody else
(``UnsafeDirectory`` otherwise); one that others may read is narrowed to 0700.
Its parents are not checked: a sticky or root-owned parent (``/dev/shm``,
``/tmp``, a home directory) is the common case, and whoever owns a parent can
replace the directory whatever its mode. The tier's entries carry a MAC, so a
replaced directory's contents are refused anyway; the mode keeps them unread.

A file pdserve trusts with a key (the KV tier's, ``connectors.tier.key``) is
made once by ``write_private_once`` (whole, 0600, the first of several writers
at once wins and the others read its file) and read by ``read_private``, which
refuses one that is not a regular file of this user's or that others may read
or write: a key others could read is a key others may hold, so it is not
narrowed like a directory, it is refused.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from contract.errors import UnsafeDirectory

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "make_private_dirs",
    "open_private",
    "private_dir",
    "read_private",
    "write_private",
    "write_private_once",
]

logger = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_private_dirs(path: str | os.PathLike[str]) -> Path:
    """``path`` and each missing parent, created 0700 (``mkdir -p`` would give the parents the umask's mode);
    those that exist are left as they are. Safe when another process creates them at the same time."""
    path = Path(path)
    missing: list[Path] = []
    here = path
    while not here.is_dir():
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            os.mkdir(directory, DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    return path


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open(path, flags | O_CREAT)``: a file it creates is 0600; one that exists keeps its mode."""
    return os.open(path, flags | os.O_CREAT, FILE_MODE)


def write_private(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace ``path`` with ``data``, whole (a reader sees the old or the new file, never half): a temporary
    file beside it, created 0600, renamed over it. The file is 0600 whatever mode the old one had."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def private_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path``, created 0700 (with its missing parents) if it is not there; if it is, it must be a directory
    of this user's that no one else may write into (``UnsafeDirectory`` names ``what`` it is for, the path and
    why not). One that others may read or enter is narrowed to 0700."""
    path = Path(path)
    if not os.path.lexists(path):
        make_private_dirs(path)
    try:
        st = os.stat(path)  # a symbolic link is judged by the directory it leads to
    except OSError as e:
        raise UnsafeDirectory(f"{what} {path}: cannot be used: {e.strerror or e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{what} {path}: not a directory")
    _require_ours(st, what, path, "another user could read, replace or delete what is kept there; use a directory "
                  "of this user's own")  # fmt: skip
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(
            f"{what} {path}: writable by its group or by everyone (mode {stat.S_IMODE(st.st_mode):o}): others "
            f"could replace or delete what is kept there; `chmod 700 {path}`"
        )
    if st.st_mode & 0o077:
        os.chmod(path, DIR_MODE)
        logger.info("%s %s: mode %o narrowed to 700 (only this user reads it)", what, path, stat.S_IMODE(st.st_mode))
    return path


_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
"""What ``link`` answers on a filesystem without hard links (vfat, some FUSE mounts)."""


def write_private_once(path: str | os.PathLike[str], data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists: True if this call made it, False if it was there
    (made earlier, or by another process at the same moment: the caller then reads the one that won).

    The file appears whole: a temporary file beside it, created 0600 with ``O_EXCL`` and ``fsync``ed, is
    hard-linked to ``path``, which fails if ``path`` exists, atomically (local filesystems and NFS alike).
    Where hard links are not supported, ``path`` itself is created with ``O_EXCL`` and written: a reader
    may see it shorter for a moment, so readers of such a file retry a short one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        try:
            _write_whole(fd, data)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path, follow_symlinks=False)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
            return _create_in_place(path, data)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _fsync_dir(path.parent)
    return True


def _create_in_place(path: Path, data: bytes) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return False
    try:
        _write_whole(fd, data)
    finally:
        os.close(fd)
    _fsync_dir(path.parent)
    return True


def _write_whole(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # a filesystem that cannot open or sync a directory still has the file
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_private(path: str | os.PathLike[str], what: str, max_bytes: int = 4096) -> bytes:
    """The bytes of ``path`` (at most ``max_bytes``), a file pdserve trusts: it must be a regular file, not a
    link, of this user's, that nobody else may read or write (``UnsafeDirectory`` names ``what`` it is, the
    path and why not; its directory is unsafe to trust while it holds it). ``FileNotFoundError`` if there
    is none. Judged on the open file, so it cannot be swapped between the check and the read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            why = "a symbolic link (pdserve trusts the file itself, not where a link leads)"
        else:
            why = f"cannot be read: {e.strerror or e}"
        raise UnsafeDirectory(f"{what} {path}: {why}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeDirectory(f"{what} {path}: not a regular file")
        _require_ours(st, what, path, "another user wrote it, or can replace it; remove it")
        if st.st_mode & 0o077:
            raise UnsafeDirectory(
                f"{what} {path}: its group or everyone may read or write it (mode {stat.S_IMODE(st.st_mode):o}, "
                f"not 600): another user may hold what it keeps; remove it, or `chmod 600 {path}` if no one "
                "else has read it"
            )
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def _require_ours(st: os.stat_result, what: str, path: Path | str, consequence: str) -> None:
    """``UnsafeDirectory`` unless this user owns what ``st`` describes; ``consequence`` says why it matters."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeDirectory(f"{what} {path}: owned by uid {st.st_uid}, not this user (uid {uid}): {consequence}")
