"""Issue 14: one rule for sizes: decimal units through huggingface_hub's parser (as
save_pretrained), binary units, no bare numbers from the command line."""

import pytest

from lct.errors import LCTError
from lct.units import parse_size


@pytest.mark.parametrize("text,want", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2.5GB", 2_500_000_000), ("1KB", 1000),
    ("16GiB", 16 * 2**30), ("512MiB", 512 * 2**20), ("1.5TiB", int(1.5 * 2**40)),
    ("4gib", 4 * 2**30), (" 2GB ", 2 * 10**9), (123, 123), ("0B", 0), ("4096B", 4096)])
def test_sizes_parse(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["16", "5", "5 G", "GB", "5XB", "five GB", "", "5iB", "1e3KB"])
def test_sizes_without_a_unit_or_malformed_are_refused(text):
    with pytest.raises(LCTError, match="needs a number with a unit"):
        parse_size(text, "memory")


@pytest.mark.parametrize("text", ["-5GB", " -1MB", -1])
def test_negative_sizes_are_refused_as_negative(text):
    with pytest.raises(LCTError, match="memory must not be negative"):
        parse_size(text, "memory")


def test_cli_options_take_units(llama_art, llama_src, tmp_path, run):
    import json
    res = run("export", llama_art, tmp_path / "hf", "--max-shard-size", "200KB")
    assert res.exit_code == 0, res.output
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    res = run("export", llama_art, tmp_path / "hf2", "--max-shard-size", "200000")
    assert res.exit_code == 1 and "needs a number with a unit" in res.output
    res = run("export", llama_art, tmp_path / "hf3", "--max-shard-size", "0GB")
    assert res.exit_code == 1 and "max_shard_size 0 would write a shard per tensor" in \
        res.output and not (tmp_path / "hf3").exists()
    res = run("plan", llama_src, "--memory", "16")
    assert res.exit_code != 0 and "needs a number with a unit" in res.output
    res = run("plan", llama_src, "--memory", "16GiB")
    assert res.exit_code == 0, res.output
    res = run("convert", llama_src, "-o", tmp_path / "a.lct", "--max-file-size", "50KB",
              "--nf4", "none")
    assert res.exit_code == 0, res.output
    assert len(list((tmp_path / "a.lct").glob("model-*.lct"))) > 1
