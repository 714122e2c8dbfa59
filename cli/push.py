"""`lct push`: publish a verified artifact to the Hugging Face Hub in one commit."""

from __future__ import annotations

import click

from lct.cli._util import GroupProgress, quiet_option


@click.command("push", short_help="Verify an artifact and publish it to the Hub or an object store.")
@click.argument("artifact", type=click.Path())
@click.argument("repo_id")
@click.option("--revision", default=None,
              help="Branch to commit to (created if missing); with --create-pr, the branch the "
                   "pull request targets.")
@click.option("--private", is_flag=True, help="Create the repo as private (a new repo only).")
@click.option("--commit-message", default=None, help="Commit title (default: what was uploaded).")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing.")
@click.option("--license", "license_", default=None,
              help="License for the model card (default: the source's, when known).")
@quiet_option("the commit's URL (the pull request's with --create-pr)")
def push_cmd(artifact, repo_id, revision, private, commit_message, create_pr, license_, quiet):
    """Verify ARTIFACT and publish it to the Hub model repo REPO_ID (org/name) in one commit,
    or upload it to an object store (REPO_ID s3://, gs:// or az://bucket/prefix: a new prefix,
    the manifest last, then every chunk read back and checked; credentials as each cloud's own
    tools find them, docs/PUBLISHING.md).

    The repo is created if needed. The upload is the manifest, the data files (through LFS),
    the Maximus state, the config/tokenizer files and a generated model card (README.md) that
    says how it was converted and how to load it. An artifact that fails verification is
    refused. Log in with `hf auth login` or set HF_TOKEN (a write token).
    """
    from lct import hub
    from lct.cloud import is_cloud_uri
    from lct.units import human

    if is_cloud_uri(repo_id):
        given = [f for f, v in (("--revision", revision), ("--private", private),
                                ("--commit-message", commit_message),
                                ("--create-pr", create_pr), ("--license", license_)) if v]
        if given:
            raise click.UsageError(f"{given[0]} is for the Hub, not for {repo_id}")
        _push_cloud(artifact, repo_id, quiet)
        return
    check = GroupProgress("verify", unit="group", enabled=not quiet)
    upload = GroupProgress("upload", enabled=not quiet, count=False)  # per file, in bytes
    try:
        res = hub.push(artifact, repo_id, revision=revision, private=private,
                       commit_message=commit_message, create_pr=create_pr, license=license_,
                       progress=upload, verify_progress=check)
    finally:
        check.close()
        upload.close()
    if quiet:
        click.echo(res.pr_url or res.commit_url)
        return
    click.echo(f"pushed {artifact} to {res.repo_id}@{res.revision}: {len(res.files)} files, "
               f"{human(res.bytes)}, {res.chunks_checked} chunks verified before upload")
    click.echo(f"commit {res.commit_oid}: {res.commit_url}")
    for name, why in res.skipped:
        click.echo(f"note: {name} in the artifact folder was not pushed: {why}", err=True)
    if res.pr_url:
        click.echo(f"pull request: {res.pr_url}")
    at = f"@{res.revision}" if res.revision != "main" else ""
    if res.pr_url:
        num = res.pr_url.rstrip("/").rsplit("/", 1)[-1]
        at = f"@refs/pr/{num}" if num.isdigit() else ""
    click.echo(f'load it with: lct.load("hf://{res.repo_id}{at}")')


def _push_cloud(artifact, uri: str, quiet: bool) -> None:
    from lct import cloud
    upload = GroupProgress("upload", enabled=not quiet, count=False)
    try:
        checked = cloud.push(artifact, uri, progress=upload)
    finally:
        upload.close()
    if quiet:
        click.echo(uri)
        return
    click.echo(f"pushed {artifact} to {uri}: {checked} chunks read back and checked")
    click.echo(f'load it with: lct.load("{uri}")')
