"""Reliability sweep (issue 12): structured mutations of a real artifact's manifest, drawn by
hypothesis from a fixed seed, each resealed (its own checksum set again, as a tool that edits a
manifest would) and run through ``open`` + read every group, ``verify`` and ``load``.

The only acceptable outcomes: a typed ``LCTError``, or a change that is provably harmless (every
tensor reads back with the original's bytes, and the loaded model gives the original's logits
bit for bit). Anything else fails: another exception type, different data, or a case that runs
past its time limit. ``LCT_MUTATION_CASES`` sets the number of cases (CI: 150 of each kind);
``benchmarks/bench_reliability.py`` runs thousands and reports the counts.
"""

import copy
import json
import os
import shutil
import signal
from contextlib import contextmanager

import pytest
import torch
from conftest import manifest_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lct
from lct.errors import LCTError

CASES = int(os.environ.get("LCT_MUTATION_CASES", "150"))
CASE_SECONDS = 30
IDS = torch.tensor([[1, 7, 3, 9, 2, 5]])

SPECIAL = st.sampled_from([
    0, -1, 1, 63, 64, 4096, 2**31 - 1, 2**31, 2**40, 2**63, -2**63, 1.5, float("nan"),
    float("inf"), True, None, "", "..", "../x", "/etc/passwd", "model-00000.lct",
    "model-00001.lct", "lct.json", "nf4", "int8", "plain", "zstd", "planes", "raw", "embed",
    "layers.0", "layers.1", "norm", "head", "bfloat16", "float32", "int8", "uint8", "bool",
    "maximus", "x" * 2000, [], {}, [0, 0], [1, 2, 3], {"a": 1}])
VALUES = st.one_of(SPECIAL, st.integers(-2**64, 2**64), st.text(max_size=12),
                   st.lists(st.integers(-5, 5000), max_size=4))
OPS = ("replace", "delete", "nudge", "swap_items", "duplicate_item", "swap_field")


def _paths(obj, prefix=()):
    """Every node of a JSON tree as a path of keys and indexes."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(_paths(v, prefix + (k,)))
    return out


def _parent(m, path):
    for k in path[:-1]:
        m = m[k]
    return m


def mutate(m: dict, data) -> str:
    """Apply one drawn mutation to ``m`` in place; return what was done."""
    paths = _paths(m)
    path = data.draw(st.sampled_from(paths), label="path")
    op = data.draw(st.sampled_from(OPS), label="op")
    parent, key = _parent(m, path), path[-1]
    if op == "delete":
        del parent[key]
    elif op == "nudge" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += data.draw(st.sampled_from([-4096, -64, -1, 1, 64, 4096]), label="delta")
    elif op == "swap_items" and isinstance(parent, list) and len(parent) > 1:
        j = data.draw(st.integers(0, len(parent) - 1), label="other")
        parent[key], parent[j] = parent[j], parent[key]
    elif op == "duplicate_item" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif op == "swap_field" and len(path) >= 3 and isinstance(parent, dict):
        # the same field of a sibling entry (two tensors' names, offsets, chunks...)
        grand = _parent(m, path[:-1])
        if isinstance(grand, list) and len(grand) > 1:
            j = data.draw(st.integers(0, len(grand) - 1), label="sibling")
            other = grand[j]
            if isinstance(other, dict) and key in other:
                parent[key], other[key] = other[key], parent[key]
    else:
        parent[key] = data.draw(VALUES, label="value")
    return f"{op} at {'/'.join(map(str, path))}"


@contextmanager
def time_limit(seconds: int, what: str):
    def expire(signum, frame):
        raise TimeoutError(f"{what}: still running after {seconds} s (a hang)")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _read_all(path) -> dict:
    out = {}
    with lct.open(path) as a:
        for g in a.groups:
            for name, t in a.read_group(g).items():
                out[name] = t.contiguous().view(torch.uint8).clone() if torch.is_tensor(t) else t
    return out


def _logits(path):
    with torch.no_grad():
        return lct.load(path)(IDS).logits


@pytest.fixture(scope="module")
def subject(gemma_art, tmp_path_factory):
    """A private copy of the tiny Gemma artifact, its manifest, its data and its logits."""
    path = tmp_path_factory.mktemp("mut") / "a.lct"
    shutil.copytree(gemma_art, path)
    text = (path / "lct.json").read_text()
    return path, text, _read_all(path), _logits(path)


def _check(subject, data):
    path, text, tensors, logits = subject
    m = json.loads(text)
    what = mutate(m, data)
    (path / "lct.json").write_text(manifest_text(m))
    try:
        with time_limit(CASE_SECONDS, what):
            try:
                got = _read_all(path)
            except LCTError:
                return "refused"
            assert set(got) == set(tensors), f"{what}: other tensor names were read"
            for name, t in got.items():
                assert torch.equal(t, tensors[name]), f"{what}: {name} reads other bytes"
            try:
                lct.verify(path)
                out = _logits(path)
            except LCTError:
                return "refused"
            assert torch.equal(out, logits), f"{what}: the loaded model computes other logits"
            return "harmless"
    finally:
        (path / "lct.json").write_text(text)


@settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_manifest_mutation_is_refused_or_harmless(subject, data):
    _check(subject, data)


def test_the_sweep_reaches_both_outcomes(subject):
    """The generator is not vacuous: some mutations are refused and some are harmless."""
    seen = set()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        seen.add(_check(subject, data))
    run()
    assert seen == {"refused", "harmless"}
