"""Reliability sweep (issue 12): damage to every file of a converted artifact (Maximus state and
side files included): a flipped bit at seeded positions and a truncation at seeded offsets, each
run through ``open`` + read every group, ``load`` and a full ``verify``.

Acceptable: a typed ``LCTError``; or, for the few bytes no reader uses (the zero padding between
chunks of a data file), a read and a load identical to the undamaged artifact. A damaged file
that ``verify`` passes is a failure for every file LCT lists (data files, ``lct.json``, the
Maximus state, the side files whose hashes the manifest records). ``LCT_DAMAGE_CASES`` sets the
positions per file (CI: 12); ``benchmarks/bench_reliability.py`` runs the full sweep.
"""

import os
import random
import shutil

import pytest
import torch
from test_mutations import IDS, _logits, _read_all, time_limit

import lct
from lct.conversion.converter import Policy
from lct.errors import LCTError

CASES = int(os.environ.get("LCT_DAMAGE_CASES", "12"))


@pytest.fixture(scope="module")
def subject(gemma_src, tmp_path_factory):
    """The tiny Gemma with a tokenizer and Maximus shards, converted; its data and logits."""
    from lct.demo import tiny
    src = tmp_path_factory.mktemp("dmg-src") / "m"
    shutil.copytree(gemma_src, src)
    tiny.save_tokenizer(src, vocab_size=256)
    path = tmp_path_factory.mktemp("dmg") / "a.lct"
    lct.convert(str(src), path, policy=Policy(maximus_shards=4))
    return path, _read_all(path), _logits(path)


def _files(path):
    return sorted(p.name for p in path.iterdir() if p.is_file())


def _outcome(path, tensors, logits, what: str) -> str:
    """'refused' (an LCTError from open/read, load or verify), 'unused' (reads and loads the
    same and verify passes: only allowed for bytes no reader uses), or an AssertionError."""
    with time_limit(30, what):
        try:
            got = _read_all(path)
            assert set(got) == set(tensors), f"{what}: other tensor names were read"
            for name, t in got.items():
                assert torch.equal(t, tensors[name]), f"{what}: {name} reads other bytes"
            with torch.no_grad():
                out = lct.load(path)(IDS).logits
            assert torch.equal(out, logits), f"{what}: the loaded model computes other logits"
            rep = lct.verify(path)
        except LCTError:
            return "refused"
        return "unused" if rep.ok else "refused"


def _unused_ranges(path, name: str) -> list:
    """Byte ranges of data file ``name`` that no chunk covers (header padding, gaps)."""
    import json
    m = json.loads((path / "lct.json").read_text())
    idx = next(i for i, f in enumerate(m["files"]) if f["name"] == name)
    used = sorted((c["offset"], c["offset"] + c["stored_size"]) for c in m["chunks"]
                  if c["file"] == idx)
    out, pos = [], 32      # the first 32 header bytes (magic, version, index, id) are read
    for a, b in used:
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    return out


@pytest.mark.parametrize("kind", ["flip", pytest.param("truncate", marks=pytest.mark.slow)])
def test_every_file_damaged_is_refused(subject, tmp_path, kind):
    path, tensors, logits = subject
    rng = random.Random(f"{kind}-12")
    work = tmp_path / "a.lct"
    shutil.copytree(path, work)
    counts = {"refused": 0, "unused": 0}
    for name in _files(path):
        original = (path / name).read_bytes()
        unused = _unused_ranges(path, name) if name.endswith(".lct") else []
        positions = sorted({rng.randrange(len(original)) for _ in range(CASES)} | {0})
        for pos in positions:
            if kind == "flip":
                data = bytearray(original)
                data[pos] ^= 1 << rng.randrange(8)
                (work / name).write_bytes(bytes(data))
            else:
                (work / name).write_bytes(original[:pos])
            what = f"{kind} {name} at {pos}"
            try:
                outcome = _outcome(work, tensors, logits, what)
            finally:
                (work / name).write_bytes(original)
            if outcome == "unused":
                assert kind == "flip" and any(a <= pos < b for a, b in unused), \
                    f"{what}: verify passed a damaged file LCT checks"
            counts[outcome] += 1
    assert counts["refused"] > 0
