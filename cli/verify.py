"""`lct verify`: checksums, and optionally every tensor against the source."""

from __future__ import annotations

import sys

import click

from ._util import GroupProgress, table


@click.command("verify")
@click.argument("artifact", type=click.Path())
@click.option("--against", default=None,
              help="Source folder or Hub id: compare lossless tensors bit for bit and report "
                   "NF4 error (max, mean, cosine).")
@click.option("--revision", default=None, help="Hub revision of --against.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def verify_cmd(artifact, against, revision, quiet):
    """Check every chunk of ARTIFACT (checksum and decode). Exits 1 if anything is wrong."""
    from lct.verifier import verify

    bar = GroupProgress("verify", unit="group", enabled=not quiet)
    try:
        rep = verify(artifact, against=against, revision=revision, progress=bar)
    finally:
        bar.close()
    nf4 = [t for t in rep.tensors if t.encoding == "nf4"]
    if nf4:
        click.echo(table([(t.name, f"{t.max_err:.3g}", f"{t.mean_err:.3g}", f"{t.cosine:.6f}")
                          for t in nf4], ["nf4 tensor", "max err", "mean err", "cosine"]))
    lossless = [t for t in rep.tensors if t.encoding == "plain"]
    if lossless:
        click.echo(f"{sum(t.ok for t in lossless)}/{len(lossless)} lossless tensors bit-identical "
                   f"to the source")
    for f in rep.failures:
        click.echo(f"FAIL {f}", err=True)
    click.echo(f"{rep.chunks_checked} chunks checked: " + ("OK" if rep.ok else
                                                           f"{len(rep.failures)} problem(s)"))
    if not rep.ok:
        sys.exit(1)
