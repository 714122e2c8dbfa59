"""The two checks every part of a manifest's reading uses (lct/format/manifest.py, and the
encodings' own fields in lct/format/encodings.py): a rule broken is a ``ManifestError``
naming where."""

from __future__ import annotations

from lct.errors import ManifestError
from lct.format import constants as C


def fail(where: str, msg: str):
    """Raise ``ManifestError("{where}: {msg}")``."""
    raise ManifestError(f"{where}: {msg}")


def integer(v, where: str, what: str, lo: int = 0, hi: int = C.MAX_MANIFEST_INT) -> int:
    """``v`` if it is an int (not a bool) in ``[lo, hi]``, else a ``ManifestError``."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        fail(where, f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return v
