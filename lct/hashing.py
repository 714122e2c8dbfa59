"""File hashes LCT records and checks (the sha256 of source files, side files and the Maximus
state), read in blocks by huggingface_hub's hasher. A leaf: the reader and the converter both
need it."""

from __future__ import annotations


def sha256_file(path) -> str:
    """Hex sha256 of the file at ``path``."""
    from huggingface_hub.utils.sha import sha_fileobj
    with open(path, "rb") as f:
        return sha_fileobj(f).hex()
