"""``lct pull``: download an artifact through the Hugging Face cache and check every file and
chunk before handing out its path."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from lct.errors import ChecksumError, HubError, LCTError
from lct.format import constants as C
from lct.hub.address import is_hf_uri, split_address, where
from lct.hub.client import _hub, hub_error


@dataclass
class PullResult:
    """What ``pull_detailed`` fetched and checked."""

    path: Path
    repo_id: str
    revision: str | None
    files: list = field(default_factory=list)
    bytes: int = 0
    files_checked: int = 0
    chunks_checked: int = 0


def hub_oids(path: Path) -> tuple:
    """The two ids the Hub may give a file, from one streamed read: its git blob sha1 (a
    regular file) and the git sha1 of the LFS pointer holding its sha256 (a file stored with
    LFS)."""
    size = path.stat().st_size
    blob, sha256 = hashlib.sha1(b"blob %d\0" % size), hashlib.sha256()  # noqa: S324 - git's id
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            blob.update(block)
            sha256.update(block)
    return blob.hexdigest(), _lfs_pointer_oid(sha256.hexdigest(), size)


def _lfs_pointer_oid(sha256: str, size: int) -> str:
    from lct.hashing import git_blob_id
    return git_blob_id(f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
                       f"size {size}\n".encode())


def _tree(repo_id: str, revision: str | None, local_dir) -> dict | None:
    """``{path: (size, git oid)}`` from the tree listing ``snapshot_download`` cached (no
    network); None when none is cached."""
    hh = _hub()
    try:
        entries = hh.get_cached_repo_tree(repo_id, revision=revision, local_dir=local_dir)
    except Exception:  # noqa: BLE001 - no cached listing (old cache, offline): skip this layer
        return None
    return {e.path: (e.size, e.blob_id) for e in entries}


def check_files(root: Path, repo_id: str, revision: str | None, local_dir=None,
                skip=()) -> tuple:
    """Compare the files of a downloaded snapshot with the Hub's hashes (git oid of regular
    files, sha256 behind the LFS pointer of large ones). Returns ``(checked, problems)`` with
    problems as ``[(path, message)]``. Files in ``skip`` (data files, whose chunks are checked
    by their own checksums) are only checked for size.

    Not ``HfApi.verify_repo_checksums`` (huggingface_hub 2.4), which compares the same hashes,
    for three measured reasons: it lists the repo over the network, so an offline ``lct pull``
    served from the cache could not be checked; it sha256-hashes the data files, which the
    chunk checksums already cover (1.8 s more for the 3.1 GB Gemma-2B-shaped artifact on this
    project's 2-core machine, measured by hand, against 0.34 s for the chunk checks LCT runs
    anyway); and its offline counterpart, the listing ``get_cached_repo_tree`` returns, drops the LFS
    sha256 (an LFS file's id there is its pointer's git oid), so ``hub_oids`` derives both ids
    from one read. tests/test_hub.py holds the cases."""
    tree = _tree(repo_id, revision, local_dir)
    if tree is None:
        return 0, []
    checked, problems = 0, []
    for name, (size, oid) in sorted(tree.items()):
        p = root / name
        if not p.is_file():
            continue  # filtered out of this download
        actual = p.stat().st_size
        checked += 1
        if size is not None and actual != size:
            problems.append((name, f"{p}: {actual} bytes, the Hub says {size}"))
            continue
        if name in skip or not oid:
            continue
        if oid in hub_oids(p):
            continue
        problems.append((name, f"{p}: content does not match the Hub's hash {oid[:12]}"))
    return checked, problems


def raise_corrupt(root: Path, where: str, problems: list, advice: str = "") -> None:
    """Discard the corrupt downloaded files of ``problems`` (``[(name, message)]``) and raise
    the ``ChecksumError`` that names the first problem and what was removed."""
    removed = _discard(root, [n for n, _ in problems])
    hint = f"; removed {', '.join(removed)} from the cache{advice}" if removed else ""
    raise ChecksumError(f"{where}: download is corrupt, {len(problems)} problem(s): "
                        f"{problems[0][1]}{hint}")


def _discard(root: Path, names) -> list:
    """Remove corrupt downloaded files (and their cache blobs) so a new pull fetches them again."""
    removed = []
    for n in names:
        p = root / n
        try:
            if p.is_symlink():
                target = p.resolve()
                p.unlink()
                if target.is_file():
                    target.unlink()
            elif p.exists():
                p.unlink()
            removed.append(n)
        except OSError:
            pass
    return removed


def check_snapshot(root: Path, at: str) -> None:
    """Raise unless the downloaded snapshot ``root`` holds the manifest: ``HubError`` when the
    files landed in another commit's snapshot (the Hub's answers named another commit in
    ``X-Repo-Commit``), else ``ArtifactNotFoundError``. ``at`` names the repo in messages."""
    if (root / C.MANIFEST_NAME).is_file():
        return
    from lct.errors import ArtifactNotFoundError
    others = [p.parent.name for p in root.parent.glob(f"*/{C.MANIFEST_NAME}")
              if p.parent != root] if root.parent.name == "snapshots" else []
    if others:
        raise HubError(f"{at}: the Hub's answers for the files named commit "
                       f"{others[0][:12]} (X-Repo-Commit), not {root.name[:12]}, the commit "
                       f"the repo is at: a proxy or the Hub served another revision; try "
                       f"again, or pull a fixed commit (@sha)")
    raise ArtifactNotFoundError(f"{at}: not an LCT artifact (no {C.MANIFEST_NAME} in the repo)")


def verify_download(root: Path, repo_id: str, revision: str | None = None, local_dir=None,
                    chunks: bool = True, progress=None) -> tuple:
    """Verify a downloaded artifact snapshot: the Hub hashes of every file, the data file
    headers and sizes, every chunk's xxh3 checksum (``chunks=True``) and the Maximus state's
    sha256. Corrupt files are removed from the cache.

    Returns:
        ``(files_checked, chunks_checked)``.

    Raises:
        ChecksumError: a file or chunk does not match (naming it); the files were discarded.
        ManifestError / ArtifactNotFoundError: the repo does not hold a valid LCT artifact.
    """
    from lct.io.check import check_artifact
    from lct.io.reader import open_artifact
    at = where(repo_id, revision)
    check_snapshot(root, at)
    data_names = {n.name for n in root.glob(C.DATA_FILE_GLOB)}
    files_checked, problems = check_files(root, repo_id, revision, local_dir, skip=data_names)
    chunks_checked = 0
    if not problems:
        try:
            art = open_artifact(root)
        except LCTError as e:
            raise type(e)(f"{at}: the repo does not hold a valid LCT artifact: {e}") from e
        try:
            # Side files were checked against the Hub's hashes above; without ``chunks`` the
            # chunk checksums are left to the reader, which checks them as it reads.
            report = check_artifact(art, decode=False, side_files=False, progress=progress,
                                    chunks=chunks)
        finally:
            art.close()
        chunks_checked = report.chunks_checked
        for name, msg in report.problems:
            if not any(n == name for n, _ in problems):    # one problem per file is enough
                problems.append((name, msg))
    if problems:
        raise_corrupt(root, at, problems, ": pull again, and if it fails again the file is "
                                             "corrupt on the Hub")
    return files_checked, chunks_checked


def transient_status(e: BaseException) -> bool:
    """Whether ``e`` (or what it was raised from) is an HTTP 5xx or 429 answer."""
    while e is not None:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status >= 500 or status == 429
        e = e.__cause__ or e.__context__
    return False


def pull_detailed(repo_id: str, revision: str | None = None, local_dir=None, token=None, *,
                  chunks: bool = True, progress=None, endpoint: str | None = None) -> PullResult:
    """``pull``, returning a ``PullResult`` (path, files, bytes and what was checked)."""
    repo_id, revision = split_address(repo_id, revision)
    hh = _hub()
    if not hh.constants.is_offline_mode():
        _check_is_artifact(hh, repo_id, revision, token, endpoint)
    # A corrupt file is removed from the cache by verify_download; online, it is fetched once
    # more before giving up, and a 5xx/429 is tried once more too (a transient fault then costs
    # one retry, not a second `lct pull`).
    attempts = 1 if hh.constants.is_offline_mode() else 2
    for attempt in range(attempts):
        try:
            path = Path(hh.snapshot_download(repo_id, revision=revision, local_dir=local_dir,
                                             token=token, endpoint=endpoint))
        except Exception as e:  # noqa: BLE001
            if attempt + 1 < attempts and transient_status(e):
                time.sleep(1.0)  # a 5xx or 429: the server may answer a moment later
                continue
            from lct.io.writer import write_error
            full = write_error(e, Path(local_dir) if local_dir else
                               Path(hh.constants.HF_HUB_CACHE),
                               f"{repo_id} into {'it' if local_dir else 'the Hugging Face cache'}")
            raise (full or hub_error(e, repo_id, revision)) from e
        try:
            files_checked, chunks_checked = verify_download(path, repo_id, revision, local_dir,
                                                            chunks=chunks, progress=progress)
            break
        except ChecksumError:
            if attempt + 1 == attempts:
                raise
    files = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    size = sum((path / f).stat().st_size for f in files)
    return PullResult(path, repo_id, revision, files, size, files_checked, chunks_checked)


def _check_is_artifact(hh, repo_id: str, revision, token, endpoint) -> None:
    """Ask the Hub first: a repo that holds no ``lct.json`` is refused before anything is
    downloaded (a plain checkpoint would otherwise be downloaded whole), and a rejected token,
    no access or a missing repo/revision is reported even when an older copy is cached. Other
    failures (network, server errors) are left to ``snapshot_download``, which falls back to the
    cache."""
    from huggingface_hub import errors as herr
    try:
        info = hh.HfApi(token=token, endpoint=endpoint).model_info(repo_id, revision=revision)
    except herr.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403, 404) or isinstance(e, (herr.RepositoryNotFoundError,
                                                       herr.RevisionNotFoundError)):
            raise hub_error(e, repo_id, revision) from e
        return
    except Exception:  # noqa: BLE001
        return
    names = {s.rfilename for s in (info.siblings or [])}
    if info.siblings is not None and C.MANIFEST_NAME not in names:
        from lct.errors import ArtifactNotFoundError
        raise ArtifactNotFoundError(f"{where(repo_id, revision)}: not an LCT artifact (no "
                                    f"{C.MANIFEST_NAME} in the repo); to convert a checkpoint, "
                                    f"run lct convert {repo_id} -o OUT")


def pull(repo_id: str, revision: str | None = None, local_dir=None, token=None, *,
         chunks: bool = True, progress=None, endpoint: str | None = None) -> Path:
    """Download an LCT artifact from the Hub and verify every checksum before returning it.

    Files go through the Hugging Face cache (or into ``local_dir``): an interrupted download
    resumes, and with ``HF_HUB_OFFLINE=1`` only the cache is used. Every file is checked against
    the Hub's hashes, and every chunk against its xxh3 checksum; a corrupt file is removed from
    the cache and reported, and its path is not returned.

    Args:
        repo_id: ``org/name`` or ``hf://org/name@revision``.
        revision: branch, tag or commit (default: the default branch).
        local_dir: put the files in this folder instead of the cache.
        token: a Hub token (default: ``HF_TOKEN`` or the stored login).
        chunks: verify every chunk checksum (False: only the files' hashes and sizes; the
            loader verifies chunks as it streams them anyway).
        progress: called as ``progress(group, done, total)`` while chunks are verified.
        endpoint: the Hub URL (default: ``HF_ENDPOINT``).

    Returns:
        The local artifact directory.

    Raises:
        ChecksumError: the download is corrupt (the bad files were removed from the cache).
        HubAuthError, HubNotFoundError, HubOfflineError, HubError: with a one-line hint.
    """
    return pull_detailed(repo_id, revision, local_dir, token, chunks=chunks, progress=progress,
                         endpoint=endpoint).path


def local_artifact(path):
    """``path`` itself, or for an ``hf://org/name[@rev]`` address the artifact pulled into the
    Hugging Face cache (every file checked against the Hub's hashes; the chunk checksums are
    left to the reader, which checks them as it reads)."""
    return pull(path, chunks=False) if is_hf_uri(path) else path
