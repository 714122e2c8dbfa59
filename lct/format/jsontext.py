"""JSON that LCT reads from an artifact, a source or a server, under the manifest's caps
(docs/FORMAT.md section 7): the size, and the count of objects and arrays checked before
parsing, so that no such text can exhaust the parser's recursion or memory."""

from __future__ import annotations

import json

from lct.errors import ManifestError
from lct.format import constants as C


def parse_json(text: bytes | str, where: str, error=ManifestError,
               max_bytes: int = C.MAX_MANIFEST_BYTES):
    """JSON that LCT reads from an artifact, a source or a server (a manifest, a config, a
    state file's metadata, an index), parsed under the manifest's caps (FORMAT.md section 7):
    at most ``max_bytes``, and at most one object or array per
    ``MANIFEST_BYTES_PER_CONTAINER`` bytes, checked before parsing (so deep nesting cannot
    exhaust the parser's recursion, nor many small containers its memory). Any failure is
    ``error`` naming ``where``."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    if len(raw) > max_bytes:
        raise error(f"{where}: {len(raw):,} bytes of JSON, the cap is {max_bytes:,}")
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > len(raw) // C.MANIFEST_BYTES_PER_CONTAINER + C.MANIFEST_CONTAINER_SLACK:
        raise error(f"{where}: {containers:,} JSON objects/arrays in {len(raw):,} bytes; at "
                    f"most one per {C.MANIFEST_BYTES_PER_CONTAINER} bytes")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{where}: not valid JSON ({str(e)[:200]})") from e


def read_json(path, error=ManifestError, max_bytes: int = C.MAX_MANIFEST_BYTES):
    """``parse_json`` of a file; ``error`` names the file when it cannot be read either."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from e
    return parse_json(raw, str(path), error, max_bytes)
