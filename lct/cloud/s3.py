"""Artifacts in S3 and S3-compatible object stores (MinIO, SeaweedFS, Ceph, R2): ``s3://bucket/prefix``.

An artifact under ``s3://bucket/prefix`` is its folder's files as objects ``prefix/lct.json``,
``prefix/model-00001.lct``, ... . ``open_s3`` reads the manifest, downloads the small files it
names (config, tokenizer and the other side files of ``source.files``, the Maximus state), each
checked against its sha256, into a local cache folder, and reads the data files it lists by range
requests (``S3Store``), each chunk checked like a local read, the loader's prefetch window
deciding how many are in flight; ``pull`` downloads the same files and checks every chunk;
``push`` uploads a local artifact, the manifest last, and reads it back to check it. Other
objects under the prefix are never downloaded.

The client is boto3 (``pip install 'lct[s3]'``): credentials and endpoints are found the way the
AWS CLI finds them (environment, shared config and credentials files, ``AWS_PROFILE``, SSO,
instance roles; ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for an S3-compatible store).

Example:
    >>> with lct.open("s3://models/gemma-2b.lct") as art:
    ...     layer0 = art.read_group("layers.0")      # range-reads only that group's chunks
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lct.errors import (
    ArtifactNotFoundError,
    ChecksumError,
    LCTError,
    ManifestError,
    MissingDependencyError,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    ObjectStoreOfflineError,
    ObjectStoreURIError,
    WriteError,
)
from lct.format import constants as C
from lct.hashing import sha256_file
from lct.hub.client import HUB_TIMEOUT
from lct.io.store import STREAM_MIN_RATE, RemoteStore, receive_range

S3_SCHEME = "s3://"
# S3 error codes and HTTP statuses worth retrying (the request may succeed a moment later).
RETRY_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
               "RequestTimeoutException", "Throttling", "ThrottlingException", "500", "502",
               "503", "504"}
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
               "ExpiredToken", "InvalidToken", "AllAccessDisabled"}
# Bytes of a data file fetched by one GET when a file is downloaded whole (pull).
DOWNLOAD_PIECE = 64 << 20


def is_s3_uri(path) -> bool:
    """Whether ``path`` is an ``s3://`` address."""
    return isinstance(path, str) and path.startswith(S3_SCHEME)


def parse_s3_uri(uri: str) -> tuple:
    """``(bucket, prefix)`` of ``s3://bucket/prefix`` (no trailing slash on the prefix).

    Raises:
        ObjectStoreURIError: not such an address, or no prefix (an artifact is a folder).

    Example:
        >>> parse_s3_uri("s3://models/gemma-2b.lct/")
        ('models', 'gemma-2b.lct')
    """
    if not is_s3_uri(uri):
        raise ObjectStoreURIError(f"{uri!r}: not an s3://bucket/prefix address")
    bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
    prefix = prefix.strip("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket or ""):
        raise ObjectStoreURIError(f"{uri!r}: {bucket!r} is not a valid bucket name "
                                  f"(3-63 lowercase letters, digits, dots and hyphens)")
    if not prefix or any(p in ("", ".", "..") for p in prefix.split("/")):
        raise ObjectStoreURIError(f"{uri!r}: give the artifact's folder, s3://{bucket}/FOLDER")
    return bucket, prefix


def client(*, max_connections: int = 16):
    """A boto3 S3 client configured from the environment and the shared AWS files, with
    botocore's standard retries (throttling, 5xx, dropped connections before the body) and
    ``max_connections`` pooled connections."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise MissingDependencyError(f"s3:// addresses need boto3 ({e}): pip install "
                                     f"'lct[s3]'") from e
    timeout = float(os.environ.get("LCT_S3_TIMEOUT", HUB_TIMEOUT))
    retries = {} if "AWS_MAX_ATTEMPTS" in os.environ or "AWS_RETRY_MODE" in os.environ else \
        {"retries": {"max_attempts": 5, "mode": "standard"}}    # the user's settings win
    return boto3.session.Session().client("s3", config=Config(
        max_pool_connections=max_connections, connect_timeout=timeout, read_timeout=timeout,
        **retries))


def s3_error(e: BaseException, where: str) -> LCTError:
    """LCT's one-line error for a botocore exception about ``where`` (or one that boto3's
    transfer manager wrapped it in)."""
    from botocore import exceptions as bx
    inner = e
    while inner is not None and not isinstance(inner, bx.BotoCoreError | bx.ClientError):
        inner = inner.__cause__ or inner.__context__
    if inner is not None:
        e = inner
    elif "(AccessDenied)" in str(e):
        return ObjectStoreAuthError(f"{where}: access denied")
    if isinstance(e, bx.NoCredentialsError):
        return ObjectStoreAuthError(f"{where}: no AWS credentials found (set AWS_ACCESS_KEY_ID "
                                    f"and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a shared "
                                    f"credentials file)")
    if isinstance(e, bx.ClientError):
        code = _code(e)
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        msg = e.response.get("Error", {}).get("Message") or code
        if code in _AUTH_CODES or status == 403:
            return ObjectStoreAuthError(f"{where}: access denied ({code}: {msg})")
        if code in ("NoSuchBucket", "NoSuchKey", "404", "NotFound") or status == 404:
            what = "no such bucket" if code == "NoSuchBucket" else "not found"
            return ObjectStoreNotFoundError(f"{where}: {what} ({code})")
        if code in ("PreconditionFailed", "412") or status == 412:
            return ObjectStoreError(f"{where}: the object changed while it was read (its ETag "
                                    f"no longer matches); open the artifact again")
        return ObjectStoreError(f"{where}: {code or status}: {msg}")
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                      bx.ConnectionClosedError)):
        return ObjectStoreOfflineError(f"{where}: cannot reach the object store ({e})")
    return ObjectStoreError(f"{where}: {type(e).__name__}: {e}")


def _code(e: BaseException) -> str:
    from botocore import exceptions as bx
    if isinstance(e, bx.ClientError):
        return str(e.response.get("Error", {}).get("Code", "")) or \
            str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


def _transient(e: BaseException) -> bool:
    """Whether retrying may help: throttling and server errors, timeouts, connections dropped
    (before or during the body)."""
    from botocore import exceptions as bx
    from urllib3 import exceptions as ux
    if isinstance(e, bx.ClientError):
        return _code(e) in RETRY_CODES
    return isinstance(e, (bx.ReadTimeoutError, bx.ConnectTimeoutError, bx.ConnectionClosedError,
                          bx.EndpointConnectionError, bx.ResponseStreamingError,
                          bx.IncompleteReadError, ux.ProtocolError, ux.ReadTimeoutError,
                          ConnectionError, TimeoutError))


def list_objects(s3, bucket: str, prefix: str) -> dict:
    """``{name relative to prefix: (size, etag)}`` of every object under ``prefix/``."""
    out = {}
    where = f"{S3_SCHEME}{bucket}/{prefix}"
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                 Prefix=prefix + "/"):
            for o in page.get("Contents", []):
                out[o["Key"][len(prefix) + 1:]] = (int(o["Size"]), o.get("ETag", ""))
    except Exception as e:
        raise s3_error(e, where) from e
    return out


class S3Store(RemoteStore):
    """Data files of an artifact in S3, read by range requests.

    The same interface as ``lct.io.store.LocalStore`` (``describe``, ``size``, ``read_range``,
    ``release``, ``close``); thread-safe (one boto3 client, its connection pool). Each request
    asks for the object as it was listed (``If-Match`` its ETag: an object replaced meanwhile is
    an error, never a mix of two versions). Every answer must be exactly the requested range.
    Transient failures (throttling, 5xx, timeouts, a connection dropped mid-body) are retried
    with backoff, resuming from the bytes already received; a transfer slower than
    ``min_rate`` after ``timeout`` seconds of grace is dropped and retried.

    Args:
        bucket, prefix: where the artifact's files are.
        objects: ``{name: (size, etag)}`` from the listing (``list_objects``).
        s3: a boto3 client (default: ``client()``).
        retries: attempts after transient failures between which less than
            ``lct.io.store.STREAM_PROGRESS_RESET`` bytes arrived.
        backoff: first retry delay in seconds (doubles each time).
    """

    def __init__(self, bucket: str, prefix: str, objects: dict, s3=None, *, retries: int = 5,
                 backoff: float = 0.25, timeout: float | None = None,
                 min_rate: int = STREAM_MIN_RATE):
        self.bucket, self.prefix = bucket, prefix
        self.s3 = s3 if s3 is not None else client()
        self._objects = dict(objects)
        self.retries, self.backoff, self.min_rate = retries, backoff, min_rate
        self.timeout = float(os.environ.get("LCT_S3_TIMEOUT", HUB_TIMEOUT)) \
            if timeout is None else timeout
        self._start()

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def describe(self, name: str) -> str:
        """How to name the file in messages: ``s3://bucket/prefix/file``."""
        return f"{S3_SCHEME}{self.bucket}/{self.key(name)}"

    def size(self, name: str) -> int:
        """The object's size in bytes, as listed.

        Raises:
            ArtifactNotFoundError: no such object under the prefix.
        """
        if name not in self._objects:
            raise ArtifactNotFoundError(f"{self.describe(name)}: data file missing from the "
                                        f"object store")
        return self._objects[name][0]

    def _transient(self, e: Exception, name: str) -> str:
        """Why ``e`` is worth retrying; raised as LCT's error where it is not."""
        if isinstance(e, LCTError):
            raise e
        if not _transient(e):
            raise s3_error(e, self.describe(name)) from e
        return _code(e) or type(e).__name__

    @staticmethod
    def _gave_up(message: str) -> Exception:
        return ObjectStoreOfflineError(message)

    def _fetch(self, name: str, offset: int, end: int, buf: bytearray, got: list) -> None:
        start = offset + got[0]
        want = end - start
        etag = self._objects.get(name, (0, ""))[1]
        args = dict(Bucket=self.bucket, Key=self.key(name), Range=f"bytes={start}-{end - 1}")
        if etag:
            args["IfMatch"] = etag
        r = self.s3.get_object(**args)
        with self._lock:
            self.requests += 1
        body = r["Body"]
        try:
            status = r.get("ResponseMetadata", {}).get("HTTPStatusCode")
            crange = r.get("ContentRange") or ""
            if status != 206 or not crange.startswith(f"bytes {start}-{end - 1}/"):
                raise ObjectStoreError(f"{self.describe(name)}: asked for bytes {start}-{end - 1}, "
                                       f"got HTTP {status} {crange or 'without a Content-Range'} "
                                       f"(the server does not serve byte ranges)")
            if int(r.get("ContentLength", want)) != want:
                raise ObjectStoreError(f"{self.describe(name)}: asked for {want} bytes at "
                                       f"{start}, the server announces {r['ContentLength']}")
            if etag and r.get("ETag") and r["ETag"] != etag:
                raise ObjectStoreError(f"{self.describe(name)}: the object changed while it was "
                                       f"read (ETag {r['ETag']}, listed {etag}); open the "
                                       f"artifact again")
            receive_range(body.iter_chunks(1 << 20), buf, got, start=start, want=want,
                          timeout=self.timeout, min_rate=self.min_rate,
                          where=self.describe(name), error=ObjectStoreError,
                          counted=self._count)
        finally:
            body.close()
        if got[0] < len(buf):
            raise ConnectionError(f"connection closed after {got[0] - (len(buf) - want)} of "
                                  f"{want} bytes")


def cache_root() -> Path:
    """Where the small files of S3 artifacts are kept: ``LCT_S3_CACHE``, or
    ``$XDG_CACHE_HOME/lct/s3`` (``~/.cache/lct/s3``)."""
    env = os.environ.get("LCT_S3_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lct" / "s3"


def _get(s3, bucket: str, key: str, where: str, etag: str = "") -> bytes:
    """A whole (small) object, as listed (``If-Match`` its ETag)."""
    args = dict(Bucket=bucket, Key=key)
    if etag:
        args["IfMatch"] = etag
    for attempt in range(6):
        try:
            r = s3.get_object(**args)
            with r["Body"] as body:
                data = body.read()
            if len(data) != int(r.get("ContentLength", len(data))):
                raise ConnectionError("short read")
            return data
        except Exception as e:
            if not _transient(e) or attempt == 5:
                raise s3_error(e, where) from e
            time.sleep(0.25 * 2 ** attempt)
    raise AssertionError("unreachable")


# The listing a fetch_small made, taken (once) by the open_s3 that follows it within this many
# seconds: a load that resolved its address first (the CLI: config and tokenizer) lists once. An
# object replaced meanwhile is still caught, by the ETag every range request must match; the
# cached files are checked again (locally) before they are used.
RELIST_AFTER_S = 30.0
# (bucket, prefix) -> (monotonic time, local folder, data objects, client, small files wanted)
_listed: dict = {}


def small_files(manifest, where: str) -> dict:
    """``{name: (size or None, sha256)}`` of the files other than data files that the manifest
    names: the side files of ``source.files`` (FORMAT.md section 1) and the Maximus state file
    (its size is not recorded).

    Raises:
        ManifestError: a side file's entry gives no sha256 and size to check it by, or the
            sizes exceed ``MAX_SIDE_FILE_BYTES`` / ``MAX_SIDE_FILES_BYTES``.
    """
    recorded = manifest.source.get("files")
    wanted, total = {}, 0
    for name in manifest.side_files():
        e = recorded[name]
        size, sha = (e.get("size"), e.get("sha256")) if isinstance(e, dict) else (None, None)
        if not isinstance(size, int) or isinstance(size, bool) or \
                not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ManifestError(f"{where}: source.files[{name!r}] gives no sha256 and size to "
                                f"check the side file by")
        if not 0 <= size <= C.MAX_SIDE_FILE_BYTES:
            raise ManifestError(f"{where}: source.files[{name!r}] records {size:,} bytes, more "
                                f"than the {C.MAX_SIDE_FILE_BYTES:,} a side file may have")
        total += size
        wanted[name] = (size, sha)
    if total > C.MAX_SIDE_FILES_BYTES:
        raise ManifestError(f"{where}: source.files records {total:,} bytes of side files, more "
                            f"than the {C.MAX_SIDE_FILES_BYTES:,} an artifact may carry")
    if manifest.maximus is not None:
        wanted[manifest.maximus["file"]] = (None, manifest.maximus["sha256"])
    return wanted


def _intact(path: Path, size, sha: str) -> bool:
    """Whether ``path`` is a regular file (not a link) with this size and sha256."""
    try:
        if not path.is_file() or path.is_symlink() or \
                (size is not None and path.stat().st_size != size):
            return False
        return sha256_file(path) == sha
    except OSError:
        return False


def _write(path: Path, data: bytes) -> None:
    """``data`` into ``path``, atomically (a unique name beside it, then ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.partial")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _prune(local: Path, keep) -> None:
    """Remove what ``local`` holds besides ``keep`` and other writers' ``.partial`` files (an
    older LCT downloaded every object under the prefix: transformers would read a stray
    tokenizer file there)."""
    for p in local.iterdir():
        if p.name in keep or (p.name.startswith(".") and p.name.endswith(".partial")):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def fetch_small(uri: str, s3=None) -> tuple:
    """Read the manifest of the artifact at ``uri`` and download the small files it names
    (``small_files``) into the cache folder ``cache_root()/bucket/prefix/<manifest digest>``;
    objects under the prefix that the manifest names neither as a data file (``files``) nor as
    a small file are never downloaded.

    Each file is checked against the manifest (sha256 and size) when it is downloaded, and
    again each time the cached copy is used: one changed, replaced or removed in the cache is
    downloaded again (a file is replaced atomically; files the manifest does not name are
    removed from the folder). So a side file that changes on the store under the same manifest
    is harmless while the cache holds the checked copy (it is the file the manifest names), and
    is refused when it must be downloaded (``ChecksumError``); a new manifest is a new digest,
    a new folder. A named side file missing from the store is left missing (verification says
    so). Costs a sha256 of the cached files (config, tokenizer) per use, no request.

    Returns:
        ``(local folder, {data file name: (size, etag)}, s3 client)``: the data files the
        manifest lists that the store holds.

    Raises:
        ObjectStoreURIError, ObjectStoreNotFoundError (no such bucket), ObjectStoreAuthError,
        ArtifactNotFoundError (no ``lct.json`` under the prefix), ObjectStoreError (a named
        file over the size caps), ManifestError, ChecksumError (a file on the store differs
        from the manifest's record), WriteError (the cache folder).
    """
    return _sync(uri, s3)[:3]


def _sync(uri: str, s3) -> tuple:
    """``fetch_small``'s work; also returns the small files it checked (``small_files``, the
    manifest included)."""
    from lct.format.manifest import Manifest
    bucket, prefix = parse_s3_uri(uri)
    s3 = s3 if s3 is not None else client()
    objects = list_objects(s3, bucket, prefix)
    where = f"{S3_SCHEME}{bucket}/{prefix}"
    if C.MANIFEST_NAME not in objects:
        raise ArtifactNotFoundError(f"{where}: not an LCT artifact (no {C.MANIFEST_NAME} under "
                                    f"the prefix)")
    _capped(where, C.MANIFEST_NAME, objects[C.MANIFEST_NAME][0], C.MAX_MANIFEST_BYTES)
    raw = _get(s3, bucket, f"{prefix}/{C.MANIFEST_NAME}", f"{where}/{C.MANIFEST_NAME}",
               objects[C.MANIFEST_NAME][1])
    manifest = Manifest.from_json(raw, f"{where}/{C.MANIFEST_NAME}")
    data = {f["name"]: objects[f["name"]] for f in manifest.files if f["name"] in objects}
    wanted = small_files(manifest, f"{where}/{C.MANIFEST_NAME}")
    wanted[C.MANIFEST_NAME] = (len(raw), hashlib.sha256(raw).hexdigest())
    local = cache_root() / bucket / prefix / wanted[C.MANIFEST_NAME][1][:16]
    stale = [n for n, (size, sha) in wanted.items() if not _intact(local / n, size, sha)]
    fetch = [n for n in stale if n in objects and n != C.MANIFEST_NAME]
    for name in fetch:                          # the store is untrusted: bounded downloads
        _capped(where, name, objects[name][0], C.MAX_SIDE_FILE_BYTES)
        size = wanted[name][0]
        if size is not None and objects[name][0] != size:
            raise ChecksumError(f"{where}/{name}: {objects[name][0]:,} bytes on the store, the "
                                f"manifest records {size:,}: not the file the artifact was "
                                f"written with")
    try:
        local.mkdir(parents=True, exist_ok=True)
        _prune(local, wanted)
        for name in stale:
            if name not in fetch and name != C.MANIFEST_NAME:
                (local / name).unlink(missing_ok=True)      # named, but not on the store
        # At the same time: each is a request's latency, and the chunks wait for all of them.
        with ThreadPoolExecutor(min(8, len(fetch) or 1)) as pool:
            blobs = pool.map(lambda n: _get(s3, bucket, f"{prefix}/{n}", f"{where}/{n}",
                                            objects[n][1]), fetch)
            for name, blob in zip(fetch, blobs, strict=True):
                size, sha = wanted[name]
                got = hashlib.sha256(blob).hexdigest()
                if (size is not None and len(blob) != size) or got != sha:
                    raise ChecksumError(f"{where}/{name}: differs from the file the manifest "
                                        f"records ({len(blob):,} bytes, sha256 {got[:12]}..., "
                                        f"expected {sha[:12]}...): changed after the artifact "
                                        f"was written")
                _write(local / name, blob)
        if C.MANIFEST_NAME in stale:
            _write(local / C.MANIFEST_NAME, raw)
    except OSError as e:
        if isinstance(e, LCTError):
            raise
        raise WriteError(f"{local}: cannot write the S3 artifact's small files ({e})") from e
    _listed[(bucket, prefix)] = (time.monotonic(), local, data, s3, wanted)
    return local, data, s3, wanted


def _capped(where: str, name: str, size: int, cap: int) -> None:
    if size > cap:
        raise ObjectStoreError(f"{where}/{name}: {size:,} bytes, more than the {cap:,} a small "
                               f"file of an artifact may have")


def open_s3(uri: str, *, verify: bool = True, workers: int | None = None,
            pin_memory: bool = False, s3=None):
    """Open the artifact at ``s3://bucket/prefix`` for streaming: small files from the cache,
    chunks by range requests (see the module docstring).

    Returns:
        An ``Artifact`` (``art.store`` is the ``S3Store``); close it when done.
    """
    from lct.io.reader import open_artifact
    bucket, prefix = parse_s3_uri(uri)
    seen = _listed.pop((bucket, prefix), None) if s3 is None else None
    if seen is not None and time.monotonic() - seen[0] < RELIST_AFTER_S and \
            all(_intact(seen[1] / n, size, sha) for n, (size, sha) in seen[4].items()):
        local, data, s3 = seen[1:4]         # resolve() listed it a moment ago
    else:
        local, data, s3 = fetch_small(uri, s3)
        _listed.pop((bucket, prefix), None)     # only a listing made before the open is reused
    store = S3Store(bucket, prefix, data, s3)
    try:
        return open_artifact(local, verify=verify, workers=workers, pin_memory=pin_memory,
                             store=store)
    except LCTError:
        store.close()
        raise


def _check(art, where: str) -> int:
    """Every chunk of the open ``art`` against its checksum; the number checked.

    Raises:
        ChecksumError: the first problem, naming the file and chunk.
    """
    from lct.errors import ChecksumError
    from lct.io.check import check_artifact
    report = check_artifact(art, decode=False, side_files=False)
    if not report.ok:
        raise ChecksumError(f"{where}: {report.failures[0]}"
                            + (f" (and {len(report.failures) - 1} more)"
                               if len(report.failures) > 1 else ""))
    return report.chunks_checked


def pull(uri: str, local_dir, *, s3=None, progress=None) -> Path:
    """Download the artifact at ``s3://bucket/prefix`` into the new folder ``local_dir``: the
    manifest, the data files it lists and the small files it names (``fetch_small``), each
    checked (every chunk; each small file's sha256); the folder appears only when all of it is
    there and checked. Other objects under the prefix are not copied.

    Args:
        progress: called as ``progress(name, bytes_done, total)`` after each piece.

    Returns:
        ``local_dir``.

    Raises:
        WriteError: ``local_dir`` exists (nothing is overwritten).
        ChecksumError: a downloaded chunk or small file does not match (nothing is left
            behind).
    """
    from lct.io.reader import open_artifact
    local_dir = Path(local_dir)
    if local_dir.exists():
        raise WriteError(f"{local_dir}: already exists; pull into a new folder",
                         option="local_dir")
    small, data, s3, wanted = _sync(uri, s3)
    bucket, prefix = parse_s3_uri(uri)
    store = S3Store(bucket, prefix, data, s3)
    staging = local_dir.parent / f".{local_dir.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    total = sum(size for size, _ in data.values())
    done = 0
    try:
        staging.mkdir(parents=True)
        for name, (size, sha) in wanted.items():
            if (small / name).is_file():
                shutil.copyfile(small / name, staging / name)
                if not _intact(staging / name, size, sha):   # the cache changed meanwhile
                    raise ChecksumError(f"{small / name}: changed while it was copied; pull "
                                        f"again")
        for name in sorted(data):
            size = data[name][0]
            with open(staging / name, "wb") as fh:
                for at in range(0, size, DOWNLOAD_PIECE):
                    fh.write(store.read_range(name, at, DOWNLOAD_PIECE, size))
                    done += min(DOWNLOAD_PIECE, size - at)
                    if progress:
                        progress(name, done, total)
                fh.flush()
                os.fsync(fh.fileno())
        with open_artifact(staging) as art:
            _check(art, uri)
        staging.rename(local_dir)
    except OSError as e:
        if isinstance(e, LCTError):
            raise
        raise WriteError(f"{local_dir}: cannot write the pulled artifact ({e})") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local_dir


def ensure_new_prefix(uri: str, s3=None) -> None:
    """Raise ``WriteError`` unless no object is under the prefix of ``uri`` (nothing LCT did not
    write is overwritten); an unreachable store or a missing bucket is its own error."""
    bucket, prefix = parse_s3_uri(uri)
    existing = list_objects(s3 if s3 is not None else client(), bucket, prefix)
    if existing:
        raise WriteError(f"{uri}: the prefix already holds {len(existing)} object(s) "
                         f"(first {next(iter(existing))!r}); push to a new prefix",
                         option="overwrite")


def push(artifact, uri: str, *, s3=None, progress=None) -> int:
    """Upload the local artifact folder ``artifact`` to ``s3://bucket/prefix`` (checked first),
    data files and side files before the manifest, so that an interrupted upload never looks
    like an artifact; then read every chunk back from the store and check it.

    Returns:
        The chunks checked after the upload.

    Raises:
        WriteError: the prefix already holds objects (nothing is overwritten).
        ChecksumError, ManifestError: the local artifact, or what the store gives back, is not
            valid.
    """
    from lct.io.reader import open_artifact
    root = Path(artifact)
    bucket, prefix = parse_s3_uri(uri)
    s3 = s3 if s3 is not None else client()
    from lct.hub.push import artifact_files
    with open_artifact(root) as art:
        _check(art, str(root))
        names, _ = artifact_files(root, art.manifest)   # what the manifest lists, confined
    ensure_new_prefix(uri, s3)
    order = [root / n for n in names if n != C.MANIFEST_NAME] + [root / C.MANIFEST_NAME]
    total = sum(p.stat().st_size for p in order)
    done = 0
    from boto3.s3.transfer import TransferConfig
    config = TransferConfig(multipart_chunksize=DOWNLOAD_PIECE, max_concurrency=4)
    for p in order:
        name = p.relative_to(root).as_posix()
        try:
            s3.upload_file(str(p), bucket, f"{prefix}/{name}", Config=config)
        except Exception as e:
            raise s3_error(e, f"{uri}/{name}") from e
        done += p.stat().st_size
        if progress:
            progress(name, done, total)
    with open_s3(uri, s3=s3) as art:
        return _check(art, uri)
