"""``lct verify --against`` streams (issue 37.6): it compares the artifact with its source group
by group and holds a lossy table's error statistics a slice at a time, so what it adds to the
memory of a plain verify is a few copies of the table in its own dtype, not the table in float64
several times over (a 0.54 GB Gemma 3 270M peaked at 9.2 GB)."""

import subprocess
import sys

import pytest

import lct
from lct.conversion.converter import Policy

PROBE = """
import resource, sys
import lct
art, src = sys.argv[1], sys.argv[2]
assert lct.verify(art).ok                   # the imports, the skeleton, every chunk decoded
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert lct.verify(art, against=src).ok
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_verify_against_the_source_holds_a_few_copies_of_a_table_at_most(tmp_path):
    from lct.demo import tiny
    vocab, hidden = 65536, 256
    src = tiny.save_tiny(tmp_path / "src", "llama", vocab_size=vocab, hidden_size=hidden,
                         intermediate_size=256)
    art = tmp_path / "a.lct"
    lct.convert(str(src), art, policy=Policy(int8_b128=("embed", "head")))
    table = vocab * hidden * 2                  # bytes of one bfloat16 table: 33.5 MB
    out = subprocess.run([sys.executable, "-c", PROBE, str(art), str(src)], check=True,
                         capture_output=True, text=True).stdout
    grew = int(out.split()[-1])
    # streamed: 4 to 5 tables (the source's, its dequantized copy, codes, the decoded chunk);
    # before, the float64 statistics made it 16 to 26
    assert grew < 10 * table, f"verify --against added {grew / 1e6:.0f} MB for a " \
                              f"{table / 1e6:.0f} MB table"


def test_the_streamed_statistics_are_those_of_the_whole_table(wide_srcs, tmp_path,
                                                              monkeypatch):
    """Max and mean error and cosine, computed a slice at a time (slices of 1000 elements
    here, so that every table takes many), equal the whole table's in float64."""
    import torch
    from safetensors import safe_open

    from lct.conversion import verifier
    src = wide_srcs["llama"]
    art = tmp_path / "a.lct"
    lct.convert(str(src), art, policy=Policy(int8_b128=("embed", "head")))
    monkeypatch.setattr(verifier, "STATS_ELEMENTS", 1000)
    rep = lct.verify(art, against=str(src))
    assert rep.ok
    lossy = {t.name: t for t in rep.tensors if t.encoding == "int8_b128"}
    assert set(lossy) == {"model.embed_tokens.weight", "lm_head.weight"}
    (f,) = src.glob("*.safetensors")
    with lct.open(art) as a, safe_open(str(f), framework="pt") as h:
        for name, t in lossy.items():
            x, y = a.read_tensor(name).double().reshape(-1), h.get_tensor(name).double().reshape(-1)
            assert x.numel() > 20 * 1000
            err = (x - y).abs()
            assert t.max_err == err.max().item()
            assert t.mean_err == pytest.approx(err.mean().item(), rel=1e-12)
            assert t.cosine == pytest.approx(
                torch.nn.functional.cosine_similarity(x, y, dim=0).item(), rel=1e-12)
