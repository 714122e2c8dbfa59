"""`lct pull`: download an artifact from the Hub through the Hugging Face cache and verify it."""

from __future__ import annotations

import click

from lct.cli._util import GroupProgress, quiet_option


@click.command("pull", short_help="Download an artifact from the Hub or an object store and verify it.")
@click.argument("repo_id")
@click.option("--revision", default=None, help="Branch, tag or commit (default: main).")
@click.option("--local-dir", type=click.Path(file_okay=False), default=None,
              help="Put the files in this folder instead of the Hugging Face cache.")
@click.option("--cache/--no-cache", "cache", default=None,
              help="Keep the decoded copy of the artifact in the local decoded cache (lct cache "
                   "--help) once it is pulled, so that its first load maps it: the command "
                   "ends once it is written. Default: LCT_CACHE (1/0), else on.")
@quiet_option("the local path")
def pull_cmd(repo_id, revision, local_dir, cache, quiet):
    """Download the LCT artifact REPO_ID (org/name or hf://org/name@revision) and verify every
    checksum: each file against the Hub's hash, each chunk against its xxh3. Prints the local
    path. A corrupt download is reported (exit 1) and removed from the cache, never used.
    REPO_ID may be an object store address (s3://, gs:// or az://bucket/prefix): it is
    downloaded into --local-dir (a new folder), which appears only once every chunk is checked.

    Then the artifact is decoded into the local decoded cache (unless --no-cache or
    LCT_CACHE=0), so that its first load maps it as a later one would.

    Downloads resume after an interruption; HF_HUB_OFFLINE=1 uses only the cache. Private repos
    need `hf auth login` or HF_TOKEN.
    """
    from lct import hub
    from lct.cloud import is_cloud_uri
    from lct.units import human

    if is_cloud_uri(repo_id):
        if revision is not None:
            raise click.UsageError(f"--revision is for the Hub, not for {repo_id}")
        if local_dir is None:
            raise click.UsageError(f"pulling {repo_id} needs --local-dir (a new folder)")
        from lct import cloud
        bar = GroupProgress("download", enabled=not quiet, count=False)
        try:
            path = cloud.pull(repo_id, local_dir, progress=bar)
        finally:
            bar.close()
        if not quiet:
            click.echo(f"pulled {repo_id}: every chunk checked")
        click.echo(str(path))
        _keep(path, cache, quiet)
        return
    bar = GroupProgress("verify", unit="group", enabled=not quiet)
    try:
        res = hub.pull_detailed(repo_id, revision=revision, local_dir=local_dir, progress=bar)
    finally:
        bar.close()
    if quiet:
        click.echo(str(res.path))
    else:
        click.echo(f"pulled {res.repo_id}" + (f"@{res.revision}" if res.revision else "") +
                   f": {len(res.files)} files, {human(res.bytes)}; {res.files_checked} file "
                   f"hashes and {res.chunks_checked} chunk checksums OK")
        click.echo(str(res.path))
    _keep(res.path, cache, quiet)


def _keep(path, cache, quiet) -> None:
    """Start keeping the pulled artifact's decoded copy (``lct.io.cache.keep``); the command
    waits for it at exit and says so (``lct.__main__``)."""
    from lct.io import cache as decoded
    from lct.io.reader import open_artifact
    if not decoded.enabled(cache):
        return
    with open_artifact(path) as art:
        _, why = decoded.keep(art, cache)
    if why and not quiet:
        click.echo(f"note: no decoded copy kept: {why}", err=True)
