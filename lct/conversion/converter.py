"""The converter: a Hugging Face safetensors checkpoint -> an LCT artifact, one group at a time.

Memory stays bounded by the largest group: a group's tensors are read from the source
(``safe_open``, files reopened per group so their mappings are released), copied into the chunk
buffer, encoded on all cores, written, and dropped before the next group is read.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from lct._version import __version__
from lct.arch import hf
from lct.arch.model import Architecture
from lct.conversion.policy import CALIBRATION_NONE, DEFAULT_BUDGET_KL, DEFAULT_CALIBRATION_TOKENS
from lct.conversion.source import Source, resolve, scan
from lct.errors import ArchitectureError, PolicyError, SourceError
from lct.format.encodings import encoding_keywords, get_encoding, is_lossy, lossy_encodings
from lct.format import constants as C
from lct.format.codecs import choose_codec
from lct.format.layout import TensorSpec, layout_group
from lct.format.manifest import Manifest
from lct.hashing import sha256_file, stop_when
from lct.io.writer import ArtifactWriter

Progress = Callable[[str, int, int], None]
Stage = Callable[[str], None]      # told what the converter starts now, besides encoding groups
log = logging.getLogger(__name__)


@encoding_keywords("lossy")
@dataclass
class Policy:
    """What the converter does with each tensor (stored in the manifest as ``policy``).

    The embedding and the LM head are the lossy candidates. With no part forced to a lossy
    encoding the policy is **auto**: for each of them (a tied table once) the converter
    measures what each registered lossy encoding would cost (``lct.conversion.policy``) and
    keeps the smallest encoding whose cost fits ``budget`` (mean KL of the next-token
    distribution, nats, for the whole artifact). ``lossy`` names the parts forced to each
    encoding instead, ``{encoding: parts}``, and each registered lossy encoding's name is a
    keyword too (``Policy(nf4=("embed",), int8=("head",))``; ``nf4=()``: all lossless; read
    back as ``policy.nf4``); the parts not named are then lossless.

    Example:
        >>> Policy(q8_0=("embed", "head")) == Policy(lossy={"q8_0": ("embed", "head")})
        True
    """

    lossy: dict | None = None       # {lossy encoding: the parts forced to it}; keywords too
    blocksize: int = C.DEFAULT_BLOCKSIZE
    dtype: str | None = None
    codec: str = C.CODEC_PLANES
    level: int = C.DEFAULT_LEVEL
    frame_size: int = C.DEFAULT_FRAME_SIZE
    maximus_shards: int | None = None
    budget: float = DEFAULT_BUDGET_KL
    calibration: str | None = None
    max_calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    tp_pieces: int | None = None    # store what the model's TP plan splits as this many pieces

    def parts(self) -> dict:
        """``{lossy encoding: the parts forced to it, or None}`` for every registered lossy
        encoding (``nf4``, ``int8``, ``int8_b128``, ``q8_0``, ``q6_k`` ...), in registry
        order."""
        return {e: self.lossy.get(e) for e in lossy_encodings()}

    @property
    def auto(self) -> bool:
        """Whether the lossy parts are chosen by measurement (no part forced)."""
        return not self.lossy

    def forced(self) -> dict:
        """``{role: encoding}`` of a manual policy (roles not named are lossless)."""
        out = {r: C.ENCODING_PLAIN for r in C.LOSSY_ROLES}
        for enc, parts in self.parts().items():
            out.update({r: enc for r in parts or ()})
        return out

    def check(self) -> None:
        """Raise ``PolicyError`` for options that cannot work."""
        if not isinstance(self.lossy, dict):
            raise PolicyError(f"lossy {self.lossy!r} must be a {{encoding: parts}} map",
                              option="lossy")
        unknown = [e for e in self.lossy if not is_lossy(e)]
        if unknown:
            raise PolicyError(f"{unknown[0]!r} is not a lossy encoding; use one of "
                              f"{', '.join(lossy_encodings())}", option="lossy")
        seen: dict = {}
        for option, parts in self.parts().items():
            bad = [r for r in parts or () if r not in C.LOSSY_ROLES]
            if bad:
                raise PolicyError(f"{option}: unknown part {bad[0]!r}; use none, embed, head or "
                                  f"embed,head", option=option)
            both = [r for r in parts or () if r in seen]
            if both:
                raise PolicyError(f"{seen[both[0]]} and {option} both name {both[0]!r}; give "
                                  f"each part one encoding", option=seen[both[0]])
            seen.update({r: option for r in parts or ()})
        if not self.auto and self.calibration not in (None, CALIBRATION_NONE):
            raise PolicyError("calibration text chooses the encodings, so it cannot go with "
                              "forced nf4/int8 parts", option="calibration")
        if not 0 < self.budget < 10:
            raise PolicyError(f"budget {self.budget} must be a mean KL in nats, above 0 and "
                              f"below 10 (default {DEFAULT_BUDGET_KL}, about +0.5 % perplexity)",
                              option="budget")
        if self.dtype is not None and self.dtype not in C.CAST_TARGETS:
            raise PolicyError(f"dtype {self.dtype!r} is not one of {C.CAST_TARGETS}",
                              option="dtype")
        if self.codec not in (C.CODEC_RAW, C.CODEC_ZSTD, C.CODEC_PLANES):
            raise PolicyError(f"codec {self.codec!r} is not one of raw, zstd, planes",
                              option="codec")
        lo, hi = C.ZSTD_LEVELS
        if not lo <= self.level <= hi:
            raise PolicyError(f"level {self.level} must be in {lo}..{hi}", option="level")
        if self.blocksize <= 0 or self.blocksize % 2:
            raise PolicyError(f"blocksize {self.blocksize} must be a positive even number",
                              option="blocksize")
        if self.tp_pieces is not None and (isinstance(self.tp_pieces, bool) or
                                           not isinstance(self.tp_pieces, int) or
                                           not 2 <= self.tp_pieces <= C.MAX_TP_PIECES):
            raise PolicyError(f"tp_pieces {self.tp_pieces!r} must be an integer in "
                              f"2..{C.MAX_TP_PIECES}", option="tp_pieces")
        if self.maximus_shards is not None and self.maximus_shards < 1:
            raise PolicyError(f"maximus_shards {self.maximus_shards} must be >= 1",
                              option="maximus_shards")
        if not 4096 <= self.frame_size <= C.MAX_FRAME_SIZE or self.frame_size % 4096:
            raise PolicyError(f"frame size {self.frame_size} must be a multiple of 4096 "
                              f"up to {C.MAX_FRAME_SIZE}")

    def to_dict(self, chosen: dict, decision=None) -> dict:
        """The manifest's ``policy``: ``chosen`` is ``{role: encoding}`` as written."""
        by = {e: [r for r in C.LOSSY_ROLES if chosen.get(r) == e] for e in lossy_encodings()}
        d = {"mode": "auto" if self.auto else "manual",
             # nf4 and int8 always (1.0 readers know them), a newer encoding when it is used
             **{e: roles for e, roles in by.items()
                if roles or e in (C.ENCODING_NF4, C.ENCODING_INT8)},
             "blocksize": self.blocksize, "dtype": self.dtype,
             "codec": self.codec, "level": self.level, "frame_size": self.frame_size,
             "maximus_shards": self.maximus_shards}
        if self.tp_pieces:
            d["tp_pieces"] = self.tp_pieces
        if decision is not None:
            d["measured"] = decision.to_dict()
        return d


@dataclass
class ConvertReport:
    """What ``convert`` did: the manifest plus timings."""

    manifest: Manifest
    path: Path
    seconds: float
    source_bytes: int
    unmapped: list = field(default_factory=list)
    decision: object = None     # the auto policy's ``lct.conversion.policy.Decision`` (None when forced)
    skipped_files: list = field(default_factory=list)   # [(name, why)] side files left out
    encode_seconds: float = 0.0     # after the policy's measurement: encoding, writing, publishing

    @property
    def mb_per_s(self) -> float:
        return self.source_bytes / 1e6 / max(self.seconds, 1e-9)


def _tensor_bytes(t) -> np.ndarray:
    import torch
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.numpy()


def _cast(t, target: str, name: str, path):
    import torch
    out = t.to(getattr(torch, target))
    overflow = torch.isfinite(t) & ~torch.isfinite(out)
    if overflow.any():
        worst = t[overflow].abs().max().item()
        raise PolicyError(f"{path}: tensor {name!r}: casting {t.dtype} to {target} overflows "
                          f"(|x| up to {worst:.4g} > {torch.finfo(out.dtype).max:.4g}); "
                          f"keep the source dtype", option="dtype")
    return out


def _sha_all(src: Source, cancel: threading.Event) -> dict:
    """``{file name: {"sha256", "size"}}`` of every source file read: weights and side files.
    Raises ``CancelledError`` within one block once ``cancel`` is set."""
    out = {}
    with stop_when(cancel):
        for fname in src.files + [p.name for p in src.sidecars()]:
            p = src.root / fname
            real = Path(os.path.realpath(p))
            if src.kind == "hub" and re.fullmatch(r"[0-9a-f]{64}", real.name):
                digest = real.name  # the Hub cache names LFS blobs by their sha256
            else:
                try:
                    digest = sha256_file(p)
                except OSError as e:
                    raise SourceError(f"{p}: cannot be read to record its hash "
                                      f"({e.strerror or e})") from e
            out[fname] = {"sha256": digest, "size": p.stat().st_size}
    return out


def _write_chunk(writer, layout, policy: Policy, src: Source, get) -> int:
    """Fill one chunk from the source tensors (``get(spec) -> (tensor, path)``), encode, write.

    Returns the number of source bytes consumed.
    """
    import torch
    buf = layout.allocate()
    done = 0
    for s in layout.specs:
        t, path = get(s)
        off = layout.offsets[s.name]
        enc = get_encoding(s.encoding)
        if enc.lossy:
            where = f"{path}: tensor {s.piece_of or s.name!r}"
            codes, scales = enc.quantize(t, s.blocksize, where)
            buf[off: off + s.nbytes] = codes.reshape(-1).view(torch.uint8).numpy()
            if s.absmax_nbytes:         # Q8_0 has its scales in its blocks
                a = layout.absmax_offsets[s.name]
                buf[a: a + s.absmax_nbytes] = scales.reshape(-1).view(torch.uint8).numpy()
        else:
            if s.stored_dtype != s.dtype:
                t = _cast(t, s.stored_dtype, s.piece_of or s.name, path)
            buf[off: off + s.nbytes] = _tensor_bytes(t)
        done += t.numel() * C.DTYPE_SIZES[s.dtype]
        del t
    width = layout.width_class if isinstance(layout.width_class, int) else None
    is_float = all(s.stored_dtype in C.FLOAT_DTYPES for s in layout.specs)
    codec, params = choose_codec(width if is_float else None, policy.codec)
    if codec != C.CODEC_RAW:
        params.update(level=policy.level, frame_size=policy.frame_size)
    writer.write_chunk(layout, buf, codec, params)
    return done


@dataclass
class MaximusLayout:
    """How the vocabulary tables are sharded: the state to store and the tensors to split."""

    state: dict
    meta: dict
    module_path: str
    pieced: dict        # group -> [TensorSpec] stored as frequency-ordered row pieces
    names: list

    def write(self, folder: Path) -> dict:
        """Write the state file into ``folder``; return the manifest's ``maximus`` entry."""
        from lct.format.maximus import write_state_file
        path = write_state_file({self.module_path: (self.state, self.meta)},
                                folder / C.MAXIMUS_FILE)
        return {"file": C.MAXIMUS_FILE, "sha256": sha256_file(path),
                "num_shards": int(self.state["maximus.shard_offsets"].numel() - 1),
                "tensors": self.names, "prefix": f"maximus.{self.module_path}.",
                "frequency_source": self.meta["frequency_source"]}


def _maximus_layout(src: Source, specs: dict, policy: Policy, token_freq) -> MaximusLayout:
    from lct.format.maximus import MaximusPolicy, default_budget, initial_state
    embed = next((s for s in specs.get(C.GROUP_EMBED, []) if s.role == "embed"), None)
    if embed is None or len(embed.shape) != 2:
        raise PolicyError(f"{src.root}: Maximus shards need a 2-D token embedding; none found",
                          option="maximus_shards")
    rows, dim = embed.shape
    n = policy.maximus_shards
    if not 1 <= n <= rows:
        raise PolicyError(f"maximus_shards {n} must be in 1..{rows} (the vocabulary size)",
                          option="maximus_shards")
    if (n - 1) * -(-rows // n) >= rows:      # shards of ceil(rows/n) rows: the last ones empty
        fits = max(k for k in range(1, n) if (k - 1) * -(-rows // k) < rows)
        raise PolicyError(f"maximus_shards {n} leaves empty shards for {rows} rows (shards of "
                          f"{-(-rows // n)} rows each); use {fits} or fewer",
                          option="maximus_shards")
    if token_freq is not None:
        from lct.conversion.freq import token_counts
        counts, freq_source = token_counts(token_freq, rows, src.root)
    else:
        import torch
        counts = torch.zeros(rows, dtype=torch.int64)
        freq_source = {"kind": "none", "path": None, "tokens": 0,
                       "note": "no frequency source given: shards are in token-id order"}
    pad = src.config.get("pad_token_id")
    pads = (pad,) if isinstance(pad, int) and 0 <= pad < rows else ()
    state = initial_state(counts, n, pads)
    pieced: dict = {}
    names = []
    for group in (C.GROUP_EMBED, C.GROUP_HEAD):
        for spec in list(specs.get(group, [])):
            if spec.role in ("embed", "head") and tuple(spec.shape) == (rows, dim):
                specs[group].remove(spec)
                pieced.setdefault(group, []).append(spec)
                names.append(spec.name)
    policy = MaximusPolicy(num_shards=int(state["maximus.shard_offsets"].numel() - 1),
                           budget_shards=default_budget(n))
    meta = {"policy": {"num_embeddings": rows, "embedding_dim": dim, **policy.to_metadata(),
                       "padding_idx": pads[0] if pads else None},
            "frequency_source": freq_source}
    return MaximusLayout(state, meta, embed.name.rpartition(".")[0], pieced, names)


def _write_pieced(writer, spec, src: Source, st, policy: Policy, row_order, cut) -> int:
    """Write ``spec`` as pieces, each an independent chunk (FORMAT.md 2.3): ``cut(table)``
    yields ``(piece spec fields, data)`` for each piece of the source tensor ``table``, in
    order. Returns the source bytes consumed."""
    from dataclasses import replace

    from safetensors import safe_open
    path = src.root / st.file
    with safe_open(str(path), framework="pt") as f:
        table = f.get_tensor(spec.name)
    writer.add_pieced(spec, row_order)
    done = 0
    for fields, data in cut(table):
        piece = replace(spec, piece_of=spec.name, **fields)
        done += _write_chunk(writer, layout_group(spec.group, [piece])[0], policy, src,
                             lambda s, data=data: (data, path))
    return done


def _maximus_cut(spec, mx: MaximusLayout):
    """A vocabulary table's pieces: one per Maximus shard, rows in frequency order."""
    def cut(table):
        table = table[mx.state["maximus.row_to_id"]]
        offsets = mx.state["maximus.shard_offsets"].tolist()
        for r0, r1 in zip(offsets, offsets[1:]):
            yield dict(name=f"{spec.name}[{r0}:{r1}]", shape=(r1 - r0, spec.shape[1]),
                       rows=(r0, r1)), table[r0:r1]
    return cut


def _tp_splits(src: Source, specs: dict, n: int, arch: Architecture) -> dict:
    """``{group: [(spec, axis)]}``: the 2-D weights the model's own tensor-parallel plan splits
    (column-wise: rows, axis 0; row-wise: columns, axis 1; the embedding by rows), taken out of
    ``specs`` to be written as ``n`` equal pieces. ``n`` must divide the attention and
    key/value heads and every split layer weight (else no rank degree dividing ``n`` could
    load it; ``PolicyError`` names the first); a vocabulary table whose rows ``n`` does not
    divide, or a lossy one split by columns, stays whole (a rank decodes it and keeps its
    slice). The plan names the model's parameters: a stored tensor is split when it fills one
    of them as it is (not through a converter)."""
    model = arch.model
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    if not plan:
        raise PolicyError(f"{src.root}: transformers has no tensor-parallel plan for "
                          f"{arch.class_name}; convert without tp_pieces", option="tp_pieces")
    for what in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, what, None)
        if heads is not None and heads % n:
            raise PolicyError(f"{src.root}: tp_pieces {n}: {what} = {heads} does not divide "
                              f"into {n}; tensor-parallel ranks need whole heads (pieces must "
                              f"divide {heads})", option="tp_pieces")
    rules = [(re.compile(r"(?:.+\.)?" + re.escape(k).replace(r"\*", r"\d+") + r"\.weight"),
              0 if style.startswith("colwise") else 1 if style.startswith("rowwise") else None)
             for k, style in plan.items()]
    out: dict = {}
    for group, group_specs in specs.items():
        for spec in list(group_specs):
            if len(spec.shape) != 2:
                continue
            target, pattern = arch.target(spec.name)
            axis = 0 if spec.role == "embed" else None if pattern is not None else next(
                (a for rx, a in rules if rx.fullmatch(target or "")), None)
            if axis is not None and spec.shape[axis] % n and spec.role not in ("embed", "head"):
                raise PolicyError(f"{src.root}: tp_pieces {n}: {spec.name} has {spec.shape[axis]} "
                                  f"{'rows' if axis == 0 else 'columns'} along the split, which "
                                  f"do not divide into {n} pieces", option="tp_pieces")
            if axis is None or spec.shape[axis] % n or \
                    (axis == 1 and spec.encoding != C.ENCODING_PLAIN):
                continue
            group_specs.remove(spec)
            out.setdefault(group, []).append((spec, axis))
    return out


def _tp_cut(spec, axis: int, n: int):
    """A weight's tensor-parallel pieces: ``n`` equal parts along ``axis`` (rows, or
    contiguous column blocks)."""
    def cut(table):
        rows, cols = spec.shape
        step = spec.shape[axis] // n
        for k in range(n):
            a, b = k * step, (k + 1) * step
            if axis == 0:
                yield dict(name=f"{spec.name}[{a}:{b}]", shape=(b - a, cols),
                           rows=(a, b)), table[a:b]
            else:
                yield dict(name=f"{spec.name}[:, {a}:{b}]", shape=(rows, b - a),
                           cols=(a, b)), table[:, a:b].contiguous()
    return cut


def convert(source: str, out, *, revision: str | None = None, policy: Policy | None = None,
            max_file_size: int = C.DEFAULT_MAX_FILE_SIZE, workers: int | None = None,
            overwrite: bool = False, progress: Progress | None = None,
            token_freq: str | None = None, stage: Stage | None = None,
            measuring: Progress | None = None) -> ConvertReport:
    """Convert a Hugging Face checkpoint to an LCT artifact.

    Args:
        source: a local model folder (single or sharded safetensors) or a Hub repo id.
        out: the artifact directory to create (atomically).
        revision: Hub revision (branch, tag or commit).
        policy: the encodings of the embedding and the head, cast dtype, codec and level
            (default: ``Policy()``, the auto policy: the smallest encoding of each within the
            quality budget; everything else lossless in its source dtype).
        max_file_size: start a new data file past this many bytes.
        workers: compression threads (default: all cores).
        overwrite: replace an existing artifact at ``out``.
        progress: called as ``progress(group, bytes_done, bytes_total)`` after each group.
        stage: called with a short description as each other stage starts (reading the
            model, measuring the lossy encodings, counting token frequencies, waiting for the
            source's hashes, publishing), so that no stage runs unannounced.
        measuring: called as ``measuring(what, tokens_done, tokens_total)`` while the policy
            runs the source model on its calibration text (``lct.conversion.policy.decide``).
        token_freq: with ``policy.maximus_shards``: a counts file (.json/.npy) or text
            file/folder tokenized with the model's tokenizer (default: token-id order).

    Returns:
        A ``ConvertReport`` with the validated manifest.

    Raises:
        SourceError, SourceNotFoundError: the source is missing or unusable.
        PolicyError: an option cannot be applied (blocksize, overflowing cast, dtype).

    Example:
        >>> convert("google/gemma-2b", "gemma-2b.lct")
    """
    from lct.cloud import is_cloud_uri
    from lct.io.reader import check_address
    from lct.proc import check_workers
    check_workers(workers)
    check_address(out)
    if is_cloud_uri(str(out)):
        return _convert_to_s3(source, str(out), revision=revision, policy=policy,
                              max_file_size=max_file_size, workers=workers,
                              overwrite=overwrite, progress=progress, token_freq=token_freq,
                              stage=stage, measuring=measuring)
    from lct.io.writer import check_output_path
    check_output_path(Path(out).absolute())     # before the source is read and measured
    t0 = time.perf_counter()
    policy = policy or Policy()
    policy.check()
    if token_freq is not None and not policy.maximus_shards:
        raise PolicyError("token frequencies order the Maximus shards: give maximus_shards too "
                          "(they were ignored)", option="token_freq")
    say = stage or (lambda text: None)
    src = resolve(source, revision)
    tensors = scan(src)
    say(f"reading {src.id}: {len(tensors)} tensors in {len(src.files)} file(s)")
    arch = _architecture(src, tensors)
    tie_flag = bool(src.config.get("tie_word_embeddings", True))
    placed = {name: arch.place(name) for name in tensors}
    unmapped = sorted(n for n in tensors if arch.target(n)[0] is None)
    ties = _find_ties(src, tensors, placed, arch)
    lossy, chosen, decision = _choose(src, tensors, placed, ties, arch, policy, say, measuring)
    t_encode = time.perf_counter()
    specs = _specs(src, tensors, placed, lossy, chosen, policy)
    log.info("%s: %s, %d tensors in %d groups; embed/head stored as %s", src.root,
             arch.class_name, len(tensors), len(specs),
             {r: e for r, e in chosen.items() if r in lossy})
    if decision is not None:
        log.info("%s", decision.summary())
    total = sum(int(np.prod(tensors[s.name].shape)) * C.DTYPE_SIZES[tensors[s.name].dtype]
                for g in specs.values() for s in g)
    # The source files are hashed beside the encoding; a failure there ends the conversion
    # (it is the provenance, and what verify checks the side files against).
    # An error or a Ctrl-C part-way through sets ``cancel``: the hashing stops within one block
    # instead of reading the rest of the source before the process can exit.
    cancel = threading.Event()
    hasher = ThreadPoolExecutor(1, thread_name_prefix="lct-hash")
    hashes = hasher.submit(_sha_all, src, cancel)
    hasher.shutdown(wait=False)
    try:
        if policy.maximus_shards and token_freq is not None:
            say(f"counting token frequencies in {token_freq} for the Maximus shards")
        maximus_layout = _maximus_layout(src, specs, policy, token_freq) \
            if policy.maximus_shards else None
        splits = _tp_splits(src, specs, policy.tp_pieces, arch) if policy.tp_pieces else {}
        groups = arch.group_order(specs)
        with ThreadPoolExecutor(workers or os.cpu_count() or 1, thread_name_prefix="lct-encode") \
                as pool, ArtifactWriter(out, max_file_size=max_file_size, overwrite=overwrite,
                                        map_fn=pool.map) as writer:
            say(f"encoding {len(groups)} groups")
            _write_groups(writer, groups, specs, tensors, src, policy, maximus_layout, splits,
                          total, progress)
            for p in src.sidecars():
                writer.copy_file(p)
            maximus = maximus_layout.write(writer.staging) if maximus_layout else None
            if not hashes.done():
                say(f"hashing the source files (sha256 of {len(src.files)} weight file(s), "
                    f"recorded for lct verify)")
            files = hashes.result()
            say(f"syncing the data files to disk and publishing {out}")
            manifest = writer.finish(
                groups=groups,
                source={"id": src.id, "kind": src.kind, "revision": src.revision,
                        "files": files},
                architecture={"model_type": src.model_type, "tie_word_embeddings": tie_flag,
                              "mapping": f"transformers {hf.version()}", **arch.summary()},
                policy=policy.to_dict(chosen, decision), ties=ties, unmapped=unmapped,
                created_by=f"lct {__version__}", maximus=maximus)
    finally:
        cancel.set()        # done by now on success
    done = time.perf_counter()
    return ConvertReport(manifest, Path(out), done - t0, total, unmapped, decision,
                         src.skipped_sidecars(), done - t_encode)


def _architecture(src: Source, tensors: dict) -> Architecture:
    """The model the source's config.json builds, read from transformers (``lct.arch``), after
    checking that the stored tensors fill it: every tensor has a place of the shape it is
    stored in, and every parameter a tensor (or a tie). Anything else would convert, then fail
    to load (or load a partial model), so it is refused here, naming the architecture and the
    first tensor or parameter that does not fit."""
    path = src.root / "config.json"
    if not path.is_file():
        raise SourceError(f"{src.root}: no config.json; LCT reads the model's layers, ties and "
                          f"checkpoint names from the model transformers builds from it, and "
                          f"a load needs it too")
    from lct.io.store import confined
    if not confined(path, src.root):
        raise SourceError(f"{path} is a link that leaves the model folder (to "
                          f"{path.resolve()}); LCT copies no file from outside a model folder "
                          f"and an artifact without its config would not load: copy the file "
                          f"in (cp --dereference)")
    try:
        arch = Architecture.from_folder(src.root, names=list(tensors))
    except ArchitectureError as e:
        raise SourceError(str(e) if str(e).startswith(str(path)) else f"{path}: {e}") from e
    misfits = arch.misfits({n: t.shape for n, t in tensors.items()})
    if misfits:
        first = misfits[0]
        beyond = arch.blocks_disagree(tensors)
        if beyond is not None:
            stack, built, held = beyond
            hint = (f"config.json builds {built} blocks of {stack}, the checkpoint holds "
                    f"{held}: the config's layer count (num_hidden_layers or its like) does "
                    f"not belong to these weights")
        elif "has no parameter for it" in first:
            hint = ("LCT keeps every tensor and a load must place each one (from_pretrained "
                    "would drop it with a warning): remove it from the checkpoint, or name in "
                    "config.json's 'architectures' the class the weights were saved from")
        elif "no stored tensor fills it" in first:
            hint = ("from_pretrained would initialise it at random; LCT never builds a partial "
                    "model: save the checkpoint whole (save_pretrained)")
        else:
            hint = "the config does not belong to these weights"
        raise SourceError(f"{path}: {len(misfits)} problem(s) between config.json and the "
                          f"weights, first: {first}; {hint}")
    return arch


def _find_ties(src: Source, tensors: dict, placed: dict, arch: Architecture) -> dict:
    """``{tied name: stored name}``: what the model ties (``arch.ties``, under the config's tie
    flags) and the checkpoint stores once. A tied tensor stored twice with equal contents (an
    embedding and its head both saved) is stored once: the copy leaves ``placed``; with other
    contents both are kept and the model does not tie them (as ``from_pretrained`` does)."""
    import torch
    from safetensors import safe_open
    stored = {arch.target(n)[0]: n for n in tensors if arch.target(n)[1] is None}
    ties = {}
    for tied, real in arch.ties.items():
        if real not in stored:
            continue
        copy = stored.get(tied)
        if copy is None:
            ties[tied] = stored[real]
            continue
        e, h = tensors[stored[real]], tensors[copy]
        if e.shape == h.shape and e.dtype == h.dtype and copy in placed:
            with safe_open(str(src.root / e.file), framework="pt") as fe, \
                    safe_open(str(src.root / h.file), framework="pt") as fh:
                if torch.equal(fe.get_tensor(e.name), fh.get_tensor(h.name)):
                    ties[copy] = e.name
                    del placed[copy]
    return ties


def _lossy_ok(st) -> bool:
    """Whether a source tensor may be stored lossy: a 2-D float table."""
    return st.dtype in C.FLOAT_DTYPES and len(st.shape) == 2


def _choose(src: Source, tensors: dict, placed: dict, ties: dict, arch, policy: Policy,
            say: Stage, measuring: Progress | None = None) -> tuple:
    """``(lossy, chosen, decision)``: the lossy candidates (``{role: first tensor name}``), the
    encoding of each role, and the auto policy's measurement (None when nothing lossy is asked
    for and nothing needs measuring)."""
    lossy: dict = {}
    for n, (_, r) in placed.items():
        if r in C.LOSSY_ROLES and _lossy_ok(tensors[n]):
            lossy.setdefault(r, n)
    chosen = None if policy.auto else policy.forced()
    if chosen and ties and chosen["embed"] != chosen["head"]:
        raise PolicyError(
            f"{src.root}: the embedding and the LM head are one tied table, so "
            f"{chosen['embed']} for the embedding and {chosen['head']} for the head cannot "
            f"both be honoured: give both parts one encoding, or neither (lossless)",
            option=next((e for e, p in policy.parts().items() if p), C.ENCODING_NF4))
    decision = None
    if chosen is None or any(chosen[r] != C.ENCODING_PLAIN for r in lossy):
        # auto: measure to choose; a forced lossy encoding: measure what it costs, to say so
        from lct.conversion.policy import decide
        if lossy:
            shapes = {r: tuple(tensors[n].shape) for r, n in lossy.items()}
            fit = [get_encoding(e).label for e in lossy_encodings()
                   if any(get_encoding(e).candidate(sh, policy.blocksize)
                          for sh in shapes.values())]
            say(f"measuring {', '.join(fit)} on {','.join(sorted(lossy))} ({_how(policy)})"
                + _unfit(src, lossy, shapes, policy))
        decision = decide(src, tensors, lossy, bool(ties), arch, policy, measuring)
        chosen = decision.chosen
    return lossy, chosen, decision


def _unfit(src: Source, lossy: dict, shapes: dict, policy: Policy) -> str:
    """``; not measured: ...``: the lossy encodings no table can take, and why (rows that are
    not whole blocks), for the measuring line; empty where every one fits. Where the
    ``--blocksize`` asked for leaves NF4 out (the default would have fit), also a warning, with
    NF4's own refusal: the option silently cost the smallest candidate."""
    out = []
    for e in lossy_encodings():
        enc = get_encoding(e)
        if any(enc.fits(sh, policy.blocksize) for sh in shapes.values()):
            continue
        row = min(sh[-1] if sh else 0 for sh in shapes.values())
        block = getattr(enc, "block", None) or policy.blocksize
        out.append(f"{enc.label}: rows of {row} values are not whole blocks of {block}")
        if e == C.ENCODING_NF4 and policy.blocksize != C.DEFAULT_BLOCKSIZE and \
                any(enc.fits(sh, C.DEFAULT_BLOCKSIZE) for sh in shapes.values()):
            part = sorted(lossy)[0]
            try:
                enc.check_source(shapes[part], policy.blocksize,
                                 f"{src.root}: tensor {lossy[part]!r}")
            except PolicyError as err:
                log.warning("%s: NF4 is not a candidate (the default blocksize %d fits)", err,
                            C.DEFAULT_BLOCKSIZE)
    return f"; not measured: {', '.join(out)}" if out else ""


def _how(policy: Policy) -> str:
    """What the policy measures on, for the progress line."""
    if policy.calibration == CALIBRATION_NONE:
        return "text-free proxy"
    return f"calibration text {policy.calibration}" if policy.calibration else \
        "LCT's calibration text where the model runs on it, else the text-free proxy"


def _specs(src: Source, tensors: dict, placed: dict, lossy: dict, chosen: dict,
           policy: Policy) -> dict:
    """``{group: [TensorSpec]}``: every kept tensor with its stored dtype and encoding."""
    specs: dict = {}
    for name, (group, role) in placed.items():
        st = tensors[name]
        encoding = chosen.get(role, C.ENCODING_PLAIN) if _lossy_ok(st) else C.ENCODING_PLAIN
        enc = get_encoding(encoding)
        enc.check_source(st.shape, policy.blocksize, f"{src.root / st.file}: tensor {name!r}")
        stored = enc.stored_dtype(st.dtype)
        if not enc.lossy and policy.dtype and st.dtype in C.FLOAT_DTYPES:
            stored = policy.dtype
        specs.setdefault(group, []).append(TensorSpec(
            name, st.shape, st.dtype, stored, encoding, role, group,
            policy.blocksize if enc.blocked else None))
    return specs


def _convert_to_s3(source: str, uri: str, *, overwrite: bool, stage, **kw) -> ConvertReport:
    """``convert`` to ``s3://bucket/prefix``: written to a local temporary folder, then pushed
    (``lct.cloud.push``: the manifest last, read back and checked) and the folder removed. The
    prefix must be new, which is checked before anything is converted."""
    import tempfile

    from lct import cloud
    from lct.cloud import ensure_new_prefix
    if overwrite:
        raise PolicyError(f"{uri}: an object store prefix is never overwritten; push to a new "
                          f"one", option="overwrite")
    ensure_new_prefix(uri)
    say = stage or (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="lct-convert-") as tmp:
        report = convert(source, Path(tmp) / "artifact.lct", stage=stage, **kw)
        say(f"uploading to {uri} (the manifest last), then reading every chunk back")
        cloud.push(report.path, uri)
    report.path = uri
    return report


def _write_groups(writer, groups: list, specs: dict, tensors: dict, src: Source, policy: Policy,
                  maximus_layout, splits: dict, total: int, progress) -> None:
    """Encode and write every group's chunks in order (Maximus and tensor-parallel pieces after
    their group's other chunks), reporting ``progress(group, bytes_done, total)``."""
    from safetensors import safe_open
    done = 0
    for group in groups:
        for layout in layout_group(group, specs[group]):
            files = {tensors[s.name].file for s in layout.specs}
            handles = {f: safe_open(str(src.root / f), framework="pt") for f in files}
            try:
                done += _write_chunk(writer, layout, policy, src, lambda s: (
                    handles[tensors[s.name].file].get_tensor(s.name),
                    src.root / tensors[s.name].file))
            finally:
                handles.clear()
        for spec in (maximus_layout.pieced.get(group, []) if maximus_layout else []):
            done += _write_pieced(writer, spec, src, tensors[spec.name], policy,
                                  C.ROW_ORDER_MAXIMUS, _maximus_cut(spec, maximus_layout))
        for spec, axis in splits.get(group, []):
            done += _write_pieced(writer, spec, src, tensors[spec.name], policy, None,
                                  _tp_cut(spec, axis, policy.tp_pieces))
        log.debug("group %s written (%d of %d source bytes)", group, done, total)
        if progress:
            progress(group, done, total)
