"""Verify an artifact: every chunk's checksum and structure, and optionally every tensor against
the source checkpoint (lossless tensors bit for bit; NF4 tensors by quantizing the source again
and comparing the bytes, with error statistics beside), group by group: a group's chunks and
source tensors are let go before the next group's are read."""

from __future__ import annotations

from dataclasses import dataclass, field

from lct.conversion.policy import DEFAULT_BUDGET_KL
from lct.errors import LCTError, OptionError, PolicyError
from lct.format.encodings import get_encoding
from lct.io.check import check_artifact
from lct.io.reader import Artifact, open_artifact


@dataclass
class TensorCheck:
    """One tensor compared with the source."""

    name: str
    encoding: str
    ok: bool
    max_err: float = 0.0
    mean_err: float = 0.0
    cosine: float = 1.0
    note: str = ""


@dataclass
class VerifyReport:
    """What ``verify`` found. ``ok`` is False if any chunk or lossless tensor failed."""

    chunks_checked: int = 0
    failures: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    quality: object = None      # a lct.conversion.quality.QualityReport when asked for
    cast: str | None = None     # the dtype the conversion cast float tensors to (policy.dtype):
                                # lossless ones are compared with the source cast to it

    @property
    def ok(self) -> bool:
        return not self.failures


def _compare(name, info, got, ref) -> TensorCheck:
    """``got`` is the stored tensor (an ``NF4Weight``/``Int8Weight`` for lossy ones), ``ref``
    the source's."""
    import torch
    enc = get_encoding(info.encoding)
    if enc.lossy:
        # The quantizers are deterministic (NF4 bit-exact with bitsandbytes): the source,
        # quantized again, must give the stored bytes. Error and cosine are extra information.
        kind = info.encoding
        if tuple(ref.shape) != tuple(got.shape):
            nan = float("nan")    # nothing was measured
            return TensorCheck(name, kind, False, nan, nan, nan,
                               note=f"shape {tuple(got.shape)} differs from the source's "
                                    f"{tuple(ref.shape)}")
        try:
            codes, scales = enc.quantize(ref, getattr(got, "blocksize", None), name)
        except PolicyError as e:    # a source no writer could have stored so
            nan = float("nan")
            return TensorCheck(name, kind, False, nan, nan, nan, note=str(e))
        stored = enc.parts(got)
        same = torch.equal(codes.reshape(-1), stored[0].reshape(-1)) and torch.equal(
            scales.reshape(-1), stored[1].reshape(-1).to(scales.dtype))
        del codes, scales
        deq = got.dequantize()
        # A source that holds exactly this table's dequantized values (its own `lct export`) is
        # the table, whether or not quantizing them again is exact (Q6_K's scale search is not).
        exported = not same and torch.equal(deq.to(ref.dtype), ref)
        max_err, mean_err, cos = _error_stats(deq, ref)
        return TensorCheck(name, kind, same or exported, max_err, mean_err, cos,
                           "" if same else "the source holds this table's dequantized values "
                           "(an export of it)" if exported else f"{enc.label} codes differ from "
                           f"the source quantized again")
    if info.stored_dtype != info.dtype:
        ref = ref.to(got.dtype)
    same = got.shape == ref.shape and got.dtype == ref.dtype and torch.equal(
        got.reshape(-1).view(torch.uint8), ref.contiguous().reshape(-1).view(torch.uint8))
    return TensorCheck(name, "plain", same, note="" if same else "differs from the source")


# Elements of a table compared at a time in float64 (8 MiB a temporary): the error statistics
# never hold a whole table in float64, which for a 262k-token vocabulary is gigabytes.
STATS_ELEMENTS = 1 << 20


def _error_stats(got, ref) -> tuple:
    """``(max |got - ref|, mean |got - ref|, cosine)`` of two tensors of one shape, in float64
    (a float32 dot product over tens of millions of elements drifts past 1), ``STATS_ELEMENTS``
    at a time."""
    import math

    a, b = got.reshape(-1), ref.reshape(-1)
    n = a.numel()
    if not n:
        return 0.0, 0.0, 1.0
    top, total, dot, aa, bb = 0.0, 0.0, 0.0, 0.0, 0.0
    for i in range(0, n, STATS_ELEMENTS):
        x, y = a[i:i + STATS_ELEMENTS].double(), b[i:i + STATS_ELEMENTS].double()
        err = (x - y).abs_()
        m = err.max().item()
        top = m if m > top or math.isnan(m) else top    # a NaN stays, as torch's max keeps it
        total += err.sum().item()
        dot += (x * y).sum().item()
        aa += (x * x).sum().item()
        bb += (y * y).sum().item()
    # as torch.nn.functional.cosine_similarity: each norm held at least at its eps (1e-8)
    cos = dot / (max(math.sqrt(aa), 1e-8) * max(math.sqrt(bb), 1e-8))
    return top, total / n, cos


def verify(artifact, *, against: str | None = None, revision: str | None = None,
           progress=None, quality: bool = False, text=None, max_tokens: int | None = None,
           quality_progress=None, layerwise: bool = False,
           expect: str | None = None, budget: float | None = None,
           quality_dtype=None) -> VerifyReport:
    """Check every chunk of ``artifact``; with ``against``, compare every tensor with the source.

    Args:
        artifact: an artifact path, an ``hf://org/name[@rev]`` address (pulled first), or an
            open ``Artifact``.
        against: the source folder or Hub id to compare with.
        revision: Hub revision of ``against``.
        progress: called as ``progress(group, done, total)`` after each group.
        quality: also load the artifact and score it against ``against`` on real text
            (``lct.conversion.quality.measure_quality``: perplexity of both, top-1 agreement, KL), from
            ``text`` (a file or folder; default: the sample shipped in ``lct.conversion.sample_text``), at
            most ``max_tokens`` scored tokens; ``quality_progress`` is called per block;
            ``layerwise`` streams the layers of both models (for models larger than memory);
            ``quality_dtype`` (a torch dtype) is what both compute in (default: float32
            where both models fit in half the memory available so, or layer-wise; else the
            artifact's, ``measure_quality``).
        expect: the digest the manifest must have (``sha256:...``, as ``lct info`` prints
            it); a different one is a failure.
        budget: the mean KL (nats) the quality check holds the artifact to (default: the
            budget its conversion was measured against, ``policy.measured.budget_kl``, else
            ``DEFAULT_BUDGET_KL``); ``report.quality.within_budget`` says, and ``lct verify
            --quality`` exits 1 when it is over.

    What a report that is OK proves: every chunk's stored bytes match their checksum and
    decode to what the manifest declares, every scale a lossy tensor stores is finite, every
    byte between chunks is zero, the side files are the ones recorded, and the tensors fill
    the model config.json builds, each of a type the model holds there (as ``lct.load``
    checks); with
    ``against``, every tensor equals the source's (lossless ones bit for bit, quantized ones
    quantized again, or dequantized where the source is the artifact's own export). What it
    does not: that the manifest is the one its writer wrote. Its
    checksums are xxh3_64, which anyone can compute again after an edit (two tensors of one
    shape exchanged, say): pin the artifact with ``expect`` (a digest recorded when you
    trusted it), or pull it at a commit.

    Returns:
        A ``VerifyReport``; ``report.ok`` tells whether everything matched.
    """
    if quality and against is None:
        raise LCTError("a quality check needs the lossless reference: pass the source as against")
    given = artifact if isinstance(artifact, Artifact) else None
    if given is None:
        from lct.cloud import local_or_open
        artifact = local_or_open(artifact)
    art = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
    report = VerifyReport(cast=art.cast_dtype)
    if expect is not None:
        try:
            art.check_digest(expect)
        except OptionError:         # not a digest at all (expect=123): the caller's error
            if art is not artifact:
                art.close()
            raise
        except LCTError as e:
            report.failures.append(str(e))
    src_tensors, src = {}, None
    if against is not None:
        from lct.conversion.source import resolve, scan
        src = resolve(against, revision)
        src_tensors = scan(src)
        stored = set(art.manifest.tensors) | set(art.manifest.ties)
        if src_tensors and not set(src_tensors) & stored:
            if art is not given:
                art.close()
            raise LCTError(f"{against}: shares no tensor name with the artifact {art.path} "
                           f"(a different model?)")
        for name in sorted(set(src_tensors) - stored):
            report.failures.append(f"{name}: in the source but not in the artifact")
    report.failures += model_misfits(art)
    missing = len(report.failures)
    try:
        checked = check_artifact(art, progress=progress, on_group=None if src is None else (
            lambda group, bufs: _check_group(art, group, bufs, src, src_tensors, report)))
    finally:
        if art is not given:
            art.close()
    report.chunks_checked = checked.chunks_checked
    report.failures[missing:missing] = checked.failures
    if quality:
        from lct.conversion.quality import DEFAULT_MAX_TOKENS, measure_quality
        report.quality = measure_quality(art.path, against, revision=revision, text=text,
                                         max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
                                         progress=quality_progress, layerwise=layerwise,
                                         dtype=quality_dtype)
        report.quality.budget_kl = budget if budget is not None else conversion_budget(art)
    return report


def conversion_budget(art) -> float:
    """The mean-KL budget ``art`` was converted under (``policy.measured.budget_kl``), else
    LCT's default (``DEFAULT_BUDGET_KL``)."""
    measured = (art.manifest.policy or {}).get("measured")
    b = measured.get("budget_kl") if isinstance(measured, dict) else None
    return float(b) if isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 \
        else DEFAULT_BUDGET_KL


def model_misfits(art) -> list:
    """What keeps the artifact's tensors from filling the model its config.json builds (names
    and shapes against transformers' skeleton on the meta device, with the checkpoint renames
    and ties the load applies; each tensor's stored type against what the model holds there,
    the check ``lct.load`` makes before it installs anything, ``StoredDtypes``), one line
    each: a ``verify`` that says OK means the artifact loads as a whole model."""
    from lct.errors import ArchitectureError
    from lct.loader.build import build_skeleton
    from lct.loader.source import StoredDtypes
    if not (art.path / "config.json").is_file():
        return [f"{art.path}: no config.json, so no model can be built from the artifact"]
    try:
        arch = build_skeleton(art)
    except (ArchitectureError, LCTError) as e:
        return [f"{art.path / 'config.json'}: {e}"]
    shapes = {n: t.shape for n, t in art.manifest.tensors.items()}
    out = [f"{art.path}: {m}" for m in arch.misfits(shapes)]
    check = StoredDtypes(art, arch)
    for name in art.manifest.tensors:
        try:
            check(name, arch.target(name)[0])
        except LCTError as e:
            out.append(str(e))
    return out


def _check_group(art, group, bufs, src, src_tensors, report) -> None:
    from safetensors import safe_open
    handles: dict = {}  # each source file opened once per group, not once per tensor
    for info in art.manifest.group_tensors(group):
        if any(p.chunk not in bufs for p in info.placements()):
            continue  # a chunk of it failed its checksum: already reported
        names = [info.name] + [k for k, v in art.manifest.ties.items() if v == info.name]
        got = art.assemble(info, bufs, dequantize=False)
        for name in names:
            st = src_tensors.get(name)
            if st is None:
                if name == info.name:
                    report.failures.append(f"{name}: in the artifact but not in the source")
                continue
            if st.file not in handles:
                handles[st.file] = safe_open(str(src.root / st.file), framework="pt")
            ref = handles[st.file].get_tensor(name)
            check = _compare(name, info, got, ref)
            report.tensors.append(check)
            if not check.ok:
                report.failures.append(f"{name}: {check.note}")
