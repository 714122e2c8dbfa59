"""The Q6_K block encoding's codec (lct/format/q6_k.py), on both paths (the compiled loops and
the torch fallback): byte for byte llama.cpp's ``quantize_row_q6_K_ref`` on golden vectors
(tests/data/q6_k, made by llama.cpp's own functions: see cases.json), its dequantize bit for bit
the ``gguf`` package's, round-trip error bounds, the errors, and the spec's worked example
(docs/FORMAT.md section 2.2)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lct.errors import OptionError, PolicyError
from lct.format import constants as C
from lct.format import q6_k

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "q6_k"
CASES = json.loads((DATA / "cases.json").read_text())["cases"]
_NP = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "bfloat16": "<i2"}


def _case(name: str):
    """A golden case: (the source tensor in its dtype, the expected blocks [rows, bytes])."""
    c = CASES[name]
    a = np.frombuffer((DATA / c["input"]).read_bytes(), _NP[c["dtype"]]).reshape(c["shape"])
    t = torch.from_numpy(a.copy())
    if c["dtype"] == "bfloat16":
        t = t.view(torch.bfloat16)
    rows = int(np.prod(c["shape"][:-1]))
    blocks = np.frombuffer((DATA / c["blocks"]).read_bytes(), np.uint8).reshape(rows, -1).copy()
    return t, blocks


def _gguf_dequant(blocks: np.ndarray) -> np.ndarray:
    gguf = pytest.importorskip("gguf")
    with np.errstate(all="ignore"):     # d = Inf: Inf * 0 is NaN
        return gguf.quants.dequantize(blocks.reshape(-1, C.Q6_K_BLOCK_BYTES),
                                      gguf.GGMLQuantizationType.Q6_K).reshape(-1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantize_is_llama_cpp_byte_for_byte(name, native_mode):
    x, want = _case(name)
    got = q6_k.quantize(x)
    assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dequantize_is_llama_cpp_bit_for_bit(name, native_mode):
    x, blocks = _case(name)
    got = q6_k.dequantize(torch.from_numpy(blocks), tuple(x.shape))
    assert got.dtype == torch.float32 and tuple(got.shape) == tuple(x.shape)
    digest = hashlib.sha256(got.numpy().astype("<f4").tobytes()).hexdigest()
    assert digest == CASES[name]["dequantized_sha256"]


def _valid_random_blocks(n: int, seed: int) -> np.ndarray:
    """n blocks of random bytes with every kind of finite float16 d (subnormal, normal)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, C.Q6_K_BLOCK_BYTES), dtype=np.uint8)
    d = rng.integers(0, 0x7C00, n, dtype=np.uint16) | (rng.integers(0, 2, n, np.uint16) << 15)
    b[:, -2:] = d.view(np.uint8).reshape(n, 2)
    return b


def test_dequantize_is_gguf_and_casts_once(native_mode):
    x, golden = _case("edges")
    for blocks in (golden, _valid_random_blocks(300, 1)):
        n = blocks.size // C.Q6_K_BLOCK_BYTES * C.Q6_K_BLOCK
        want = _gguf_dequant(blocks)
        got = q6_k.dequantize(torch.from_numpy(blocks), (n,)).numpy()
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
        bf = q6_k.dequantize(torch.from_numpy(blocks), (n // 256, 256), torch.bfloat16)
        ref = torch.from_numpy(want).to(torch.bfloat16)
        assert torch.equal(bf.reshape(-1)[~torch.from_numpy(nan)], ref[~torch.from_numpy(nan)])
        f16 = q6_k.dequantize(torch.from_numpy(blocks), (n,), torch.float16)    # torch's cast
        assert torch.equal(f16[~torch.from_numpy(nan)],
                           torch.from_numpy(want).to(torch.float16)[~torch.from_numpy(nan)])
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    blocks = torch.from_numpy(golden)
    assert q6_k.dequantize(blocks, tuple(x.shape), torch.bfloat16, out=out).data_ptr() == \
        out.data_ptr()
    # A gathered row is the table's row: rows_of is the one rule of the torch paths.
    table = q6_k.dequantize(blocks, tuple(x.shape))
    row = q6_k.rows_of(blocks[3].view(-1, C.Q6_K_BLOCK_BYTES), torch.float32).reshape(-1)
    assert torch.equal(row, table[3])


def _codes(block: np.ndarray) -> np.ndarray:
    """A block's 256 codes L (0..63), read as FORMAT.md 2.2 words it: value 128h + 64n + 32p + l
    has its low bits in nibble n of ql[64h + 32p + l] and its high bits at bit 2(2n + p) of
    qh[32h + l]."""
    L = np.empty(256, np.int64)
    for h in range(2):
        for n in range(2):
            for p in range(2):
                for l in range(32):
                    low = (int(block[64 * h + 32 * p + l]) >> (4 * n)) & 0xF
                    high = (int(block[128 + 32 * h + l]) >> (2 * (2 * n + p))) & 3
                    L[128 * h + 64 * n + 32 * p + l] = low | high << 4
    return L


def test_ties_round_half_to_even(native_mode):
    """The golden row built for ties (tests/data/q6_k/cases.json, edges row 8): every x / dj
    that is exactly k + 0.5 is coded as round-half-to-even, which differs from C's roundf on
    about half of them."""
    x, want = _case("edges")
    row = x[8].numpy().reshape(2, 16, 16)
    got = q6_k.quantize(x[8:9]).numpy().reshape(2, C.Q6_K_BLOCK_BYTES)
    assert np.array_equal(got, want[8].reshape(2, -1))
    differ = 0
    for b in range(2):
        d = np.float32(got[b, 208:].view(np.float16)[0])
        dj = d * got[b, 192:208].view(np.int8).astype(np.float32)
        q = row[b] / dj[:, None]
        tie = q - np.floor(q) == 0.5
        codes = _codes(got[b]).reshape(16, 16) - 32
        assert np.array_equal(codes[tie], np.round(q[tie]))          # numpy's round: to even
        differ += int((np.round(q[tie]) != np.trunc(q[tie] + np.copysign(0.5, q[tie]))).sum())
    assert differ > 100


def test_paths_agree_on_many_magnitudes(monkeypatch):
    """The compiled loops and the torch rule, independent implementations, on blocks whose
    scales span float32 (subnormal d, overflowing d, squares that overflow)."""
    from lct.format import native
    if not native.available():
        pytest.skip("lct.format._native not built, or LCT_NATIVE=0")
    rng = np.random.default_rng(5)
    scale = 10.0 ** rng.uniform(-14, 21, (96, 1))
    x = torch.from_numpy((rng.standard_normal((96, 512)) * scale).astype(np.float32))
    x[5, :300] = torch.from_numpy(rng.integers(-64, 64, 300) / 2).float()     # ties
    x[7, 256:] = 0
    fast = q6_k.quantize(x)
    monkeypatch.setattr(native, "_ENABLED", False)
    assert torch.equal(q6_k.quantize(x), fast)


def test_round_trip_error(native_mode):
    """Each value within one step of its sub-block (|d * scale|) and, for Gaussian rows, a
    root-mean-square error under 2.5% of the values'."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 1024, generator=g) * torch.rand(48, 1, generator=g) * 4
    blocks = q6_k.quantize(x)
    y = q6_k.dequantize(blocks, tuple(x.shape))
    b = blocks.view(-1, C.Q6_K_BLOCK_BYTES)
    step = b[:, 208:].contiguous().view(torch.float16).float() * \
        b[:, 192:208].contiguous().view(torch.int8).float()
    err = (y - x).abs().view(-1, 16, 16)
    assert (err <= step.abs().unsqueeze(2)).all()
    rel = ((y - x).pow(2).mean(1) / x.pow(2).mean(1)).sqrt()
    assert rel.max() < 0.025, rel.max()


def test_pieces_do_not_change_the_bytes(monkeypatch, native_mode):
    x = torch.randn(40, 768)
    whole = q6_k.quantize(x)
    monkeypatch.setattr(q6_k, "PIECE_ELEMENTS", 768 * 3)
    assert torch.equal(q6_k.quantize(x), whole)
    assert torch.equal(q6_k.dequantize(whole, (40, 768)),
                       torch.from_numpy(_gguf_dequant(whole.numpy()).reshape(40, 768)))


def test_sources_of_other_dtypes_and_layouts(native_mode):
    x = torch.randn(6, 512, dtype=torch.float64)
    want = q6_k.quantize(x.float())
    assert torch.equal(q6_k.quantize(x), want)                        # widened then rounded
    assert torch.equal(q6_k.quantize(x.float().view(2, 3, 512)), want)  # leading dims: rows
    t = x.float().t().contiguous().t()                                 # not contiguous
    assert torch.equal(q6_k.quantize(t), want)
    p = torch.nn.Parameter(x.float())                                   # requires grad
    assert torch.equal(q6_k.quantize(p), want)


@pytest.mark.parametrize("bad,match", [
    (torch.arange(512, dtype=torch.int32).reshape(2, 256), "floating-point"),
    (torch.zeros(2, 300), "multiple of 256"),
    (torch.zeros(2, 32), "multiple of 256"),
    (torch.tensor(1.0), "multiple of 256"),
])
def test_what_q6_k_cannot_encode_is_refused(bad, match):
    with pytest.raises(PolicyError, match=match):
        q6_k.quantize(bad, "t.weight")


def test_nan_and_inf_name_the_row(native_mode):
    x = torch.zeros(5, 512)
    x[3, 400] = float("nan")
    with pytest.raises(PolicyError, match=r"t\.weight: Q6_K .*NaN or Inf.*row 3"):
        q6_k.quantize(x, "t.weight")
    x[3, 400] = 0
    x[1, 0] = float("-inf")
    with pytest.raises(PolicyError, match="row 1"):
        q6_k.quantize(x.to(torch.bfloat16), "t.weight")


def test_dequantize_refuses_what_does_not_fit():
    blocks = q6_k.quantize(torch.randn(2, 256))
    with pytest.raises(OptionError, match="blocks"):
        q6_k.dequantize(blocks, (3, 256))
    with pytest.raises(PolicyError, match="multiple of 256"):
        q6_k.dequantize(blocks, (4, 128))
    with pytest.raises(OptionError, match="out"):
        q6_k.dequantize(blocks, (2, 256), torch.float32, out=torch.empty(512, dtype=torch.bfloat16))
    with pytest.raises(OptionError, match="out"):
        q6_k.dequantize(blocks, (2, 256), torch.float32, out=torch.empty(511))


def test_sizes():
    assert q6_k.blocks_nbytes(2048) == 2048 // 256 * 210 == q6_k.row_bytes(2048)
    assert C.Q6_K_BLOCK_BYTES * 8 / C.Q6_K_BLOCK == 6.5625              # bits per value
    assert C.Q6_K_SUB_BLOCK == 16 and np.float32(C.Q6_K_GROUP_MAX_EPS) == np.float32(1e-15)
    # ql, qh, scales, d: the layout's parts fill the block.
    assert C.Q6_K_BLOCK // 2 + C.Q6_K_BLOCK // 4 + C.Q6_K_BLOCK // C.Q6_K_SUB_BLOCK + 2 == \
        C.Q6_K_BLOCK_BYTES


SPEC_HEX = """
00112233445566778899aabbccddeeff0022446688aaccee0022446688aaccee
00eeccaa88664422ffddbb997755331100ffeeddccbbaa998877665544332211
00112233445566778899aabbccddeeff0022446688aaccee0022446688aaccee
00eeccaa88664422ffddbb9977553311000f0e0d0c0b0a090807060504030201
8844444444444444000000000000000044000000000000001111111111111111
8844444444444444000000000000000004000000000000001111111111111111
80c03e7f80c03e7f80c03e7f80c03e00
0094
"""
SPEC_SHA256 = "08feefdc9f051f4c9dabf3ac08f3bc7d9512b194e53aa23204d46632d26d3a7a"


def test_spec_example_byte_for_byte(native_mode):
    """docs/FORMAT.md section 2.2's Q6_K worked example, its bytes as the spec prints them."""
    i = torch.arange(256)
    x = torch.where(i < 240, (i % 64 - 32) / 8, 0.0).float()
    b = q6_k.quantize(x).numpy().tobytes()
    assert b == bytes.fromhex("".join(SPEC_HEX.split()))
    assert hashlib.sha256(b).hexdigest() == SPEC_SHA256
    spec = (ROOT / "docs" / "FORMAT.md").read_text()
    assert SPEC_SHA256 in spec and all(line in spec for line in SPEC_HEX.split())
    assert b[192:] == bytes.fromhex("80c03e7f80c03e7f80c03e7f80c03e00 0094")
    codes = _codes(np.frombuffer(b, np.uint8))
    assert codes[:16].tolist() == list(range(16)) and codes[16:32].tolist() == list(range(0, 32, 2))
    assert not codes[240:].any()                    # the all-zero sub-block keeps its codes 0
    y = q6_k.dequantize(torch.frombuffer(bytearray(b), dtype=torch.uint8), (256,))
    # Sub-block 0: d * scale = -1/1024 * -128 = 1/8 and codes i, so its values come back exactly.
    assert torch.equal(y[:16], x[:16]) and torch.equal(y[240:], x[240:])
    assert float(y[33]) == -62 / 1024 * (30 - 32)


def test_fallback_when_native_is_turned_off():
    """LCT_NATIVE=0 turns the compiled codec off: the torch rule then gives the golden bytes."""
    code = ("import json, numpy as np, torch\n"
            "from lct.format import native, q6_k\n"
            "import test_q6_k as t\n"
            "x, want = t._case('edges')\n"
            "print(native.available(), np.array_equal(q6_k.quantize(x).numpy(), want))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               LCT_NATIVE="0")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_dequantize_there_and_quantize_on_the_cpu():
    x, blocks = _case("matrix")
    b = torch.from_numpy(blocks).cuda()
    got = q6_k.dequantize(b, tuple(x.shape))
    assert got.device.type == "cuda"
    digest = hashlib.sha256(got.cpu().numpy().astype("<f4").tobytes()).hexdigest()
    assert digest == CASES["matrix"]["dequantized_sha256"]
    bf = q6_k.dequantize(b, tuple(x.shape), torch.bfloat16)
    assert torch.equal(bf.cpu(), got.cpu().to(torch.bfloat16))
    assert np.array_equal(q6_k.quantize(x.cuda()).numpy(), blocks)
