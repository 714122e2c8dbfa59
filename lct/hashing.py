"""File hashes LCT records and checks (the sha256 of source files, side files and the Maximus
state) and git's blob id (what the Hub lists for a file kept in git), by hashlib alone: opening
and verifying an artifact needs no huggingface_hub. A leaf: the reader, the converter and the
hub layer all need it."""

from __future__ import annotations

import hashlib

_BLOCK = 1 << 20    # bytes read at a time


def sha256_file(path) -> str:
    """Hex sha256 of the file at ``path``, read in blocks.

    Example:
        >>> sha256_file("config.json")   # doctest: +SKIP
        '3f1c...'
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def git_blob_id(data: bytes) -> str:
    """Git's object id of a file holding ``data`` (``git hash-object``): the sha1 of
    ``b"blob <size>\\0"`` followed by the bytes, as the Hub's ``blob_id`` gives it.

    Example:
        >>> git_blob_id(b"")
        'e69de29bb2d1d6434b8b29ae775ad8c2e48c5391'
    """
    h = hashlib.sha1(b"blob %d\0" % len(data), usedforsecurity=False)   # git's id
    h.update(data)
    return h.hexdigest()
