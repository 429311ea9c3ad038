"""The errors of the contract: every one it raises on purpose is a ``ContractError``."""

from __future__ import annotations


class ContractError(Exception):
    """Base of every error the contract package raises on purpose."""


class UnsafeDirectory(ContractError):
    """A directory pdserve would keep private data in (a KV tier's) is not this user's own, or others may
    write into it; the message names the directory and why."""
