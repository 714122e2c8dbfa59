"""Checking an open artifact end to end: every chunk against its checksum (and decoded, or
only its stored bytes; decoded, every stored scale of a lossy tensor finite), the Maximus state
file, the side files copied from the source.

``lct verify`` adds its comparison with the source through ``on_group``; ``lct push`` and
``lct pull`` run it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lct.errors import LCTError
from lct.format.codecs import checksum


@dataclass
class CheckReport:
    """What ``check_artifact`` found: ``problems`` as ``(file name, message)``, empty if all is
    well."""

    chunks_checked: int = 0
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def failures(self) -> list:
        """The problems' messages, one line each."""
        return [msg for _, msg in self.problems]


def check_artifact(art, *, decode: bool = True, side_files: bool = True, chunks: bool = True,
                   progress=None, on_group=None) -> CheckReport:
    """Check every chunk of the open artifact ``art``, group by group, and its Maximus state.

    Args:
        art: an open ``lct.io.reader.Artifact``.
        decode: decode each chunk too, and check that every scale a lossy tensor stores in it
            is finite (FORMAT.md 2.2) (False: only its stored bytes against the checksum, as a
            download check needs).
        side_files: also compare the side files with the source's sizes and hashes the
            manifest records.
        chunks: read the chunks (False: only the Maximus state and side files).
        progress: called as ``progress(group, done, total)`` after each group.
        on_group: called as ``on_group(group, chunks)`` with the group's decoded chunks
            (``{chunk id: array}``; a chunk that failed is absent), when ``decode``.

    Returns:
        A ``CheckReport``.
    """
    if art.closed:
        from lct.errors import ArtifactClosedError
        raise ArtifactClosedError(f"{art.path}: the artifact is closed; open it again to check "
                                  f"it")
    report = CheckReport()
    m = art.manifest
    if m.maximus is not None:
        try:
            art.maximus_state()      # its sha256 and permutation, as a load would check them
        except LCTError as e:
            report.problems.append((m.maximus.get("file"), str(e)))
    if side_files:
        report.problems += [(None, msg) for msg in art.check_side_files()]
    groups = art.groups if chunks else []
    if chunks:
        report.problems += art.check_gaps()
    for i, group in enumerate(groups):
        bufs = {}
        for chunk in m.group_chunks(group):
            report.chunks_checked += 1
            name = m.files[chunk.file]["name"]
            try:
                if decode:
                    bufs[chunk.id] = art.read_chunk(chunk.id)
                    got = checksum(bufs[chunk.id])
                    if chunk.decoded_checksum is not None and got != chunk.decoded_checksum:
                        report.problems.append((name, (
                            f"chunk {chunk.id} ({chunk.group}) decodes to bytes whose checksum is "
                            f"{got}; the manifest pins {chunk.decoded_checksum} "
                            f"(decoded_checksum)")))
                else:
                    view = art.read_stored(chunk)
                    view.release()
                    art.release(chunk)
            except LCTError as e:
                report.problems.append((name, str(e)))
        if decode:
            report.problems += _bad_scales(art, group, bufs)
        if on_group is not None and decode:
            on_group(group, bufs)
        if progress:
            progress(group, i + 1, len(groups))
    return report


def _bad_scales(art, group: str, bufs: dict) -> list:
    """``(file name, message)`` for each lossy tensor (or piece) of ``group`` whose stored scales
    hold a NaN or Inf (FORMAT.md 2.2: a stored scale MUST be finite), naming the first such
    block; a tensor whose chunk failed to decode is left out (already reported)."""
    from lct.format.encodings import get_encoding
    m = art.manifest
    out = []
    for info in m.group_tensors(group):
        enc = get_encoding(info.encoding)
        if not enc.lossy:
            continue
        for p in info.placements():
            if p.chunk not in bufs:
                continue
            bad = enc.bad_scale(art.tensor_from_buffer(p, bufs[p.chunk], dequantize=False))
            if bad is not None:
                name = m.files[m.chunks[p.chunk].file]["name"]
                out.append((name, f"{art.path / name}: chunk {p.chunk} ({group}): tensor "
                                  f"{p.name!r} ({info.encoding}) stores a scale that is not "
                                  f"finite, first at {bad} (FORMAT.md 2.2: a stored scale must "
                                  f"be finite)"))
    return out
