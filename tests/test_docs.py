"""The documents keep their word (issue 37): the README is a landing page whose links resolve,
the guides it links exist, the versions and file names they print are the code's, and the
help texts name what the code does (every lossy encoding, whole subcommand summaries)."""

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from lct.cli.main import cli
from lct.format import constants as C
from lct.format.encodings import lossy_encodings

ROOT = Path(__file__).parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _links(path: Path) -> list:
    """The relative link targets of a Markdown file (web addresses left out)."""
    return [m.group(1) for m in LINK.finditer(path.read_text())
            if not re.match(r"[a-z]+:", m.group(1))]


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS],
                         ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    missing = [t for t in _links(path) if not (path.parent / t).exists()]
    assert not missing, (path.name, missing)


def test_the_readme_links_every_guide_and_the_changelog():
    linked = {(ROOT / t).resolve() for t in _links(ROOT / "README.md")}
    unlinked = [p.name for p in [*DOCS, ROOT / "CHANGELOG.md"] if p.resolve() not in linked]
    assert not unlinked, unlinked


def test_the_readme_and_the_changelog_name_the_format_version_the_writer_writes():
    """The README said 'version 1.2' while the writer wrote 1.6."""
    version = "{}.{}".format(*C.FORMAT_VERSION)
    readme = (ROOT / "README.md").read_text()
    assert f"docs/FORMAT.md) — the normative format specification (version {version})" in readme
    said = set(re.findall(r"specification \(version (\d+\.\d+)\)", readme))
    assert said == {version}, said
    unreleased = (ROOT / "CHANGELOG.md").read_text().split("\n## ")[1]
    assert unreleased.startswith("Unreleased") and f"Format {version}" in unreleased


def test_the_s3_example_names_the_data_file_convert_writes():
    """The s3:// example named model-00001.lct; the first data file is model-00000.lct."""
    text = (ROOT / "docs" / "PUBLISHING.md").read_text()
    assert f"`prefix/{C.DATA_FILE_TEMPLATE.format(index=0)}`" in text
    for path in [ROOT / "README.md", *DOCS]:
        for name in re.findall(r"model-\d+\.lct", path.read_text()):
            assert re.fullmatch(C.DATA_FILE_PATTERN, name), (path.name, name)


@pytest.mark.parametrize("command", ["verify", "export"])
def test_verify_and_export_help_name_every_lossy_encoding(command):
    """Their help named NF4 and int8 only; the registry has more."""
    out = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())
    missing = [e for e in lossy_encodings() if e not in out]
    assert not missing, (command, missing)


def test_export_help_says_how_to_round_trip_byte_for_byte():
    out = " ".join(CliRunner().invoke(cli, ["export", "--help"]).output.split())
    assert "byte-exact round trip" in out and "--nf4 none" in out


def test_verify_against_shows_what_it_takes():
    out = CliRunner().invoke(cli, ["verify", "--help"]).output
    assert re.search(r"^  --against SOURCE ", out, re.M), out


def test_cache_help_lists_each_subcommand_with_its_whole_summary():
    """click cut the subcommands' first sentences at its default width ('Decode ARTIFACT (a
    folder, hf://org/name[@rev], pulled first, or...')."""
    import click
    group = cli.get_command(click.Context(cli), "cache")
    out = CliRunner().invoke(cli, ["cache", "--help"], terminal_width=80).output
    listed = out.split("Commands:\n")[1].strip().splitlines()
    assert {ln.split()[0] for ln in listed} == set(group.commands), listed
    for line in listed:
        assert line.rstrip().endswith(".") and "..." not in line, line


def test_plan_help_does_not_call_int8_the_conversion_default():
    """plan --int8 said int8 was the default; convert's default is the auto policy."""
    out = " ".join(CliRunner().invoke(cli, ["plan", "--help"]).output.split())
    assert "auto policy" in out and "Accelerator memory" not in out
