"""Namespaces of other entry formats and keys in a tier's directory, removed when an engine opens it.

A tier's directory holds one namespace per entry format, key and engine layout
(``pdserve-v<format>-<key id>-<device>-<bytes per chunk>``, ``fs_tier.namespace``;
formats 1 and 2 carry no key id: ``pdserve-v2-cpu-<bytes>``) and the key file
(``connectors.tier.key``). An entry of another format or key is refused when read,
so nothing ever loads it; it only takes disk space outside the tier's byte budget,
which counts its own namespace. Each engine removes such namespaces when it opens
the tier (``remove_stale``), and logs what it removed:

- **Only namespaces that are recognisably ours and stale**: directories directly in
  the root named ``pdserve-v<N>-...`` with N below the current format, or N the
  current format and a key id that is not the key file's. A namespace of a newer
  format (a newer pdserve sharing the directory) is left alone, as is anything
  named otherwise, and a link.
- **In them, only what the tier writes**: files named as entries or as their
  temporary files (``<hex>.bin``, ``<hex>.bin.<32 hex>.tmp``), then the directories
  left empty. Any other file stays, with the directories that hold it: we never
  delete what we did not write.
- **A key file's writer that died** left its temporary file beside the key
  (``pdserve-kv-tier.key.<pid>.<hex>.tmp``): removed once it is a minute old.

Engines opening the tier at once each remove what they find; a file another took
first is simply gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from connectors.tier.key import KEY_FILE
from connectors.tier.store import VERSION

__all__ = ["Removed", "remove_stale"]

logger = logging.getLogger(__name__)

NAMESPACE = re.compile(r"pdserve-v(?P<version>\d+)-(?P<rest>.+)")
_KEY_ID = re.compile(r"(?P<key_id>[0-9a-f]{8})-.+")
_OURS = re.compile(r"[0-9a-f]+\.bin(\.[0-9a-f]{32}\.tmp)?")
_KEY_TMP = re.compile(re.escape(KEY_FILE) + r"\.\d+\.[0-9a-f]{8}\.tmp")
KEY_TMP_AGE_S = 60.0


@dataclass(slots=True)
class Removed:
    """What ``remove_stale`` removed: the entries and temporary files of how many stale namespaces, and the files
    it left there because they are not the tier's (a namespace holding none is gone whole)."""

    namespaces: int = 0
    files: int = 0
    bytes: int = 0
    foreign_files: int = 0


def is_stale(name: str, key_id: str) -> bool:
    """Whether ``name`` is a namespace of ours of an older entry format, or of the current one under another key."""
    match = NAMESPACE.fullmatch(name)
    if match is None:
        return False
    version = int(match["version"])
    if version != VERSION:
        return version < VERSION
    current = _KEY_ID.fullmatch(match["rest"])
    return current is not None and current["key_id"] != key_id


def remove_stale(root: Path, key_id: str, what: str = "KV tier") -> Removed:
    """Remove the stale namespaces of the tier at ``root`` (see the module's docstring) and log what went."""
    removed = Removed()
    stale = []
    with os.scandir(root) as children:
        for child in children:
            if child.is_dir(follow_symlinks=False) and is_stale(child.name, key_id):
                stale.append(Path(child.path))
            elif _KEY_TMP.fullmatch(child.name) and _age_s(child.path) > KEY_TMP_AGE_S:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child.path)
    for namespace in sorted(stale):
        _remove_namespace(namespace, removed)
    removed.namespaces = len(stale)
    if stale:
        logger.info(
            "%s at %s: cleaned %d namespace(s) of an older entry format or key (%s): removed %d files (%d bytes)%s",
            what,
            root,
            removed.namespaces,
            ", ".join(path.name for path in sorted(stale)),
            removed.files,
            removed.bytes,
            f"; left {removed.foreign_files} file(s) the tier did not write" if removed.foreign_files else "",
        )
    return removed


def _remove_namespace(namespace: Path, removed: Removed) -> None:
    for dirpath, subdirs, names in os.walk(namespace, topdown=False):
        removed.foreign_files += sum(os.path.islink(os.path.join(dirpath, d)) for d in subdirs)  # never followed
        for name in names:
            path = os.path.join(dirpath, name)
            if not _OURS.fullmatch(name) or os.path.islink(path):
                removed.foreign_files += 1
                continue
            with contextlib.suppress(FileNotFoundError):
                size = os.stat(path, follow_symlinks=False).st_size
                os.unlink(path)
                removed.files += 1
                removed.bytes += size
        with contextlib.suppress(OSError):  # not empty: it holds what is not ours
            os.rmdir(dirpath)


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path, follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return 0.0
