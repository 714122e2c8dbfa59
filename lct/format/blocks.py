"""What the block encodings share (llama.cpp's ``q8_0``, ``q6_k``; ``int8_b128``'s rows): a row is
whole blocks of ``block`` values, each ``block_bytes`` bytes holding its codes and scales."""

from __future__ import annotations

from lct.errors import PolicyError


def blocks_nbytes(numel: int, block: int, block_bytes: int) -> int:
    """Bytes of ``numel`` values in blocks of ``block`` values and ``block_bytes`` bytes."""
    return numel // block * block_bytes


def check_rows(shape, name: str, label: str, block: int) -> None:
    """Refuse (``PolicyError``) a shape whose rows do not split into whole blocks of ``block``
    values, naming the tensor ``name`` and the encoding ``label``."""
    if not shape or shape[-1] % block:
        raise PolicyError(f"{name}: {label} needs rows of a multiple of {block} values, "
                          f"got shape {tuple(shape)}")
