"""`lct info`: what an artifact holds."""

from __future__ import annotations

import json

import click

from lct.cli._util import quiet_option, table
from lct.format.encodings import lossy_encodings


@click.command("info", short_help="Show an artifact's groups, encodings, sizes and policy.")
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True,
              help="Print a summary object as JSON (fields in docs/CLI.md).")
@click.option("--manifest", "as_manifest", is_flag=True, help="Print the raw manifest as JSON.")
@click.option("--tensors", is_flag=True, help="List every tensor too.")
@quiet_option("one line: the path, format version, groups, tensors, stored and decoded sizes")
def info_cmd(artifact, as_json, as_manifest, tensors, quiet):
    """Show the groups, tensors, encodings and stored vs decoded sizes of ARTIFACT (a folder,
    hf://org/name[@rev], pulled into the Hugging Face cache first, or s3://, gs:// or
    az://bucket/prefix, of which only the small files are fetched), and the overall ratio
    against the source checkpoint. Reads only the manifest (no torch needed)."""
    from lct.cloud import local_or_open
    from lct.io.info import summarize
    from lct.io.reader import Artifact, open_artifact
    from lct.units import human
    where = local_or_open(artifact)
    with where if isinstance(where, Artifact) else open_artifact(where) as art:
        m = art.manifest
        # a remote artifact by the address it was given (its files are in a local cache)
        shown = artifact if "://" in str(artifact) else art.path
        if as_manifest:
            click.echo(json.dumps(m.to_dict(), indent=1))
            return
        if as_json:
            from lct.io.info import summary
            click.echo(json.dumps(summary(m, art.path, art.digest), indent=1))
            return
        if quiet:
            click.echo(f"{shown}: LCT {m.format_version[0]}.{m.format_version[1]}, "
                       f"{len(m.groups)} groups, {len(m.tensors)} tensors, "
                       f"{human(m.stored_bytes)} stored, {human(m.decoded_bytes)} decoded")
            return
        rows = [(r.group, r.tensors, r.encodings, r.codecs, human(r.stored), human(r.decoded),
                 f"{r.decoded / max(r.stored, 1):.2f}") for r in summarize(m)]
        click.echo(f"{shown}  (LCT {m.format_version[0]}.{m.format_version[1]}, "
                   f"{m.created_by})")
        click.echo(f"source: {m.source.get('id')}"
                   + (f" @ {m.source['revision']}" if m.source.get("revision") else ""))
        click.echo(f"digest: {art.digest}  (pin it: lct verify ART --expect DIGEST, "
                   f"lct.load(..., expect=DIGEST))")
        from lct.io.info import architecture_line
        click.echo(architecture_line(m))
        p = m.policy
        given = [f"{e}={_parts(p[e])}" for e in lossy_encodings() if p.get(e)]
        click.echo(f"policy: {p.get('mode', 'manual')} "
                   + " ".join(given or ["lossy=none"]) + " "
                   + f"blocksize={p.get('blocksize')} "
                   f"dtype={p.get('dtype') or 'source'} codec={p.get('codec')} level={p.get('level')}"
                   + (f" maximus_shards={p['maximus_shards']}" if p.get("maximus_shards") else "")
                   + (f" tp_pieces={p['tp_pieces']}" if p.get("tp_pieces") else ""))
        from lct.io.info import measured_line
        measured = measured_line(p.get("measured"))
        if measured:
            click.echo(measured)
        click.echo(table(rows, ["group", "tensors", "stored as", "codec", "stored", "decoded",
                                "ratio"]))
        from lct.io.info import RATIO_DEFINITION, data_bytes, size_ratio, source_weight_bytes
        ratio = size_ratio(m)
        click.echo(f"total: {human(m.stored_bytes)} stored, {human(m.decoded_bytes)} decoded, "
                   f"{len(m.files)} data file(s) of {human(data_bytes(m))}"
                   + (f"; {ratio:.3f}x of the source's {human(source_weight_bytes(m))} of "
                      f"safetensors ({RATIO_DEFINITION})" if ratio else ""))
        if m.ties:
            click.echo("tied: " + ", ".join(f"{k} -> {v}" for k, v in m.ties.items()))
        if m.unmapped:
            click.echo(f"not taken by the model (kept in misc): {', '.join(m.unmapped)}")
        if tensors:
            click.echo(table([(t.name, "x".join(map(str, t.shape)), t.dtype, t.encoding, t.group,
                               human(t.nbytes)) for t in m.tensors.values()],
                             ["tensor", "shape", "dtype", "encoding", "group", "bytes"]))


def _parts(v) -> str:
    """A manifest's list of roles (informative, so not trusted to be a list of strings)."""
    return ",".join(str(x) for x in v) if isinstance(v, list) and v else "none"


