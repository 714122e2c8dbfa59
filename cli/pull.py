"""`lct pull`: download an artifact from the Hub through the Hugging Face cache and verify it."""

from __future__ import annotations

import click

from lct.cli._util import GroupProgress, quiet_option


@click.command("pull", short_help="Download an artifact from the Hub or S3 and verify it.")
@click.argument("repo_id")
@click.option("--revision", default=None, help="Branch, tag or commit (default: main).")
@click.option("--local-dir", type=click.Path(file_okay=False), default=None,
              help="Put the files in this folder instead of the Hugging Face cache.")
@quiet_option("the local path")
def pull_cmd(repo_id, revision, local_dir, quiet):
    """Download the LCT artifact REPO_ID (org/name or hf://org/name@revision) and verify every
    checksum: each file against the Hub's hash, each chunk against its xxh3. Prints the local
    path. A corrupt download is reported (exit 1) and removed from the cache, never used.
    REPO_ID may be s3://bucket/prefix: it is downloaded into --local-dir (a new folder), which
    appears only once every chunk is checked.

    Downloads resume after an interruption; HF_HUB_OFFLINE=1 uses only the cache. Private repos
    need `hf auth login` or HF_TOKEN.
    """
    from lct import hub
    from lct.cloud import is_s3_uri
    from lct.units import human

    if is_s3_uri(repo_id):
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
        return
    bar = GroupProgress("verify", unit="group", enabled=not quiet)
    try:
        res = hub.pull_detailed(repo_id, revision=revision, local_dir=local_dir, progress=bar)
    finally:
        bar.close()
    if quiet:
        click.echo(str(res.path))
        return
    click.echo(f"pulled {res.repo_id}" + (f"@{res.revision}" if res.revision else "") +
               f": {len(res.files)} files, {human(res.bytes)}; {res.files_checked} file hashes and "
               f"{res.chunks_checked} chunk checksums OK")
    click.echo(str(res.path))
