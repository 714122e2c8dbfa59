"""Sizes as users write them and as LCT prints them: one rule for every option that takes
bytes, one formatter for every size shown.

Decimal units (``KB``, ``MB``, ``GB``, ``TB``: powers of 1000) are read as huggingface_hub's
``save_pretrained(max_shard_size="5GB")`` reads them (``int(number * 1000**k)``; a test holds the
two equal); binary units (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024) as memory is
usually given; ``B`` is bytes. A number without a unit is refused (is ``16`` bytes or
gigabytes?); integers passed from Python are bytes.
"""

from __future__ import annotations

import re

from lct.errors import LCTError

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGT])(i?))?B\s*", re.I)
_NEGATIVE = re.compile(r"\s*-\s*[0-9]")


def parse_size(value, what: str = "size", option: str | None = None) -> int:
    """Bytes from ``"5GB"``, ``"500MB"``, ``"16GiB"``, ``"1.5TiB"`` or an ``int``.

    Raises:
        LCTError: no unit, an unknown unit, or a negative number, naming ``what``.

    Example:
        >>> parse_size("5GB"), parse_size("2GiB")
        (5000000000, 2147483648)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise LCTError(f"{what} must not be negative, got {value}", option=option)
        return value
    m = _SIZE.fullmatch(str(value))
    if not m:
        if _NEGATIVE.match(str(value)):
            raise LCTError(f"{what} must not be negative, got {value!r}", option=option)
        raise LCTError(f"{what} {value!r} needs a number with a unit: 5GB or 500MB (decimal) "
                       f"or 16GiB or 512MiB (binary)", option=option)
    number, prefix, binary = m.group(1), (m.group(2) or "").upper(), m.group(3)
    if not prefix:
        return int(float(number))
    return int(float(number) * (1024 if binary else 1000) ** ("KMGT".index(prefix) + 1))


def human(n: float) -> str:
    """Bytes as a short string in decimal units (``1.50 MB``, ``16.00 GB``), the one unit system
    of every size LCT prints: files, memory and plans alike, so that two commands' figures
    compare as printed (as huggingface_hub prints sizes).

    Example:
        >>> human(1_500_000), human(2 ** 30)
        ('1.50 MB', '1.07 GB')
    """
    base, units = 1000, ("B", "KB", "MB", "GB", "TB")
    sign, x = ("-" if n < 0 else ""), float(abs(n))
    for unit in units:
        if x < base or unit == units[-1]:
            return f"{sign}{x:.0f} B" if unit == "B" else f"{sign}{x:.2f} {unit}"
        x /= base
    raise AssertionError("unreachable")  # pragma: no cover
