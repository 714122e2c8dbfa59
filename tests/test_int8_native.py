"""The int8 per-row codec in the format's compiled module (lct/format/_native.c's
``int8_quantize``, ``int8_dequant``): bit for bit the torch rule of lct/format/int8.py
(``quantize_rows``; ``q.float() * scale`` cast by torch) on many rows (scales over float32's
range, exact .5 ties, zero rows, one huge value, subnormals, every finite bfloat16 and float16),
from every source dtype, at every instruction set this CPU runs and over several threads; the
first NaN/Inf row; and the torch fallback under ``LCT_NATIVE=0``. Skipped where the module was
not built or ``LCT_NATIVE=0`` (the fallback test runs everywhere)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lct.errors import PolicyError
from lct.format import int8
from lct.format import native as fnative

ROOT = Path(__file__).resolve().parents[1]
compiled = pytest.mark.skipif(not fnative.available(),
                              reason="lct.format._native not built, or LCT_NATIVE=0")
F32_MAX = float(np.finfo(np.float32).max)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _isas():
    if not fnative.available():
        return []
    return list(fnative.CODEC_ISAS[:fnative.CODEC_ISAS.index(fnative.codec_isa()) + 1])


def _kind(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _np(t):
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _reference(x):
    """The torch rule on ``x``'s rows: (codes int8, scales float32)."""
    rows, cols = int8.row_shape(tuple(x.shape))
    q, scale = int8.quantize_rows(x.reshape(rows, cols).to(torch.float32))
    return q.to(torch.int8), scale


def _quantize(x, threads=1, isa=None):
    """The compiled quantizer on ``x`` [rows, cols]: (first bad row, codes, scales); the outputs
    start as garbage so that a row left unwritten shows."""
    rows, cols = x.shape
    q = torch.full((rows, cols), 0x55, dtype=torch.int8)
    scale = torch.full((rows,), float("nan"))
    bad = fnative.int8_quantize(_np(x), _kind(x.dtype), q.numpy(), scale.numpy(), threads, isa)
    return bad, q, scale


def _same(got, want) -> bool:
    return torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int32),
                                                       want[1].view(torch.int32))


def _ties(e: int, m: int = 1):
    """A row whose scale is exactly m * 2^e (max |x| = 127 m 2^e) and whose other values are
    (k + 0.5) m 2^e: every x / scale an exact .5 tie, each of them, both signs."""
    k = np.arange(-127, 127) + 0.5
    return np.append(k, 127.0) * m * 2.0 ** e


def _rows(cols: int, rng) -> np.ndarray:
    """float64 rows of ``cols`` values at the rule's edges, in float32's range."""
    out = []
    for e in (0, -3, -20, -126, -130, -140, 10, 100):                   # exact ties
        for m in (1, 3, 5):
            t = _ties(e, m)
            if cols < t.size:   # the largest (the scale) and some of the others
                t = rng.permutation(np.append(rng.choice(t[:-1], cols - 1), t[-1]))
            out.append(np.resize(t, cols))
    out += [np.zeros(cols), -np.zeros(cols)]                            # zero rows
    for am in (F32_MAX, 1e38, 3e20, 1.0, 1e-30, 1e-38, 1e-40, 1e-43, 2.0 ** -143, 2.0 ** -144,
               2.0 ** -149, 127 * 2.0 ** -149, 1.5 * 127 * 2.0 ** -149):
        r = rng.standard_normal(cols) * am * 1e-3                       # one huge value
        r[rng.integers(cols)] = am * rng.choice([-1.0, 1.0])
        out.append(r)
        out.append(rng.uniform(-1, 1, cols) * am)                       # spread up to it
    one = np.zeros(cols)
    one[cols // 2] = -2.5
    out.append(one)
    for scale in 10.0 ** rng.uniform(-44, 37, 40):                      # many magnitudes
        out.append(rng.standard_normal(cols) * scale)
    for scale in (1e-2, 1.0, 7.0):                                      # integers and halves
        out.append(rng.integers(-400, 400, cols) / 2 * scale)
    a = np.array(out)
    with np.errstate(over="ignore"):
        return np.where(np.abs(a) > F32_MAX, np.sign(a) * F32_MAX, a)


def _table(dtype, cols: int, seed: int = 0):
    """Rows of ``dtype`` at the edges (float64 rows also between two float32 values, and
    above float32's largest where they round to it)."""
    rng = np.random.default_rng(seed + cols)
    a = _rows(cols, rng)
    if dtype in (torch.float16, torch.bfloat16):   # float32's largest is Inf in bfloat16
        big = torch.finfo(dtype).max
        a = np.clip(a, -big, big)
    x = torch.from_numpy(a).to(dtype)
    if dtype == torch.float64:
        f = torch.from_numpy(rng.standard_normal((6, cols)).astype(np.float32)).double()
        half = f.abs() * 2.0 ** -24                                     # half a float32 step
        x = torch.cat([x, f + half, f - half, f + half * 0.999, f * 0 + F32_MAX * (1 + 2.0 ** -25),
                       f * 0 - F32_MAX * (1 + 2.0 ** -25), f * 1e-46])
    return x


def _every_finite(dtype) -> list:
    """Every finite bfloat16 or float16 bit pattern, as rows of 127 in random order (rows mixing
    magnitudes) and as rows of 128 sorted by magnitude (rows of near magnitudes)."""
    v = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    v = v[torch.isfinite(v)]
    mixed = v[torch.randperm(v.numel(), generator=torch.Generator().manual_seed(1))]
    near = v[v.float().abs().argsort()]
    return [mixed[: v.numel() // 127 * 127].view(-1, 127),
            near[: v.numel() // 128 * 128].view(-1, 128)]


@compiled
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("dtype", DTYPES, ids=_kind)
@pytest.mark.parametrize("cols", [1, 7, 33, 255, 2049])
def test_quantize_is_the_torch_rule_bit_for_bit(isa, dtype, cols):
    x = _table(dtype, cols)
    want = _reference(x)
    for threads in (1, 3):
        bad, q, scale = _quantize(x, threads, isa)
        assert bad == -1 and _same((q, scale), want), (threads, isa)


@compiled
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_kind)
def test_quantize_every_finite_value(isa, dtype):
    for x in _every_finite(dtype):
        bad, q, scale = _quantize(x, 2, isa)
        assert bad == -1 and _same((q, scale), _reference(x))


@compiled
@pytest.mark.parametrize("isa", _isas())
def test_many_threads_split_the_rows(isa):
    """A table large enough for every thread to get rows (65536 elements a thread at least):
    any count of threads gives the same bytes, and the torch rule's."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(700, 1001, generator=g) * torch.rand(700, 1, generator=g) ** 8)
    x[::7] = 0
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        want = _reference(xd)
        for threads in (1, 2, 5, 10, 64, 200):
            bad, q, scale = _quantize(xd, threads, isa)
            assert bad == -1 and _same((q, scale), want), (dtype, threads)


@compiled
@pytest.mark.parametrize("dtype", DTYPES, ids=_kind)
@pytest.mark.parametrize("threads", [1, 4])
def test_quantize_reports_the_first_nan_or_inf_row(dtype, threads):
    """700 rows of 500 (4 threads: 175 each): the first bad row, whichever share holds it; every
    row before it written and the torch rule's."""
    x = torch.randn(700, 500, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = _reference(x)
    huge = 1e39 if dtype == torch.float64 else float("inf")   # Inf once in float32
    cases = [({(3, 5): float("nan"), (400, 0): float("inf")}, 3), ({(370, 499): -huge}, 370),
             ({(0, 0): float("-inf"), (699, 0): float("nan")}, 0), ({(699, 499): huge}, 699),
             ({(200, 0): float("nan"), (176, 3): float("-inf")}, 176)]
    for put, first in cases:
        y = x.clone()
        for at, v in put.items():
            y[at] = v
        bad, q, scale = _quantize(y, threads)
        assert bad == first, put
        assert _same((q[:first], scale[:first]), (want[0][:first], want[1][:first]))
        with pytest.raises(PolicyError, match=rf"t: int8 cannot encode NaN or Inf values "
                                              rf"\(row {first}\)"):
            int8.quantize(y, "t")


@compiled
def test_float64_rounds_to_float32_first():
    """float64 values round to float32 (to nearest even) before the rule, as torch's cast: a
    value above float32's largest that rounds to it is kept, one that rounds to Inf is refused."""
    x = torch.tensor([[F32_MAX * (1 + 2.0 ** -25), 1.0], [1.0 + 2.0 ** -24, 0.5]],
                     dtype=torch.float64)
    assert _same(_quantize(x)[1:], _reference(x))
    assert float(_quantize(x)[2][0]) == np.float32(F32_MAX) / np.float32(127)
    x[0, 1] = F32_MAX * (1 + 2.0 ** -24)
    assert _quantize(x)[0] == 0


@compiled
@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn], ids=_kind)
def test_public_api_shapes_and_layouts(dtype, monkeypatch):
    """int8.quantize over the compiled loop equals its torch fallback: 1-D, 3-D, a transposed
    (not contiguous) table in pieces, no rows, no columns, a tensor that requires grad, and a
    dtype read after widening (float8)."""
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(1001, generator=g), torch.randn(3, 5, 77, generator=g),
               torch.randn(300, 40, generator=g).t(), torch.zeros(0, 8), torch.zeros(4, 0),
               torch.tensor(2.5), torch.randn(6, 9, generator=g)]
    tensors = [t.to(dtype) for t in tensors]
    if dtype.itemsize > 1:
        tensors[-1].requires_grad_()
    monkeypatch.setattr(int8, "PIECE_ELEMENTS", 1000)
    fast = [int8.quantize(t) for t in tensors]
    monkeypatch.setattr(fnative, "_ENABLED", False)
    for t, got in zip(tensors, fast):
        assert _same(got, int8.quantize(t)), tuple(t.shape)
        assert _same(got, _reference(t.detach())), tuple(t.shape)


def _scales(rng, rows: int) -> np.ndarray:
    """float32 scales over the whole range: subnormal, huge (q * scale overflows bfloat16,
    float16 or float32), zero, negative, Inf and NaN (a damaged file's)."""
    s = (10.0 ** rng.uniform(-45, 38.5, rows)).astype(np.float32) * \
        rng.choice([-1, 1], rows).astype(np.float32)
    s[:12] = [0.0, -0.0, 2.0 ** -149, 1e-40, F32_MAX, 3e36, np.inf, -np.inf, np.nan, 65504 / 127,
              65520 / 127, 2.0 ** -24]
    return s


@compiled
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_kind)
@pytest.mark.parametrize("threads", [1, 3])
def test_dequant_is_torch_bit_for_bit(isa, dtype, threads):
    """q * scale in float32 then torch's cast, on every code and scales over float32's range
    (NaN only in the same places: torch's own NaN bits differ between its paths)."""
    rng = np.random.default_rng(5)
    rows, cols = 4000, 259
    q = torch.from_numpy(rng.integers(-128, 128, (rows, cols), dtype=np.int8))
    q[:, :256] = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    scale = torch.from_numpy(_scales(rng, rows))
    want = (q.float() * scale[:, None]).to(dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    fnative.int8_dequant_into(q.numpy(), scale.numpy(), _np(out), _kind(dtype), threads, isa)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits)[~nan], want.view(bits)[~nan])


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=_kind)
def test_public_dequantize_equals_the_fallback(dtype, monkeypatch):
    g = torch.Generator().manual_seed(6)
    q, scale = int8.quantize(torch.randn(3, 50, 31, generator=g) * 100)
    fast = int8.dequantize(q, scale, (3, 50, 31), dtype)
    into = torch.empty(3, 50, 31, dtype=dtype)
    assert int8.dequantize(q, scale, (3, 50, 31), dtype, out=into).data_ptr() == into.data_ptr()
    monkeypatch.setattr(fnative, "_ENABLED", False)
    slow = int8.dequantize(q, scale, (3, 50, 31), dtype)
    assert fast.shape == slow.shape == (3, 50, 31)
    assert torch.equal(fast, slow) and torch.equal(into, slow)


@compiled
def test_bad_buffers_refused():
    x = np.zeros((4, 8), np.float32)
    q, s = np.empty((4, 8), np.int8), np.empty(4, np.float32)
    quant = fnative._native.int8_quantize
    with pytest.raises(ValueError, match="rows of 8"):
        quant(x, 0, q, s[:3], 8, 1, -1)                           # scales for 3 rows, 4 given
    with pytest.raises(ValueError, match="rows of 8"):
        quant(x, 0, q[:3], s, 8, 1, -1)
    with pytest.raises(ValueError, match="rows of 16"):            # 32 float32 as bfloat16: 64
        quant(x, 1, q, s, 16, 1, -1)
    with pytest.raises(ValueError, match="kind"):
        quant(x, 4, q, s, 8, 1, -1)
    with pytest.raises(ValueError, match="not rows"):
        quant(x, 0, q, s, -1, 1, -1)
    with pytest.raises(ValueError, match="not rows"):
        quant(x, 0, q, s, 2 ** 62, 1, -1)                         # rows * cols overflows
    with pytest.raises(ValueError, match="aligned"):
        quant(x.reshape(-1).view(np.uint8)[1:1 + 64].view(np.int16), 1, q, s, 8, 1, -1)
    with pytest.raises(ValueError, match="isa"):
        quant(x, 0, q, s, 8, 1, len(fnative.CODEC_ISAS))
    assert fnative.int8_quantize(x[:0], "float32", q[:0], s[:0], 3) == -1
    deq = fnative._native.int8_dequant
    with pytest.raises(ValueError, match="kind"):                  # float64 is not written
        deq(q, s, np.empty((4, 8), np.float64), 3, 8, 1, -1)
    with pytest.raises(ValueError, match="rows of 8"):
        deq(q, s, np.empty((4, 7), np.float32), 0, 8, 1, -1)
    with pytest.raises(ValueError, match="isa"):
        deq(q, s, x, 0, 8, 1, -2)


def test_fallback_when_native_is_turned_off():
    """LCT_NATIVE=0 turns the compiled codec off: the torch code then gives the same codes and
    scales (and dequantized values) as the compiled one here, or the torch rule's where the
    module is absent."""
    code = ("import hashlib, torch\n"
            "from lct.format import native, int8\n"
            "import test_int8_native as t\n"
            "x = t._table(torch.bfloat16, 301)\n"
            "q, s = int8.quantize(x)\n"
            "d = int8.dequantize(q, s, tuple(x.shape), torch.bfloat16)\n"
            "h = hashlib.sha256(q.numpy().tobytes() + s.numpy().tobytes()\n"
            "                   + d.view(torch.int16).numpy().tobytes()).hexdigest()\n"
            "print(native.available(), h)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    runs = {}
    for flag in ("0", "1"):
        run = subprocess.run([sys.executable, "-c", code], env=dict(env, LCT_NATIVE=flag),
                             cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert run.returncode == 0, run.stderr
        runs[flag] = run.stdout.split()
    assert runs["0"][0] == "False"
    assert runs["1"][0] == str(fnative._native is not None)
    assert runs["0"][1] == runs["1"][1]
