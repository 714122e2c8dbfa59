"""Issue 12 item 8: every non-weight file of the source travels with the artifact (hashed,
checked, exported back), not a fixed list; odd names, links leaving the folder and oversized
files are left out and named; what LCT carried counts as LCT's own when it replaces a folder."""

import json
import os
import shutil

import pytest

import lct
from lct.errors import LCTError
from lct.format import constants as C


@pytest.fixture
def src(llama_src, tmp_path):
    s = tmp_path / "src"
    shutil.copytree(llama_src, s)
    (s / "LICENSE").write_text("Apache-2.0, for the test\n")
    (s / "preprocessor_config.json").write_text('{"size": 224}')
    (s / "special_thing.yaml").write_text("a: 1\n")
    (s / "README.md").write_text("# the source's card\n")
    (s / "pytorch_model.bin").write_bytes(b"not unpickled")
    (s / "odd name.txt").write_text("space in the name")
    outside = tmp_path / "secret.txt"
    outside.write_text("private")
    os.symlink(outside, s / "leak.txt")
    return s


def test_every_side_file_is_carried_hashed_checked_and_exported(src, tmp_path):
    rep = lct.convert(str(src), tmp_path / "a.lct")
    art = tmp_path / "a.lct"
    carried = {"LICENSE", "preprocessor_config.json", "special_thing.yaml", "config.json"}
    assert carried <= {p.name for p in art.iterdir()}
    for name in ("README.md", "pytorch_model.bin", "odd name.txt", "leak.txt"):
        assert not (art / name).exists(), name
    assert dict(rep.skipped_files) == {"odd name.txt": "not a plain file name",
                                       "leak.txt": "a link that leaves the model folder"}
    recorded = json.loads((art / "lct.json").read_text())["source"]["files"]
    assert carried <= set(recorded)
    with lct.open(art) as a:
        assert carried <= set(a.manifest.side_files())
    assert lct.verify(art).ok
    (art / "special_thing.yaml").write_text("a: 2\n")
    rep2 = lct.verify(art)
    assert not rep2.ok and any("special_thing.yaml" in f for f in rep2.failures)
    (art / "special_thing.yaml").write_text("a: 1\n")
    lct.export(art, tmp_path / "hf")
    for name in carried:
        assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes()
    # replacing: the carried files are LCT's own, anything else is the user's
    lct.convert(str(src), art, overwrite=True)
    lct.export(art, tmp_path / "hf", overwrite=True)
    (art / "notes.txt").write_text("mine")
    with pytest.raises(LCTError, match="notes.txt"):
        lct.convert(str(src), art, overwrite=True)
    assert (art / "notes.txt").read_text() == "mine"


def test_oversized_side_files_are_left_out_and_named(src, tmp_path, monkeypatch):
    monkeypatch.setattr(C, "MAX_SIDE_FILE_BYTES", 20)
    rep = lct.convert(str(src), tmp_path / "a.lct")
    skipped = dict(rep.skipped_files)
    assert skipped["LICENSE"].startswith("over") and "special_thing.yaml" not in skipped
    assert not (tmp_path / "a.lct" / "LICENSE").exists()


def test_convert_cli_names_what_it_left_out(src, tmp_path):
    from click.testing import CliRunner

    from lct.cli.main import cli
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "a.lct")])
    assert r.exit_code == 0, r.output
    assert "not carried from the source: leak.txt (a link that leaves the model folder)" in \
        r.output
