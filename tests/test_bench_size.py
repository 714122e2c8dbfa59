"""benchmarks/bench_size.py --tiny runs its whole pipeline (build shard by shard, convert,
verify --against, the disk device map, the layer-wise model) on a tiny Mixtral, so that the
script cannot rot: every phase succeeds, the device map's tokens equal the layer-wise model's,
a generated token reads less than all experts' bytes, and what it built is deleted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "benchmarks" / "bench_size.py"


@pytest.mark.slow
def test_bench_size_tiny_runs_every_phase(tmp_path):
    out = tmp_path / "size"
    res = subprocess.run([sys.executable, str(BENCH), "--tiny", "--shapes", "mixtral",
                          "--tokens", "2", "--out", str(out), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())["results"]["mixtral"]
    for phase in ("convert", "verify", "device_map", "layerwise"):
        assert rows[phase]["rc"] == 0 and rows[phase]["peak_rss"] > 0, (phase, rows[phase])
    assert rows["device_map"]["tokens"] == rows["layerwise"]["tokens"]
    assert len(rows["layerwise"]["tokens"]) == 2
    for phase in ("device_map", "layerwise"):
        read, all_ = rows[phase]["experts"]["forwards"][1]       # the generated token's
        assert 0 < read < all_, (phase, rows[phase]["experts"])
    assert "| mixtral | layerwise |" in res.stdout
    assert not out.exists()                 # everything built is deleted


def test_bench_size_skips_a_shape_the_disk_cannot_hold(tmp_path):
    """A shape whose checkpoint and artifact would leave less than --min-free on the disk is
    not built: the table says why, and nothing is left behind."""
    out = tmp_path / "size"
    res = subprocess.run([sys.executable, str(BENCH), "--tiny", "--shapes", "llama2-13b",
                          "--min-free", "1e9", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "| llama2-13b | build |" in res.stdout and "GB to keep free" in res.stdout
    assert not out.exists()
