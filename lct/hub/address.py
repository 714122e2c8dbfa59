"""Hub addresses: ``hf://org/name[@revision]`` and bare repo ids, parsed once for every layer
that takes them."""

from __future__ import annotations

import re

from lct.errors import HubURIError

HF_SCHEME = "hf://"
# A Hub repo id, "name" or "org/name": each part starts with a letter or digit.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")
MAX_REPO_ID = 96


def is_repo_id(text: str) -> bool:
    """Whether ``text`` reads as a Hub repo id (``name`` or ``org/name``), not a path."""
    return isinstance(text, str) and not text.startswith(("/", ".", "~")) and \
        REPO_ID.fullmatch(text) is not None and ".." not in text and len(text) <= MAX_REPO_ID


def parse_hf_uri(uri: str) -> tuple:
    """Split ``hf://org/name@revision`` (or ``org/name@revision``) into ``(repo_id, revision)``.

    The revision is optional (``None``: the default branch) and may contain slashes
    (``hf://org/name@refs/pr/1``); a URL-encoded one (``refs%2Fpr%2F1``) is decoded.

    Raises:
        HubURIError: not a model repo address.
    """
    from urllib.parse import unquote
    if not isinstance(uri, str):
        raise HubURIError(f"{uri!r}: expected a string like hf://org/name@revision")
    rest = uri[len(HF_SCHEME):] if uri.startswith(HF_SCHEME) else uri
    repo_id, sep, revision = rest.partition("@")
    if repo_id.startswith("/"):  # hf:///name: an empty owner, not the legacy repo "name"
        raise HubURIError(f"{uri}: not a Hub model address; expected hf://org/name[@revision]")
    repo_id = repo_id.rstrip("/")
    if repo_id.startswith(("datasets/", "spaces/")):
        raise HubURIError(f"{uri}: LCT artifacts live in model repos, not {repo_id.split('/')[0]}")
    if repo_id.startswith("models/") and repo_id.count("/") == 2:
        repo_id = repo_id[len("models/"):]
    if not is_repo_id(repo_id):
        raise HubURIError(f"{uri}: not a Hub model address; expected hf://org/name[@revision]")
    revision = unquote(revision) if sep else None
    if sep and not revision:
        raise HubURIError(f"{uri}: empty revision after '@'")
    return repo_id, revision


def split_address(address: str, revision: str | None = None) -> tuple:
    """``(repo_id, revision)`` from ``hf://org/name@rev`` or ``org/name``; an explicit
    ``revision`` wins over one in the address."""
    repo_id, rev = parse_hf_uri(address)
    return repo_id, revision or rev


def is_hf_uri(path) -> bool:
    """Whether ``path`` is an ``hf://`` address (a string starting with ``hf://``)."""
    return isinstance(path, str) and path.startswith(HF_SCHEME)


def where(repo_id: str, revision: str | None) -> str:
    """``org/name@revision`` (or ``org/name``) for messages."""
    return f"{repo_id}@{revision}" if revision else repo_id
