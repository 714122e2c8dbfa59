"""`lct cache`: the local decoded cache (lct/io/cache.py): list it, prune it, fill it."""

from __future__ import annotations

import json
import time

import click

from lct.cli._util import GroupProgress, quiet_option, table


@click.group("cache", short_help="List, prune and fill the local decoded cache.")
def cache_cmd():
    """The local decoded cache: what a load decoded, kept so that a later load of the same
    artifact maps it instead of decoding it again (LCT_CACHE_MAP=auto maps it only where it
    is in memory, and where it is on the disk decodes the artifact, fewer bytes, and reads
    the entry into memory for the next start). On by default (LCT_CACHE=0,
    lct.load(..., cache=False) or lct load --no-cache turn it off); the layer-wise model,
    device maps and tensor-parallel ranks map an entry that a whole load, `lct pull` or
    `lct cache fill` made. Every chunk of an entry is checked, as a load first maps it, against the decoded
    checksum the artifact's manifest pins (format 1.6; older artifacts are never cached).
    Entries are named by the manifest's digest (lct info prints it) and
    the least recently used are evicted to stay within LCT_CACHE_MAX (default 64GiB, which
    lct cache list prints as 68.72 GB: LCT prints sizes in decimal units), and
    nothing is written that would leave less of the disk free than LCT_CACHE_MIN_FREE (default
    5 %, at least 2GiB). The folder
    is LCT_CACHE_DIR, else $XDG_CACHE_HOME/lct/decoded, else ~/.cache/lct/decoded."""


@cache_cmd.command(
    "list", short_help="List the entries, least recently used first, and their sizes.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {dir, max_bytes, total_bytes, entries: [{digest, artifact, size, "
                   "last_used}]} as JSON.")
@quiet_option("the total bytes the entries hold")
def list_cmd(as_json, quiet):
    """List the entries, least recently used first, with their sizes and the total."""
    from lct.io import cache
    from lct.units import human
    root, items = cache.cache_dir(), cache.entries()
    total = sum(e.size for e in items)
    if as_json:
        click.echo(json.dumps({
            "dir": str(root), "max_bytes": cache.max_bytes(), "total_bytes": total,
            "entries": [{"digest": e.digest, "artifact": e.artifact, "size": e.size,
                         "last_used": e.last_used} for e in items]}, indent=1))
        return
    if quiet:
        click.echo(str(total))
        return
    rows = [[e.digest[:19], e.artifact, human(e.size),
             time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))] for e in items]
    if rows:
        click.echo(table(rows, ["digest", "artifact", "size", "last used"]))
    click.echo(f"{root}: {len(items)} entr{'y' if len(items) == 1 else 'ies'}, {human(total)} "
               f"of {human(cache.max_bytes())}")


@cache_cmd.command(
    "fill", short_help="Decode an artifact into the cache without loading a model.")
@click.argument("artifact")
@quiet_option("the entry's folder")
def fill_cmd(artifact, quiet):
    """Decode ARTIFACT (a folder, hf://org/name[@rev], pulled first, or s3://, gs:// or
    az://bucket/prefix)
    into the cache without loading a model, a few groups in memory at a time: for a model that
    the layer-wise model (lct.loader.LayerwiseModel, lct load --layerwise), a device map or
    tensor-parallel ranks run, which map the entry instead of decoding (unless LCT_CACHE=0 or
    cache=False). Exits 1 where the entry cannot be kept (over LCT_CACHE_MAX, a disk too full),
    saying why; an entry that exists is checked (each chunk's hash) and left as it is, or
    filled again where a byte of it changed."""
    from lct.cloud import local_or_open
    from lct.errors import LCTError
    from lct.io import cache
    from lct.io.reader import Artifact, open_artifact
    from lct.units import human
    target = local_or_open(artifact)
    art = target if isinstance(target, Artifact) else open_artifact(target)
    bar = GroupProgress("cache fill", unit="group", enabled=not quiet)
    try:
        f = cache.fill(art, progress=bar)
    finally:
        bar.close()
        art.close()
    if f.reason:
        raise LCTError(f"{artifact}: not cached: {f.reason}")
    if quiet:
        click.echo(str(f.folder))
        return
    click.echo(f"{'filled' if f.done else 'already cached:'} {f.folder} ({human(f.size)})")


@cache_cmd.command(
    "prune", short_help="Remove entries: all, a digest's, orphans, or the least recently used.")
@click.option("--all", "everything", is_flag=True,
              help="Remove every entry, and the head paths measured on this machine "
                   "(head-paths.json: the next start measures them again).")
@click.option("--orphaned", "orphans", is_flag=True,
              help="Remove the entries whose artifact folder (the artifact column of lct cache "
                   "list) is gone or now holds another artifact: a folder removed, a model "
                   "converted again. An entry also serves a copy of its artifact elsewhere, "
                   "which this cannot see.")
@click.option("--digest", default=None, metavar="DIGEST",
              help="Remove the entry of this manifest digest (sha256:..., as lct info prints; "
                   "a prefix only one entry has, as lct cache list prints, will do).")
@click.option("--max-size", default=None, metavar="SIZE",
              help="Remove the least recently used entries until the rest fit in SIZE (10GiB).")
@quiet_option("the number of entries removed")
def prune_cmd(everything, orphans, digest, max_size, quiet):
    """Remove entries (and what unfinished fills left). Only folders the cache made are
    touched."""
    from lct.io import cache
    from lct.units import human, parse_size
    if not (everything or orphans or digest or max_size):
        raise click.UsageError("say what to remove: --all, --orphaned, --digest DIGEST or "
                               "--max-size SIZE")
    keep = parse_size(max_size, "--max-size") if max_size else None
    removed = cache.prune(keep_bytes=keep, digest=digest, everything=everything, orphans=orphans)
    if everything:
        from lct.kernels import paths
        paths.forget()
    if quiet:
        click.echo(str(len(removed)))
        return
    click.echo(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, "
               f"{human(sum(e.size for e in removed))}")
