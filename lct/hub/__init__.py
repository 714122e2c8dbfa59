"""Publishing and fetching LCT artifacts on the Hugging Face Hub.

``push`` verifies an artifact, writes a model card and uploads everything in one commit (large
files through LFS or Xet, as the Hub chooses); ``pull`` downloads a snapshot through the Hugging
Face cache (resumable, ``HF_HUB_OFFLINE`` respected) and verifies every checksum before handing
out its path; ``parse_hf_uri`` reads ``hf://org/name@revision``. Streaming chunks straight from
the Hub, without downloading whole files, is ``lct.hub.remote.open_remote``.

Authentication is ``HF_TOKEN`` or the stored login (``hf auth login``), or an explicit
``token=``. Hub failures become one-line ``HubError`` subclasses that say what to do.

Example:
    >>> lct.hub.push("gemma-2b.lct", "me/gemma-2b-lct")
    >>> path = lct.hub.pull("me/gemma-2b-lct")
    >>> model = lct.load("hf://me/gemma-2b-lct@main", prefetch=2)
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from lct.format import constants as C
from lct.errors import ChecksumError, CorruptChunkError, LCTError, MissingDependencyError
from lct.io.info import human
from lct.io.store import confined

HF_SCHEME = "hf://"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")
# Other files worth publishing with an artifact when they are in its folder.
EXTRA_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "USE_POLICY.md")
CARD_NAME = "README.md"


# Errors -------------------------------------------------------------------------------------
class HubError(LCTError, OSError):
    """A Hub request failed (server error, incomplete download, refused upload)."""


class HubAuthError(HubError, PermissionError):
    """Not logged in, a rejected token, or no access to the repository (401/403, gated)."""


class HubNotFoundError(HubError, FileNotFoundError):
    """No such repository, revision or file on the Hub (or a private one you cannot see)."""


class HubOfflineError(HubError, ConnectionError):
    """The Hub cannot be reached (offline mode, network down) and the cache does not help."""


class HubURIError(LCTError, ValueError):
    """Not a valid ``hf://org/name[@revision]`` address or Hub repo id."""


def _hub():
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401  (a submodule: not an attribute until imported)
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise MissingDependencyError("huggingface_hub is required for the Hub: "
                                     "pip install huggingface_hub") from e
    if _TIMEOUT[0] is None:
        use_timeout(None)
    return huggingface_hub


_TIMEOUT: list = [None]   # seconds LCT gave huggingface_hub's HTTP client (None: not yet)


def use_timeout(seconds: float | None = None) -> None:
    """Give huggingface_hub's HTTP client (every Hub call LCT makes goes through it) a timeout:
    ``seconds`` without a byte from the Hub (default: ``LCT_HUB_TIMEOUT`` or
    ``C.HUB_TIMEOUT``) ends the call in an error instead of a hang; its own default waits for
    ever. Left alone when the program installed a client factory of its own."""
    import os

    import httpx2
    from huggingface_hub.utils import _http
    if seconds is None:
        try:
            seconds = float(os.environ.get("LCT_HUB_TIMEOUT", C.HUB_TIMEOUT))
        except ValueError:
            seconds = C.HUB_TIMEOUT
    factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)
    if factory is not _http.default_client_factory and not getattr(factory, "lct", False):
        _TIMEOUT[0] = 0.0       # the program's own client: not ours to change
        return

    limit = httpx2.Timeout(seconds, connect=min(seconds, 10.0)).as_dict()

    def with_limit(request):
        _http.hf_request_event_hook(request)
        # huggingface_hub passes timeout=None on its API calls, which turns off the client's
        # default: a request that would wait for ever gets the limit here instead.
        current = request.extensions.get("timeout") or {}
        if all(v is None for v in current.values()):
            request.extensions["timeout"] = dict(limit)

    def client():
        return httpx2.Client(event_hooks={"request": [with_limit]}, follow_redirects=True,
                             timeout=httpx2.Timeout(seconds, connect=min(seconds, 10.0)))
    client.lct = True
    _http.set_client_factory(client)
    _TIMEOUT[0] = seconds


# Addresses ----------------------------------------------------------------------------------
def parse_hf_uri(uri: str) -> tuple:
    """Split ``hf://org/name@revision`` (or ``org/name@revision``) into ``(repo_id, revision)``.

    The revision is optional (``None``: the default branch) and may contain slashes
    (``hf://org/name@refs/pr/1``); a URL-encoded one (``refs%2Fpr%2F1``) is decoded.

    Raises:
        HubURIError: not a model repo address.
    """
    from urllib.parse import unquote
    if not isinstance(uri, str):
        raise HubURIError(f"{uri!r}: expected a string like hf://org/name@revision")
    rest = uri[len(HF_SCHEME):] if uri.startswith(HF_SCHEME) else uri
    repo_id, sep, revision = rest.partition("@")
    if repo_id.startswith("/"):  # hf:///name: an empty owner, not the legacy repo "name"
        raise HubURIError(f"{uri}: not a Hub model address; expected hf://org/name[@revision]")
    repo_id = repo_id.rstrip("/")
    if repo_id.startswith(("datasets/", "spaces/")):
        raise HubURIError(f"{uri}: LCT artifacts live in model repos, not {repo_id.split('/')[0]}")
    if repo_id.startswith("models/") and repo_id.count("/") == 2:
        repo_id = repo_id[len("models/"):]
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or len(repo_id) > 96:
        raise HubURIError(f"{uri}: not a Hub model address; expected hf://org/name[@revision]")
    revision = unquote(revision) if sep else None
    if sep and not revision:
        raise HubURIError(f"{uri}: empty revision after '@'")
    return repo_id, revision


def split_address(address: str, revision: str | None = None) -> tuple:
    """``(repo_id, revision)`` from ``hf://org/name@rev`` or ``org/name``; an explicit
    ``revision`` wins over one in the address."""
    repo_id, rev = parse_hf_uri(address)
    return repo_id, revision or rev


def offline_reason() -> str:
    """Why the Hub is out of reach, as far as LCT can tell: the setting, or the network."""
    try:
        import huggingface_hub.constants as hc
        if hc.HF_HUB_OFFLINE:
            return "offline mode is on (HF_HUB_OFFLINE is set)"
    except ImportError:  # pragma: no cover - a declared dependency
        pass
    return "the Hub could not be reached (no network?)"


def is_hf_uri(path) -> bool:
    """Whether ``path`` is an ``hf://`` address (a string starting with ``hf://``)."""
    return isinstance(path, str) and path.startswith(HF_SCHEME)


def local_artifact(path):
    """``path`` itself, or for an ``hf://org/name[@rev]`` address the artifact pulled into the
    Hugging Face cache (every file checked against the Hub's hashes; the chunk checksums are
    left to the reader, which checks them as it reads)."""
    return pull(path, chunks=False) if is_hf_uri(path) else path


def _where(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id


# Error mapping ------------------------------------------------------------------------------
def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _endpoint() -> str:
    try:
        return _hub().constants.ENDPOINT
    except Exception:  # noqa: BLE001
        return "the Hub"


def hub_error(e: BaseException, repo_id: str, revision: str | None = None,
              action: str = "download") -> LCTError:
    """The ``LCTError`` (with a one-line hint) for an exception raised by ``huggingface_hub``.

    ``action`` (``"download"`` or ``"push"``) picks the hint. An ``LCTError`` is returned as is;
    anything unknown becomes a ``HubError`` carrying the original message's first line.
    """
    if isinstance(e, LCTError):
        return e
    from huggingface_hub import errors as herr
    import httpx2
    where = _where(repo_id, revision)
    login = "log in with `hf auth login` or set HF_TOKEN"
    chain = list(_chain(e))

    def find(*types):
        return next((x for x in chain if isinstance(x, types)), None)

    if find(herr.OfflineModeIsEnabled) is not None:
        if action == "push":
            return HubOfflineError(f"{where}: HF_HUB_OFFLINE is set, and a push needs the Hub; "
                                   f"unset HF_HUB_OFFLINE to push")
        return HubOfflineError(f"{where}: offline (HF_HUB_OFFLINE is set) and not in the local "
                               f"Hugging Face cache; unset HF_HUB_OFFLINE, or pull it once while "
                               f"online")
    if isinstance(e, herr.LocalTokenNotFoundError):
        return HubAuthError(f"{where}: not logged in; {login}")
    http = find(herr.HfHubHTTPError)
    if isinstance(http, herr.RevisionNotFoundError):
        return HubNotFoundError(f"{repo_id}: no revision {revision!r} in this repo "
                                f"(a branch, tag or commit)")
    if isinstance(http, herr.GatedRepoError):
        return HubAuthError(f"{where}: gated repo; accept its conditions on the Hub, then {login}")
    if isinstance(http, herr.RemoteEntryNotFoundError):
        return HubNotFoundError(f"{where}: a file is missing from the repo ({_first_line(http)})")
    status = getattr(getattr(http, "response", None), "status_code", None)
    if http is not None and status == 401 and not isinstance(http, herr.RepositoryNotFoundError):
        return HubAuthError(f"{where}: the Hub rejected the token (401): HF_TOKEN or the stored "
                            f"login is invalid or expired; {login}")
    if isinstance(http, herr.RepositoryNotFoundError):
        if action == "push":
            return HubAuthError(f"{where}: cannot write to this repo: it does not exist and could "
                                f"not be created, or you have no access; {login} with a "
                                f"write token")
        return HubNotFoundError(f"{where}: no such repo on {_endpoint()}, or it is private and "
                                f"you are not logged in ({login})")
    if http is not None and status == 403:
        what = "write access to this repo or namespace" if action == "push" else "access"
        return HubAuthError(f"{where}: no access (403): your token does not grant {what}; "
                            f"check its permissions or {login}")
    if http is not None and status == 404:
        return HubNotFoundError(f"{where}: not found on {_endpoint()} ({_first_line(http)})")
    if http is not None:
        return HubError(f"{where}: the Hub answered {status}: {_first_line(http)}")
    stall = find(httpx2.TimeoutException)
    if stall is not None and not isinstance(stall, httpx2.ConnectTimeout):
        return HubOfflineError(f"{where}: {_endpoint()} stopped answering for {_TIMEOUT[0]:g} s "
                               f"({type(stall).__name__}); try again, or set LCT_HUB_TIMEOUT to "
                               f"wait longer")
    net = find(httpx2.ConnectError, httpx2.TimeoutException, httpx2.NetworkError,
               ConnectionError)
    if net is not None:
        cached = " and it is not in the local cache" if action == "download" else ""
        return HubOfflineError(f"{where}: cannot reach {_endpoint()} ({type(net).__name__}: "
                               f"{_first_line(net)}){cached}; check the network, or set "
                               f"HF_HUB_OFFLINE=1 to use only the cache")
    if isinstance(e, herr.LocalEntryNotFoundError):
        return HubOfflineError(f"{where}: not in the local Hugging Face cache and the Hub could "
                               f"not be reached")
    if isinstance(e, (herr.HFValidationError, ValueError)) and "repo" in str(e).lower() \
            and "id" in str(e).lower():
        return HubURIError(f"{repo_id}: not a valid Hub repo id ({_first_line(e)})")
    return HubError(f"{where}: {action} failed: {type(e).__name__}: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


# Model card ---------------------------------------------------------------------------------
def _source_license(manifest, token=None, endpoint=None) -> str | None:
    """The license of the artifact's source, from its model card, when it can be found cheaply:
    the local source folder, the local Hugging Face cache, or (online) the source repo's info."""
    src = manifest.source or {}
    sid, kind, rev = src.get("id"), src.get("kind"), src.get("revision")
    if not isinstance(sid, str):
        return None
    try:
        from huggingface_hub.repocard import metadata_load
        if kind == "local":
            card = Path(sid) / CARD_NAME
            meta = metadata_load(card) if card.is_file() else None
            return _license_of(meta)
        if kind != "hub":
            return None
        hh = _hub()
        cached = hh.try_to_load_from_cache(sid, CARD_NAME, revision=rev)
        if isinstance(cached, str):
            lic = _license_of(metadata_load(cached))
            if lic:
                return lic
        if hh.constants.is_offline_mode():
            return None
        info = hh.HfApi(token=token, endpoint=endpoint).model_info(
            sid, revision=rev, expand=["cardData"], timeout=10)
        data = info.card_data.to_dict() if info.card_data is not None else {}
        return _license_of(data)
    except Exception:  # noqa: BLE001 - the license is a courtesy; never fail a push over it
        return None


def _license_of(meta) -> str | None:
    lic = (meta or {}).get("license")
    return lic if isinstance(lic, str) and lic.strip() else None


def model_card(manifest, repo_id: str, *, license: str | None = None) -> str:  # noqa: A002
    """The ``README.md`` published with an artifact: front matter (``library_name: lct``,
    ``base_model``, tags, license) and a body saying how it was converted, its sizes, and how
    to load it."""
    import yaml
    src = manifest.source or {}
    pol = manifest.policy or {}
    arch = manifest.architecture or {}
    meta: dict = {"library_name": "lct"}
    if src.get("kind") == "hub" and isinstance(src.get("id"), str):
        meta["base_model"] = src["id"]
    tags = ["lct", "compressed"]
    if arch.get("model_type"):
        tags.append(str(arch["model_type"]))
    if pol.get("nf4"):
        tags.append("nf4")
    if pol.get("int8"):
        tags.append("int8")
    if manifest.maximus:
        tags.append("maximus")
    meta["tags"] = tags
    if license:
        meta["license"] = license
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip()

    name = repo_id.split("/")[-1]
    if src.get("kind") == "hub":
        origin = f"[`{src['id']}`](https://huggingface.co/{src['id']})"
        if src.get("revision"):
            origin += f" (revision `{src['revision']}`)"
    else:
        origin = "a local checkpoint" + (f" (`{Path(str(src.get('id'))).name}`)"
                                         if src.get("id") else "")
    nf4 = [str(r) for r in pol.get("nf4") or []]
    int8 = [str(r) for r in pol.get("int8") or []]
    lossy = []
    if nf4:
        lossy.append(f"{', '.join(nf4)} in NF4 (blocksize {pol.get('blocksize')}, bitsandbytes "
                     f"layout)")
    if int8:
        lossy.append(f"{', '.join(int8)} in int8 with one scale per row")
    nf4_line = "; ".join(lossy) if lossy else "none (every tensor lossless)"
    measured = pol.get("measured") if isinstance(pol.get("measured"), dict) else {}
    try:
        nf4_line += (f"; chosen by the {pol.get('mode', 'manual')} policy, estimated mean KL "
                     f"{float(measured['cost_kl']):.4f} nats ({measured['method']})")
    except (KeyError, TypeError, ValueError):
        pass
    codec = pol.get("codec", "?")
    codec_line = f"`{codec}`"
    if codec != C.CODEC_RAW:
        codec_line += f", zstd level {pol.get('level')}, frame {human(pol.get('frame_size') or 0)}"
    if manifest.maximus:
        mx = manifest.maximus
        fs = mx.get("frequency_source") or {}
        order = (f"ordered by {fs.get('tokens', 0):,} counted tokens ({fs.get('kind')})"
                 if fs.get("kind") not in (None, "none") else "in token-id order")
        maximus_line = (f"{mx.get('num_shards')} shards of {', '.join(mx.get('tensors', []))}, "
                        f"{order}")
    else:
        maximus_line = "none"
    source_bytes = manifest.source_bytes
    stored = manifest.stored_bytes
    data_bytes = sum(f["size"] for f in manifest.files)  # opening checked them on disk
    ratio = f"{stored / source_bytes:.3f}x of the source" if source_bytes else "n/a"
    rows = [
        ("source", origin),
        ("architecture", f"{arch.get('model_type') or 'unknown'} "
                         f"(group table `{arch.get('mapping')}`)"),
        ("lossless codec", codec_line),
        ("cast", f"`{pol['dtype']}`" if pol.get("dtype") else "none (source dtypes kept)"),
        ("lossy parts", nf4_line),
        ("Maximus shards", maximus_line),
        ("groups / tensors / chunks",
         f"{len(manifest.groups)} / {len(manifest.tensors)} / {len(manifest.chunks)}"),
        ("source tensors", human(source_bytes) if source_bytes else "unknown"),
        ("stored chunks", f"{human(stored)} ({ratio})"),
        ("decoded size", human(manifest.decoded_bytes)),
        ("data files", f"{len(manifest.files)} file(s), {human(data_bytes)}"),
        ("written by", f"`{manifest.created_by}`, format "
                       f"{'.'.join(map(str, manifest.format_version))}"),
    ]
    table = "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    return f"""---
{front}
---

# {name} (LCT)

This repository holds {origin} converted to **LCT** (Layer-wise Compressed Tensor format): every
transformer layer is an independent compressed chunk with its own checksum, so a loader streams
the model group by group (and can fetch each chunk with one HTTP range request).

## Load it

```python
import lct
model = lct.load("hf://{repo_id}", prefetch=2)
```

`lct.load(..., stream=True)` (or `lct load hf://{repo_id} --stream`) fetches only the chunks by
HTTP range requests instead of downloading the files first; `lct pull {repo_id}` downloads the
artifact into the Hugging Face cache and verifies every checksum. `lct export` turns it back into
safetensors for `from_pretrained`.

## How it was converted

{table}

The manifest `lct.json` records the sha256 of every source file and the xxh3 checksum of every
chunk; `lct verify` checks them.
"""


# Push ---------------------------------------------------------------------------------------
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


def _artifact_files(root: Path, manifest) -> list:
    names = [C.MANIFEST_NAME] + [f["name"] for f in manifest.files]
    if manifest.maximus:
        names.append(manifest.maximus["file"])
    names += [n for n in manifest.side_files() if (root / n).is_file()]
    names += [n for n in EXTRA_FILES if (root / n).is_file()]
    names = list(dict.fromkeys(names))   # a LICENSE carried from the source is listed once
    for n in names:
        if not confined(root / n, root):  # it would publish whatever it points at
            raise LCTError(f"{root / n}: a symbolic link that leaves the artifact folder; "
                           f"refusing to push")
        if not (root / n).is_file():
            raise LCTError(f"{root / n}: missing; refusing to push an incomplete artifact")
    return names


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
    from lct.io.reader import open_artifact
    from lct.conversion.verifier import verify

    repo_id, revision = split_address(repo_id, revision)
    root = Path(artifact)
    try:
        with open_artifact(root) as art:
            report = verify(art, progress=verify_progress)  # Maximus state included
            manifest = art.manifest
    except LCTError as e:
        raise type(e)(f"refusing to push: {e}") from e
    if not report.ok:
        raise ChecksumError(f"{root}: refusing to push an artifact that fails verification "
                            f"({len(report.failures)} problem(s)); first: {report.failures[0]}")
    names = _artifact_files(root, manifest)
    card = model_card(manifest, repo_id,
                      license=license or _source_license(manifest, token, endpoint))
    hh = _hub()
    api = hh.HfApi(token=token, endpoint=endpoint)
    big = {f["name"] for f in manifest.files}
    if manifest.maximus:
        big.add(manifest.maximus["file"])
    src = manifest.source or {}
    message = commit_message or (f"Upload LCT artifact of {src['id']}" if src.get("kind") == "hub"
                                 else "Upload LCT artifact")
    description = (f"{len(manifest.groups)} groups, {len(manifest.chunks)} chunks, "
                   f"{human(manifest.stored_bytes)} stored; verified before upload "
                   f"({report.chunks_checked} chunk checksums).")
    try:
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if revision and not create_pr and not revision.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        ops = [hh.CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(root / n)) for n in names]
        ops.append(hh.CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card.encode()))
        total = sum(op.upload_info.size for op in ops)
        done = 0
        # Large files one by one (so that progress is per file), the rest with the commit.
        for op in sorted((op for op in ops if op.path_in_repo in big),
                         key=lambda o: o.path_in_repo):
            api.preupload_lfs_files(repo_id, additions=[op], revision=revision,
                                    create_pr=create_pr)
            done += op.upload_info.size
            if progress:
                progress(op.path_in_repo, done, total)
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
                      chunks_checked=report.chunks_checked)


def _check_pushed(root: Path, ops: list, held, repo_id: str, oid: str) -> None:
    """After the commit: every file must be on the Hub with the size and hash that was sent
    (LFS: its sha256; a regular file: its git blob id), or the push failed.

    Raises:
        HubError: naming the first file the Hub holds otherwise.
    """
    from huggingface_hub.utils.sha import git_hash
    by = {s.rfilename: s for s in (held.siblings or [])}
    for op in ops:
        name = op.path_in_repo
        s = by.get(name)
        want_size, want_sha = op.upload_info.size, op.upload_info.sha256.hex()
        lfs = getattr(s, "lfs", None) if s is not None else None
        if s is None:
            got = "no such file"
        elif s.size is not None and s.size != want_size:
            got = f"{s.size} bytes"
        elif lfs is not None and getattr(lfs, "sha256", want_sha) != want_sha:
            got = f"sha256 {lfs.sha256}"
        elif lfs is None and s.blob_id is not None:
            data = op.path_or_fileobj if isinstance(op.path_or_fileobj, bytes) else \
                (root / name).read_bytes()
            got = None if s.blob_id == git_hash(data) else f"git blob {s.blob_id}"
        else:
            got = None
        if got is not None:
            raise HubError(f"{repo_id}: after the push (commit {oid[:12]}) the Hub holds "
                           f"{name} as {got}, not the {want_size} bytes sent (sha256 "
                           f"{want_sha[:16]}...): the upload was cut or changed; push again")


# Pull ---------------------------------------------------------------------------------------
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
    from huggingface_hub.utils.sha import git_hash
    return git_hash(f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
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
    chunk checksums already cover (1.8 s more for the 3.1 GB Gemma-2B-shaped artifact on the
    2-core machine of docs/BENCHMARKS.md, against 0.34 s for the chunk checks LCT runs anyway);
    and its offline counterpart, the listing ``get_cached_repo_tree`` returns, drops the LFS
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
    from lct.io.reader import open_artifact
    where = _where(repo_id, revision)
    if not (root / C.MANIFEST_NAME).is_file():
        from lct.errors import ArtifactNotFoundError
        others = [p.parent.name for p in root.parent.glob(f"*/{C.MANIFEST_NAME}")
                  if p.parent != root] if root.parent.name == "snapshots" else []
        if others:
            raise HubError(f"{where}: the Hub's answers for the files named commit "
                           f"{others[0][:12]} (X-Repo-Commit), not {root.name[:12]}, the commit "
                           f"the repo is at: a proxy or the Hub served another revision; try "
                           f"again, or pull a fixed commit (@sha)")
        raise ArtifactNotFoundError(f"{where}: not an LCT artifact (no {C.MANIFEST_NAME} in the "
                                    f"repo)")
    data_names = {n.name for n in root.glob("model-*.lct")}
    files_checked, problems = check_files(root, repo_id, revision, local_dir, skip=data_names)
    chunks_checked = 0
    if not problems:
        try:
            art = open_artifact(root)
        except LCTError as e:
            raise type(e)(f"{where}: the repo does not hold a valid LCT artifact: {e}") from e
        try:
            groups = art.groups
            if chunks:
                for i, g in enumerate(groups):
                    for chunk in art.manifest.group_chunks(g):
                        chunks_checked += 1
                        name = art.manifest.files[chunk.file]["name"]
                        try:
                            view = art.read_stored(chunk)
                            view.release()
                            art.release(chunk)
                        except (ChecksumError, CorruptChunkError) as e:
                            if not any(n == name for n, _ in problems):
                                problems.append((name, str(e)))
                    if progress:
                        progress(g, i + 1, len(groups))
            if art.manifest.maximus:
                try:
                    art.maximus_state()
                except LCTError as e:
                    problems.append((art.manifest.maximus["file"], str(e)))
        finally:
            art.close()
    if problems:
        raise_corrupt(root, where, problems, ": pull again, and if it fails again the file is "
                                             "corrupt on the Hub")
    return files_checked, chunks_checked


def _transient_status(e: BaseException) -> bool:
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
            if attempt + 1 < attempts and _transient_status(e):
                time.sleep(1.0)  # a 5xx or 429: the server may answer a moment later
                continue
            raise hub_error(e, repo_id, revision) from e
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
        raise ArtifactNotFoundError(f"{_where(repo_id, revision)}: not an LCT artifact (no "
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

