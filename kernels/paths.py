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

``force(path)`` (or ``LCT_HEAD_PATH=fused|tiled|chunked``) makes every head take one path where
it can run (tests, benchmarks); a path that cannot run there falls back to ``chunked``.
"""

from __future__ import annotations

import math
import os
import threading
import time

from lct.errors import OptionError

PATHS = ("fused", "tiled", "chunked")
ENV = "LCT_HEAD_PATH"
MEASURE_ROWS = 256      # rows of x a measurement uses at most (all paths scale alike past it)
MEASURE_RUNS = 5        # timed runs of each path at most
# A path this much slower than the best so far, after its first timed run and after its later
# ones, is timed no more (one run can be another process's burst: only a wide gap counts then).
DROP_RATIOS = (3.0, 1.5)
_MEASURE_WEIGHTS = 1 << 25
_MEASURE_MACS = 1 << 28

_forced: str | None = None
_chosen: dict = {}
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
        _chosen.setdefault(key, path)
        return _chosen[key]


def chosen() -> dict:
    """A copy of the choices made so far in this process, key -> path."""
    with _lock:
        return dict(_chosen)


def reset() -> None:
    """Forget every choice (the next call of each bucket measures again)."""
    with _lock:
        _chosen.clear()
