"""``lct push``: verify an artifact and publish it to the Hub in one commit."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lct.errors import ChecksumError, HubError, LCTError
from lct.format import constants as C
from lct.hub.address import split_address
from lct.hub.card import CARD_NAME, _source_license, model_card
from lct.hub.client import _hub, hub_error
from lct.io.store import confined
from lct.units import human

# Other files worth publishing with an artifact when they are in its folder.
EXTRA_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "USE_POLICY.md")


@dataclass
class PushResult:
    """What ``push`` published."""

    repo_id: str
    revision: str
    commit_oid: str
    commit_url: str
    pr_url: str | None
    files: list = field(default_factory=list)
    bytes: int = 0
    chunks_checked: int = 0
    skipped: list = field(default_factory=list)     # [(name, why)] in the folder, not pushed


def artifact_files(root: Path, manifest) -> tuple:
    """``(names, skipped)``: the files to push, and ``[(name, why)]`` of those in the folder
    that are not pushed (a card LCT generates instead, an extra file that is not a file)."""
    names = [C.MANIFEST_NAME] + [f["name"] for f in manifest.files]
    if manifest.maximus:
        names.append(manifest.maximus["file"])
    names += [n for n in manifest.side_files() if (root / n).is_file()]
    skipped = []
    for n in EXTRA_FILES:
        p = root / n
        if p.is_file():
            names.append(n)
        elif p.is_symlink() or p.exists():
            skipped.append((n, "a folder or a link to nothing, not a file"))
    card = root / CARD_NAME
    if card.is_symlink() or card.exists():
        skipped.append((CARD_NAME, "the model card is generated from the manifest instead"))
    names = list(dict.fromkeys(names))   # a LICENSE carried from the source is listed once
    for n in names:
        if not confined(root / n, root):  # it would publish whatever it points at
            raise LCTError(f"{root / n}: a symbolic link that leaves the artifact folder; "
                           f"refusing to push")
        if not (root / n).is_file():
            raise LCTError(f"{root / n}: missing; refusing to push an incomplete artifact")
    return names, skipped


def push(artifact, repo_id: str, revision: str | None = None, private: bool = False,
         commit_message: str | None = None, create_pr: bool = False, token=None,
         progress=None, *, verify_progress=None, license: str | None = None,  # noqa: A002
         endpoint: str | None = None) -> PushResult:
    """Verify ``artifact`` and publish it to the Hub model repo ``repo_id`` in one commit.

    The repo is created if needed (``private`` applies to a new repo only). The upload holds the
    manifest, the data files, the Maximus state, the source's config/tokenizer files, and a
    generated model card ``README.md`` (the artifact folder itself is not modified).

    Args:
        artifact: the artifact directory.
        repo_id: ``org/name`` (``hf://org/name`` is accepted too).
        revision: the branch to commit to (created from the default branch if missing); with
            ``create_pr``, the branch the pull request targets.
        private: create a new repo as private.
        commit_message: the commit title (default: says what was uploaded).
        create_pr: open a pull request instead of committing to the branch.
        token: a Hub token (default: ``HF_TOKEN`` or the stored login).
        progress: called as ``progress(file, bytes_done, bytes_total)`` as files are uploaded.
        verify_progress: called as ``progress(group, done, total)`` while verifying.
        license: the card's license (default: the source's, when it can be found).
        endpoint: the Hub URL (default: ``HF_ENDPOINT`` or huggingface.co).

    Returns:
        A ``PushResult`` with the commit oid and URL (and the pull request URL).

    Raises:
        ChecksumError / ManifestError / ArtifactNotFoundError: the artifact is not valid and
            verified; nothing is uploaded.
        HubAuthError, HubNotFoundError, HubOfflineError, HubError: the Hub refused or failed.
    """
    repo_id, revision = split_address(repo_id, revision)
    hh = _hub()

    def online():                       # said before a verify that may take minutes
        if hh.constants.is_offline_mode():
            raise hub_error(hh.errors.OfflineModeIsEnabled("offline"), repo_id, revision,
                            "push")
    root = Path(artifact)
    manifest, report = _verified(root, verify_progress, before_check=online)
    names, skipped = artifact_files(root, manifest)
    card = model_card(manifest, repo_id,
                      license=license or _source_license(manifest, token, endpoint))
    src = manifest.source or {}
    message = commit_message or (f"Upload LCT artifact of {src['id']}" if src.get("kind") == "hub"
                                 else "Upload LCT artifact")
    description = (f"{len(manifest.groups)} groups, {len(manifest.chunks)} chunks, "
                   f"{human(manifest.stored_bytes)} stored; verified before upload "
                   f"({report.chunks_checked} chunk checksums).")
    big = {f["name"] for f in manifest.files}
    if manifest.maximus:
        big.add(manifest.maximus["file"])
    api = hh.HfApi(token=token, endpoint=endpoint)
    try:
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if revision and not create_pr and not revision.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        ops = [hh.CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(root / n)) for n in names]
        ops.append(hh.CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card.encode()))
        total = sum(op.upload_info.size for op in ops)
        _upload_large(api, repo_id, [op for op in ops if op.path_in_repo in big], revision,
                      create_pr, total, progress)
        info = api.create_commit(repo_id, ops, commit_message=message,
                                 commit_description=description, revision=revision,
                                 create_pr=create_pr)
        if progress:
            progress(CARD_NAME, total, total)
        held = api.model_info(repo_id, revision=info.oid, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - every Hub failure becomes one clear line
        raise hub_error(e, repo_id, revision, action="push") from e
    _check_pushed(root, ops, held, repo_id, info.oid)
    return PushResult(repo_id=repo_id, revision=revision or "main", commit_oid=info.oid,
                      commit_url=info.commit_url, pr_url=info.pr_url,
                      files=names + [CARD_NAME], bytes=total,
                      chunks_checked=report.chunks_checked, skipped=skipped)


def _verified(root: Path, progress, before_check=None) -> tuple:
    """``(manifest, check report)`` of the artifact at ``root``, every chunk and the Maximus
    state checked; refuses (raises) an artifact that does not open or fails a check.
    ``before_check()`` runs once it opened, before the check."""
    from lct.io.check import check_artifact
    from lct.io.reader import open_artifact
    try:
        art = open_artifact(root)
    except LCTError as e:
        raise type(e)(f"refusing to push: {e}") from e
    with art:
        if before_check is not None:
            before_check()
        try:
            report = check_artifact(art, progress=progress)
        except LCTError as e:
            raise type(e)(f"refusing to push: {e}") from e
        manifest = art.manifest
    if not report.ok:
        raise ChecksumError(f"{root}: refusing to push an artifact that fails verification "
                            f"({len(report.failures)} problem(s)); first: {report.failures[0]}")
    return manifest, report


def _upload_large(api, repo_id: str, ops: list, revision, create_pr: bool, total: int,
                  progress) -> None:
    """Upload the large files (through LFS or Xet) one by one before the commit, so that
    progress is reported per file."""
    done = 0
    for op in sorted(ops, key=lambda o: o.path_in_repo):
        api.preupload_lfs_files(repo_id, additions=[op], revision=revision, create_pr=create_pr)
        done += op.upload_info.size
        if progress:
            progress(op.path_in_repo, done, total)


def _check_pushed(root: Path, ops: list, held, repo_id: str, oid: str) -> None:
    """After the commit: every file must be on the Hub with the size and hash that was sent
    (LFS: its sha256; a regular file: its git blob id), or the push failed.

    Raises:
        HubError: naming the first file the Hub holds otherwise.
    """
    from lct.hashing import git_blob_id
    by = {s.rfilename: s for s in (held.siblings or [])}
    for op in ops:
        name = op.path_in_repo
        s = by.get(name)
        want_size, want_sha = op.upload_info.size, op.upload_info.sha256.hex()
        lfs = getattr(s, "lfs", None) if s is not None else None
        lfs_sha = getattr(lfs, "sha256", None)
        if s is None:
            got = "no such file"
        elif s.size is not None and s.size != want_size:
            got = f"{s.size} bytes"
        elif lfs is not None:
            got = None if lfs_sha == want_sha else \
                f"sha256 {lfs_sha}" if lfs_sha else "an LFS file without a sha256"
        elif s.blob_id is not None:
            data = op.path_or_fileobj if isinstance(op.path_or_fileobj, bytes) else \
                (root / name).read_bytes()
            got = None if s.blob_id == git_blob_id(data) else f"git blob {s.blob_id}"
        else:
            # files_metadata=True always brings a hash; a Hub that sends none cannot show
            # that it holds what was sent.
            got = "a file without a hash"
        if got is not None:
            raise HubError(f"{repo_id}: after the push (commit {oid[:12]}) the Hub holds "
                           f"{name} as {got}, not the {want_size} bytes sent (sha256 "
                           f"{want_sha[:16]}...): the upload was cut or changed; push again")
