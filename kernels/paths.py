"""Which CPU path a quantized LM head takes for an input of M rows, chosen by measuring them on
this machine rather than by thresholds measured on another one.

The paths (``PATHS``):

- ``fused``: the compiled per-row kernel (``native.nf4_matmul`` ...): codes read in place, one
  weight row against a few rows of x. Memory-bound; the fastest for one or a few rows.
- ``tiled``: the compiled tiled kernel (``native.tiled_matmul``): tiles of rows dequantized into
  cache once, then multiplied with every row of x.
- ``chunked``: torch: 128 MiB of rows dequantized to the model dtype, then ``F.linear``. Also
  the only path without the compiled module, on a GPU, and for float16 or float64 outputs.

On a head's first call for a given (encoding, K, N, input and output dtype, torch's thread
count, M bucket), ``choose`` times each path on a slice of the real head with the real input
(at most ``MEASURE_ROWS`` of its rows) and keeps the fastest for the rest of the process. The
slice holds ``min(2**25, 2**28 / M)`` weights (16,384 rows of a 2,048-wide head up to M = 8,
fewer above, at least one tile), a different slice for every run so that none is timed from
cache; each path runs once untimed, then up to ``MEASURE_RUNS`` times, its fastest run kept,
until one path is clearly ahead (``choose``). Cost on the 256,000 x 2,048 head (2 cores): one
call of that bucket's path plus 50-220 ms, once per bucket, mostly the chunked path's
dequantize of its slices. M buckets: 1, 2, 3, 4, then half-octaves (6, 8, 12, 16, 24, 32 ...).

A choice is also kept for the next process on this machine (``MEMO``, a small JSON file in the
decoded cache's folder, ``lct.io.cache.cache_dir``), so that the measurement is paid once per
machine rather than on every start's first token (0.26 s of it for a 152,064 x 3,584 Q6_K head
here, against 0.03 s for the forward itself). The memo holds for one machine as measured: the
CPU's model, the compiled kernels' instruction set and build, torch's and LCT's versions; a memo of
another is measured over. ``LCT_CACHE=0`` keeps nothing (each process measures), as it keeps no
decoded copy. The file is read as untrusted: anything but a memo of this form is ignored (and
never overwritten: only a memo LCT wrote is replaced), and a choice it gives is only one of the
paths, each of which computes the same product.

``force(path)`` (or ``LCT_HEAD_PATH=fused|tiled|chunked``) makes every head take one path where
it can run (tests, benchmarks); a path that cannot run there falls back to ``chunked``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
import uuid

from lct.errors import LCTError, OptionError

log = logging.getLogger(__name__)

PATHS = ("fused", "tiled", "chunked")
ENV = "LCT_HEAD_PATH"
MEASURE_ROWS = 256      # rows of x a measurement uses at most (all paths scale alike past it)
MEASURE_RUNS = 5        # timed runs of each path at most
# A path this much slower than the best so far, after its first timed run and after its later
# ones, is timed no more (one run can be another process's burst: only a wide gap counts then).
DROP_RATIOS = (3.0, 1.5)
_MEASURE_WEIGHTS = 1 << 25
_MEASURE_MACS = 1 << 28

MEMO = "head-paths.json"     # the choices kept for the next process, in the cache's folder
MEMO_KIND = "lct-head-paths"
MEMO_MAX_BYTES = 1 << 16     # a few hundred keys at most: a larger file is not a memo of LCT's
MEMO_MAX_KEYS = 1024

_forced: str | None = None
_chosen: dict = {}
_memo: dict | None = None    # the memo file's choices for this machine, read once per process
_lock = threading.Lock()


def force(path: str | None) -> None:
    """Make every quantized head take ``path`` (one of ``PATHS``) where it can run, or choose by
    measurement again (``None``); overrides ``LCT_HEAD_PATH``.

    Raises:
        OptionError: ``path`` is not one of ``PATHS``.

    Example:
        >>> paths.force("tiled"); head(x); paths.force(None)
    """
    global _forced
    _forced = _check(path, "force()")


def forced() -> str | None:
    """The path ``force`` or ``LCT_HEAD_PATH`` imposes, or None.

    Raises:
        OptionError: ``LCT_HEAD_PATH`` names no path.
    """
    if _forced is not None:
        return _forced
    return _check(os.environ.get(ENV) or None, ENV)


def _check(path: str | None, where: str) -> str | None:
    if path is not None and path not in PATHS:
        raise OptionError(f"{where}: unknown head path {path!r}; expected one of "
                          f"{', '.join(PATHS)}", option=ENV)
    return path


def bucket(rows: int) -> int:
    """The largest M of ``rows``'s bucket: 1, 2, 3, 4, then 6, 8, 12, 16, 24, 32, ... (two per
    octave), every M above ``MEASURE_ROWS`` in one."""
    if rows <= 4:
        return rows
    if rows > MEASURE_ROWS:
        return MEASURE_ROWS + 1
    p = 1 << (rows - 1).bit_length()          # the power of two at or above rows
    return p * 3 // 4 if rows <= p * 3 // 4 else p


def slice_rows(out_features: int, in_features: int, rows: int, align: int = 64) -> int:
    """Output rows of the head that one measurement run uses (see the module's docstring)."""
    weights = min(_MEASURE_WEIGHTS, _MEASURE_MACS // max(1, min(rows, MEASURE_ROWS)))
    n = max(align, weights // in_features // align * align)
    return min(out_features, n)


def choose(key: tuple, run, candidates=PATHS) -> str:
    """The path for ``key`` (a head's shape, dtypes and M bucket): the cached choice, else the
    fastest of ``candidates`` by ``run(path, i)``, which runs ``path`` once on the measurement's
    ``i``-th slice. Every candidate runs once untimed, then up to ``MEASURE_RUNS`` times in turn,
    each keeping its fastest run (another process's bursts on the cores only slow runs down);
    after each turn a candidate ``DROP_RATIOS`` times slower than the best is dropped.

    Example:
        >>> choose(("nf4", 2048, 256000, "bfloat16", "bfloat16", 2, 8), run)
        'tiled'
    """
    with _lock:
        if key in _chosen:
            return _chosen[key]
    if len(candidates) == 1:
        return candidates[0]
    kept = _remembered().get(_key_text(key))
    if kept in candidates:
        with _lock:
            return _chosen.setdefault(key, kept)
    best = {p: math.inf for p in candidates}
    i = 0
    for p in candidates:
        run(p, i)
        i += 1
    live = list(candidates)
    for turn in range(MEASURE_RUNS):
        for p in live:
            t = time.perf_counter()
            run(p, i)
            best[p] = min(best[p], time.perf_counter() - t)
            i += 1
        fastest = min(best[p] for p in live)
        ratio = DROP_RATIOS[min(turn, len(DROP_RATIOS) - 1)]
        live = [p for p in live if best[p] <= ratio * fastest]
        if len(live) == 1:
            break
    path = min(candidates, key=lambda p: best[p])
    with _lock:
        path = _chosen.setdefault(key, path)
    _remember(key, path)
    return path


def chosen() -> dict:
    """A copy of the choices made so far in this process, key -> path."""
    with _lock:
        return dict(_chosen)


def reset() -> None:
    """Forget every choice of this process, and what it read of the memo (the next call of
    each bucket takes the memo's choice, or measures again)."""
    global _memo
    with _lock:
        _chosen.clear()
        _memo = None


def forget() -> bool:
    """Remove the memo (``lct cache prune --all``): every process after measures again. A file
    there that is not a memo LCT wrote is left. True where one was removed."""
    reset()
    where = memo_file()
    if where is None or _read_memo(where) is None:
        return False
    try:
        os.unlink(where)
    except OSError:
        return False
    return True


def memo_file():
    """The memo's path (``MEMO`` in ``lct.io.cache.cache_dir()``), or None where nothing is kept
    between processes (``LCT_CACHE=0``)."""
    from lct.io import cache
    try:
        if not cache.enabled(None):
            return None
    except LCTError:             # a bad LCT_CACHE value: the load that reads it says so
        return None
    return cache.cache_dir() / MEMO


def machine() -> str:
    """What a measurement holds for: this CPU's model, the compiled kernels' instruction set
    (``LCT_NATIVE_ISA`` caps it) and build (their file's size and time), torch's and LCT's
    versions."""
    import torch
    from lct._version import __version__
    from lct.kernels import native
    isa = "none"
    if native.available():
        built = os.stat(native._native.__file__)
        isa = f"{native.matmul_isa()} {built.st_size}@{built.st_mtime_ns}"
    return f"{_cpu()}; {isa}; torch {torch.__version__}; lct {__version__}"


@functools.lru_cache(maxsize=1)
def _cpu() -> str:
    """This CPU's model name (read once per process), or the machine's architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    return cpu or os.uname().machine


def _key_text(key: tuple) -> str:
    return "|".join(map(str, key))


def _read_memo(path) -> dict | None:
    """The memo at ``path`` as written (``{"kind", "machine", "choices"}``), or None where there
    is none or the file is not one (any other content, a link, not a regular file, too
    large)."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):      # a pipe or a device is not a memo
            return None
        data = os.read(fd, MEMO_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        memo = json.loads(data) if len(data) <= MEMO_MAX_BYTES else None
    except ValueError:
        return None
    ok = isinstance(memo, dict) and memo.get("kind") == MEMO_KIND \
        and isinstance(memo.get("machine"), str) and isinstance(memo.get("choices"), dict) \
        and len(memo["choices"]) <= MEMO_MAX_KEYS \
        and all(isinstance(k, str) and v in PATHS for k, v in memo["choices"].items())
    return memo if ok else None


def _remembered() -> dict:
    """``{key text: path}`` the memo holds for this machine (read once per process)."""
    global _memo
    with _lock:
        if _memo is not None:
            return _memo
    path, memo = memo_file(), None
    if path is not None:
        memo = _read_memo(path)
    choices = memo["choices"] if memo is not None and memo["machine"] == machine() else {}
    with _lock:
        _memo = dict(choices)
        return _memo


def _remember(key: tuple, path: str) -> None:
    """Add a measured choice to the memo for the next process: the file read again and
    replaced whole by a rename (a concurrent writer's choice may be lost, never half a file).
    A file there that is not a memo is left as it is; a failure to write only costs the next
    process the measurement."""
    where = memo_file()
    if where is None:
        return
    here = machine()
    old = _read_memo(where)
    if old is None and os.path.lexists(where):
        log.debug("%s is not LCT's memo of head paths: left as it is", where)
        return
    choices = dict(old["choices"]) if old is not None and old["machine"] == here else {}
    choices[_key_text(key)] = path
    if len(choices) > MEMO_MAX_KEYS:
        return
    tmp = where.with_name(f".{MEMO}.{uuid.uuid4().hex}.tmp")
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump({"kind": MEMO_KIND, "machine": here, "choices": choices}, f, indent=1)
        os.replace(tmp, where)
    except OSError as e:
        log.debug("could not keep the head path for the next process in %s: %s", where, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return
    with _lock:
        if _memo is not None:
            _memo[_key_text(key)] = path
