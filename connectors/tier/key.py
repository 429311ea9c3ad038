"""The KV tier's own MAC key: random, made once, kept in the tier's directory, readable only by its owner.

A tier's entries (``connectors.tier.store``) are MAC'd under a key of the tier,
not of the cluster. ``pdserve up`` makes a new cluster secret each time, so a
key derived from it would make a tier forget everything at a restart; the key
file lives as long as the directory, so a cluster started again loads what the
one before it stored, with no step of the user's.

``<root_dir>/pdserve-kv-tier.key``: ``pdserve kv tier key v1`` and 64 hex digits
(32 random bytes), two lines.

- **Made once.** The first engine to open the tier writes it
  (``private_files.write_private_once``: a temporary file created 0600 with
  ``O_EXCL``, hard-linked into place, which fails if the file is there); engines
  starting at once agree: those whose link lost read the winner's file.
- **Trusted only if private.** It must be a regular file of this user's that no
  one else may read or write (0600), in a tier directory of this user's that no
  one else may write (``private_files.private_dir``; 0700). Otherwise the engine
  does not start: ``UnsafeDirectory`` names the file and why. A key others
  could read is a key others may hold, so it is refused, never narrowed.
- **Who is trusted.** Whoever can read this file can write an entry the tier
  loads: the directory's owner (and root), and no one else; any process of the
  owner's could write the directory anyway. An entry anyone else wrote, one
  altered or torn, one copied from another tier directory (another key) or
  of an older entry format (MAC'd under the cluster secret) is refused and its
  blocks are computed again.
- **Not bound to a cluster.** Every cluster that uses the directory shares its
  entries, as every engine of one cluster does: the default directory is the
  cluster's own (``~/.cache/pdserve/kv-tier/<name>``), and a user who points two
  clusters at one ``shared_path`` does so to share them (the namespace keeps
  another model, dtype or layout apart). To keep clusters apart, give them
  different directories; to forget a tier's entries, remove its key file.
- **Key id.** Eight hex digits of an HMAC of the key name the tier's namespace
  (``connectors.tier.fs_tier.namespace``): entries under a key that is no longer
  the file's are recognised by their directory and removed at start
  (``connectors.tier.cleanup``). The MAC key itself is another HMAC of the file's
  key, so neither name nor MAC gives the other.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from contract.errors import UnsafeDirectory
from contract.private_files import read_private, write_private_once

__all__ = ["KEY_FILE", "TierKey", "load_tier_key"]

logger = logging.getLogger(__name__)

KEY_FILE = "pdserve-kv-tier.key"
_FIRST_LINE = "pdserve kv tier key v1"
_KEY_BYTES = 32
_FILE_BYTES = len(_FIRST_LINE) + 1 + 2 * _KEY_BYTES + 1
_ENTRY_KEY_LABEL = b"pdserve kv tier entries v3"
_KEY_ID_LABEL = b"pdserve kv tier key id v1"
_SHORT_WAIT_S = 2.0
"""How long a reader waits for a key file shorter than a whole one (written in place, where the filesystem has
no hard links) before it is refused."""


@dataclass(frozen=True, slots=True)
class TierKey:
    """The MAC key of a tier's entries and the id that names its namespace; the key is never shown."""

    entry_key: bytes = field(repr=False)
    key_id: str
    path: Path

    @classmethod
    def of(cls, raw: bytes, path: Path) -> TierKey:
        """The keys derived from the key file's ``raw`` bytes."""
        return cls(
            entry_key=hmac.new(raw, _ENTRY_KEY_LABEL, hashlib.sha256).digest(),
            key_id=hmac.new(raw, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:8],
            path=path,
        )


def encode_key(raw: bytes) -> bytes:
    """A key file's contents for the key ``raw``."""
    return f"{_FIRST_LINE}\n{raw.hex()}\n".encode()


def _decode(data: bytes) -> bytes | None:
    lines = data.split(b"\n")
    if len(data) != _FILE_BYTES or len(lines) != 3 or lines[0] != _FIRST_LINE.encode() or lines[2]:
        return None
    try:
        return bytes.fromhex(lines[1].decode("ascii"))
    except ValueError:
        return None


def load_tier_key(root: Path, what: str = "KV tier") -> TierKey:
    """The key of the tier at ``root`` (a directory ``private_dir`` vouched for): read from its key file, made
    there first if there is none. ``UnsafeDirectory`` (naming the file and why) if the file is not a private
    one of this user's, or not a key file of ours."""
    path = Path(root) / KEY_FILE
    if not os.path.lexists(path) and write_private_once(path, encode_key(secrets.token_bytes(_KEY_BYTES))):
        logger.info("%s: made its key %s (the tier trusts entries made with it)", what, path)
    deadline = time.monotonic() + _SHORT_WAIT_S
    while True:
        data = read_private(path, f"{what} key file", max_bytes=_FILE_BYTES + 1)
        if (raw := _decode(data)) is not None:
            return TierKey.of(raw, path)
        if len(data) >= _FILE_BYTES or time.monotonic() > deadline:
            raise UnsafeDirectory(
                f"{what} key file {path}: not a pdserve KV tier key ({len(data)} bytes, expected {_FILE_BYTES} "
                f"starting {_FIRST_LINE!r}); remove it: a new key is made, and what the tier holds is computed again"
            )
        time.sleep(0.05)  # being written by another engine, in place
