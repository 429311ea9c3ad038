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
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from connectors.errors import UnsafeDirectory

__all__ = ["DIR_MODE", "FILE_MODE", "make_private_dirs", "open_private", "private_dir", "write_private"]

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
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeDirectory(
            f"{what} {path}: owned by uid {st.st_uid}, not this user (uid {uid}): another user could read, "
            "replace or delete what is kept there; use a directory of this user's own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(
            f"{what} {path}: writable by its group or by everyone (mode {stat.S_IMODE(st.st_mode):o}): others "
            f"could replace or delete what is kept there; `chmod 700 {path}`"
        )
    if st.st_mode & 0o077:
        os.chmod(path, DIR_MODE)
        logger.info("%s %s: mode %o narrowed to 700 (only this user reads it)", what, path, stat.S_IMODE(st.st_mode))
    return path
