"""What every object store shares: the registry of stores by address scheme, the streaming
store, and the protocol by which an artifact is listed, opened, pulled and pushed.

An artifact under ``SCHEME://bucket/prefix`` is its folder's files as objects ``prefix/lct.json``,
``prefix/model-00001.lct``, ... . ``open_cloud`` lists the prefix once, reads the manifest (as
listed: its ETag or generation), downloads the small files it names (config, tokenizer and the
other side files of ``source.files``, the Maximus state), each checked against its sha256, into
a local cache folder, and reads the data files it lists by range requests (``ObjectStore``),
each as it was listed, each chunk checked like a local read, the loader's prefetch window
deciding how many are in flight; ``pull`` downloads the same files and checks every chunk;
``push`` uploads a local artifact, the manifest last, and reads it back to check it. Other
objects under the prefix are never downloaded.

A store is a ``Backend`` subclass (``lct.cloud.s3``, ``lct.cloud.gcs``, ``lct.cloud.azure``):
it registers its scheme by being defined and speaks its client library in a handful of calls
(list, one range request, one whole small object, one upload, and what a client error means);
everything else is here, once. Clients are imported when a store is first used.

Example:
    >>> with lct.open("gs://models/gemma-2b.lct") as art:
    ...     layer0 = art.read_group("layers.0")      # range-reads only that group's chunks
"""

from __future__ import annotations

import abc
import hashlib
import logging
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
    ObjectStoreError,
    ObjectStoreOfflineError,
    ObjectStoreURIError,
    WriteError,
)
from lct.format import constants as C
from lct.hashing import sha256_file
from lct.hub.client import HUB_TIMEOUT
from lct.io.store import STREAM_MIN_RATE, RemoteStore, range_receiver

log = logging.getLogger(__name__)

# Where the small files of artifacts in object stores are kept (default
# $XDG_CACHE_HOME/lct/cloud), and a request's timeout in seconds (default: the Hub's).
CACHE_ENV = "LCT_CLOUD_CACHE"
TIMEOUT_ENV = "LCT_CLOUD_TIMEOUT"
# Bytes of a data file fetched by one request when a file is downloaded whole (pull).
DOWNLOAD_PIECE = 64 << 20
# A listing made by ``resolve`` (lct.load: the small files first, for the model's config and
# tokenizer) is reused by the ``open`` that follows within this many seconds, if the files it
# checked are still intact in the cache; older ones are listed again. Objects replaced in
# between are refused at the first range read (their ETag or generation no longer matches),
# and the cached small files are checked again (locally) before they are used.
RELIST_AFTER_S = 30.0
# (scheme, bucket, prefix) -> (monotonic time, local folder, data objects, client, small files)
_listed: dict = {}


def request_timeout() -> float:
    """A request's timeout in seconds: ``LCT_CLOUD_TIMEOUT``, else the Hub's.

    Raises:
        LCTError: ``LCT_CLOUD_TIMEOUT`` is not a number of seconds above 0.
    """
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return float(HUB_TIMEOUT)
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise LCTError(f"{TIMEOUT_ENV} must be a number of seconds above 0, got {value!r}")
    return seconds


def first_line(e, limit: int = 200) -> str:
    """The first line of an exception's text, at most ``limit`` characters (a client's may
    carry a whole response), or its type's name."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= limit else line[:limit] + "..."


class Backend(abc.ABC):
    """One object store's client, connected: a subclass per store, registered by its
    ``scheme`` when it is defined (``Backend.registry``). An instance is thread-safe (one
    client, its connection pool).

    A subclass sets ``scheme``, ``label`` (the store's name in messages), ``extra`` (the
    ``pip install 'lct[EXTRA]'`` that brings its client), ``container`` (what the store calls a
    bucket), ``bucket_pattern``/``bucket_rule`` (a valid name, and how to say it), and
    implements ``connect``, ``list``, ``get``, ``read_range``, ``put_file``, ``error`` and
    ``transient``: each raises the client's own exceptions, which the callers here turn into
    LCT's one-line errors with ``error``. An object's *version* is what a read is conditioned
    on: its ETag (S3, Azure) or generation (GCS), as listed.
    """

    registry: dict = {}
    scheme = ""
    label = ""
    extra = ""
    container = "bucket"
    bucket_pattern = r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]"
    bucket_rule = "3-63 lowercase letters, digits, dots and hyphens"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.scheme:
            Backend.registry[cls.scheme] = cls

    def __init__(self):
        self.client = self.connect()

    @classmethod
    def canonical(cls, uri: str) -> tuple | None:
        """``(scheme://bucket/prefix, client options)`` for another spelling of this store's
        addresses that users paste (Azure's ``abfs://`` and ``https://ACCOUNT.blob...``), the
        options what the address names beyond a bucket (an account); None where ``uri`` is not
        such a spelling. A store without other spellings keeps this one."""
        return None

    # What a store implements (abstract: a subclass lacking one cannot be made) ----------------
    @abc.abstractmethod
    def connect(self):
        """The client, configured from the environment the way the store's own tools are.

        Raises:
            MissingDependencyError: the client library is not installed (names the extra).
            ObjectStoreAuthError: no credentials found (names the variable to set).
        """

    @abc.abstractmethod
    def list(self, bucket: str, prefix: str) -> dict:
        """``{name relative to prefix: (size, version)}`` of every object under ``prefix/``."""

    @abc.abstractmethod
    def get(self, bucket: str, key: str, version: str) -> bytes:
        """A whole (small) object, as listed (conditioned on ``version``), by one request."""

    @abc.abstractmethod
    def read_range(self, bucket: str, key: str, start: int, end: int, version: str, take,
                   where: str) -> None:
        """Bytes ``[start, end)`` of the object as listed, by one request, each block handed to
        ``take(block)`` as it arrives. Raises ``ObjectStoreError`` (naming ``where``) for an
        answer that is not that range of that version, where the client lets it be seen."""

    @abc.abstractmethod
    def put_file(self, bucket: str, key: str, path: Path) -> None:
        """Upload the file ``path`` as the object ``key``, never replacing one that exists
        where the store can say so."""

    @abc.abstractmethod
    def error(self, e: BaseException, where: str) -> LCTError:
        """LCT's one-line error for the client's exception ``e`` about ``where``."""

    def transient(self, e: BaseException) -> str | None:
        """Why retrying ``e`` may help (throttling, 5xx, timeouts, a dropped connection), or
        None. The base answers for the errors the receiving loop raises itself."""
        if isinstance(e, (ConnectionError, TimeoutError)):
            return type(e).__name__
        return None

    # Shared ------------------------------------------------------------------------------------
    @classmethod
    def missing(cls, e: ImportError, package: str) -> MissingDependencyError:
        """The error for a client library that is not installed: names the extra."""
        return MissingDependencyError(f"{cls.scheme}:// addresses need {package} ({e}): pip "
                                      f"install 'lct[{cls.extra}]'")

    def fail(self, e: BaseException, where: str) -> LCTError:
        """``e`` as LCT's error (an ``LCTError`` as it is)."""
        return e if isinstance(e, LCTError) else self.error(e, where)

    @classmethod
    def uri(cls, bucket: str, key: str = "") -> str:
        """``scheme://bucket/key``."""
        return f"{cls.scheme}://{bucket}/{key}".rstrip("/")

    @classmethod
    def parse(cls, uri: str) -> tuple:
        """``(bucket, prefix)`` of ``scheme://bucket/prefix`` (no trailing slash on the prefix).

        Raises:
            ObjectStoreURIError: an invalid bucket name, or no prefix (an artifact is a folder).
        """
        bucket, _, prefix = uri[len(cls.scheme) + 3:].partition("/")
        prefix = prefix.strip("/")
        if not re.fullmatch(cls.bucket_pattern, bucket or ""):
            raise ObjectStoreURIError(f"{uri!r}: {bucket!r} is not a valid {cls.container} "
                                      f"name ({cls.bucket_rule})")
        if not prefix or any(p in ("", ".", "..") for p in prefix.split("/")):
            raise ObjectStoreURIError(f"{uri!r}: give the artifact's folder, "
                                      f"{cls.scheme}://{bucket}/FOLDER")
        return bucket, prefix

    def listing(self, bucket: str, prefix: str) -> dict:
        """``list`` with retries and backoff on transient failures (``_retried``), its
        failures as LCT's errors."""
        return self._retried(lambda: self.list(bucket, prefix), self.uri(bucket, prefix))

    def fetch(self, bucket: str, key: str, version: str = "") -> bytes:
        """``get`` with retries and backoff on transient failures (``_retried``), its
        failures as LCT's errors."""
        return self._retried(lambda: self.get(bucket, key, version), self.uri(bucket, key))

    def _retried(self, call, where: str, retries: int = 5, backoff: float = 0.25):
        """``call()``, again after a transient failure (``transient``), up to ``retries``
        times with doubling delays from ``backoff`` seconds, each retry said on LCT's log (a
        server that stopped answering is otherwise a silent wait of every try's timeout);
        the last failure, or one not worth retrying, raised as LCT's error about ``where``."""
        for attempt in range(retries + 1):
            try:
                return call()
            except Exception as e:
                why = None if isinstance(e, LCTError) else self.transient(e)
                if why is None or attempt == retries:
                    raise self.fail(e, where) from e
                delay = backoff * 2 ** attempt
                log.warning("%s: %s; retry %d of %d in %.2f s", where, why, attempt + 1,
                            retries, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


def scheme_of(path) -> str | None:
    """The object store scheme of ``path`` (``"s3"``, ``"gs"``, ``"az"``; ``"az"`` for
    Azure's other spellings too), or None."""
    m = re.match(r"([a-z0-9]+)://", path) if isinstance(path, str) else None
    if not m:
        return None
    if m[1] in Backend.registry:
        return m[1]
    return next((cls.scheme for cls in Backend.registry.values() if cls.canonical(path)), None)


def is_cloud_uri(path) -> bool:
    """Whether ``path`` is an object store address (``s3://``, ``gs://``, ``az://``)."""
    return scheme_of(path) is not None


def parse_uri(uri: str) -> tuple:
    """``(Backend subclass, bucket, prefix)`` of an object store address.

    Raises:
        ObjectStoreURIError: not such an address, or an invalid one.

    Example:
        >>> parse_uri("gs://models/gemma-2b.lct/")[1:]
        ('models', 'gemma-2b.lct')
    """
    scheme = scheme_of(uri)
    if scheme is None:
        raise ObjectStoreURIError(f"{uri!r}: not an object store address ("
                                  + ", ".join(f"{s}://bucket/prefix" for s in Backend.registry)
                                  + ")")
    cls = Backend.registry[scheme]
    other = cls.canonical(uri)
    return (cls, *cls.parse(other[0] if other else uri))


def client_options(uri: str) -> dict:
    """What the address ``uri`` names for its client beyond bucket and prefix (the account of
    an Azure ``https://ACCOUNT.blob...`` address), ``{}`` for most."""
    scheme = scheme_of(uri)
    other = Backend.registry[scheme].canonical(uri) if scheme else None
    return dict(other[1]) if other else {}


def client_for(uri: str, client: Backend | None = None) -> tuple:
    """``(client, bucket, prefix)`` for ``uri``: ``client`` if given, else a new one (with
    the options the address names, ``client_options``)."""
    cls, bucket, prefix = parse_uri(uri)
    if client is not None and not isinstance(client, cls):
        raise ObjectStoreURIError(f"{uri}: the client given speaks {client.scheme}://, not "
                                  f"{cls.scheme}://")
    return (client if client is not None else cls(**client_options(uri))), bucket, prefix


def _listing_key(uri: str) -> tuple:
    cls, bucket, prefix = parse_uri(uri)
    return cls.scheme, bucket, prefix, tuple(sorted(client_options(uri).items()))


class ObjectStore(RemoteStore):
    """Data files of an artifact in an object store, read by range requests.

    The same interface as ``lct.io.store.LocalStore`` (``describe``, ``size``, ``read_range``,
    ``release``, ``close``); thread-safe. Each request asks for the object as it was listed
    (its ETag or generation: an object replaced meanwhile is an error, never a mix of two
    versions). Every answer must be exactly the requested range. Transient failures
    (throttling, 5xx, timeouts, a connection dropped mid-body) are retried with backoff,
    resuming from the bytes already received; a transfer slower than ``min_rate`` after
    ``timeout`` seconds of grace is dropped and retried.

    Args:
        client: a ``Backend`` (the store's connected client).
        bucket, prefix: where the artifact's files are.
        objects: ``{name: (size, version)}`` from the listing.
        retries: attempts after transient failures between which less than
            ``lct.io.store.STREAM_PROGRESS_RESET`` bytes arrived.
        backoff: first retry delay in seconds (doubles each time).
    """

    def __init__(self, client: Backend, bucket: str, prefix: str, objects: dict, *,
                 retries: int = 5, backoff: float = 0.25, timeout: float | None = None,
                 min_rate: int = STREAM_MIN_RATE):
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self._objects = dict(objects)
        self.retries, self.backoff, self.min_rate = retries, backoff, min_rate
        self.timeout = request_timeout() if timeout is None else timeout
        self._start()

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def describe(self, name: str) -> str:
        """How to name the file in messages: ``scheme://bucket/prefix/file``."""
        return self.client.uri(self.bucket, self.key(name))

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
        why = self.client.transient(e)
        if why is None:
            raise self.client.error(e, self.describe(name)) from e
        return why

    @staticmethod
    def _gave_up(message: str) -> Exception:
        return ObjectStoreOfflineError(message)

    def _fetch(self, name: str, offset: int, end: int, buf: bytearray, got: list) -> None:
        start = offset + got[0]
        want = end - start
        where = self.describe(name)
        take = range_receiver(buf, got, start=start, want=want, timeout=self.timeout,
                              min_rate=self.min_rate, where=where, error=ObjectStoreError,
                              counted=self._count)
        with self._lock:
            self.requests += 1
        self.client.read_range(self.bucket, self.key(name), start, end,
                               self._objects.get(name, (0, ""))[1], take, where)
        if got[0] < len(buf):
            raise ConnectionError(f"connection closed after {got[0] - (len(buf) - want)} of "
                                  f"{want} bytes")


def cache_root() -> Path:
    """Where the small files of artifacts in object stores are kept: ``LCT_CLOUD_CACHE``, or
    ``$XDG_CACHE_HOME/lct/cloud`` (``~/.cache/lct/cloud``); one folder per scheme in it."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lct" / "cloud"


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


def fetch_small(uri: str, client: Backend | None = None) -> tuple:
    """Read the manifest of the artifact at ``uri`` and download the small files it names
    (``small_files``) into the cache folder ``cache_root()/scheme/bucket/prefix/<manifest
    digest>``; objects under the prefix that the manifest names neither as a data file
    (``files``) nor as a small file are never downloaded.

    Each file is checked against the manifest (sha256 and size) when it is downloaded, and
    again each time the cached copy is used: one changed, replaced or removed in the cache is
    downloaded again (a file is replaced atomically; files the manifest does not name are
    removed from the folder). So a side file that changes on the store under the same manifest
    is harmless while the cache holds the checked copy (it is the file the manifest names), and
    is refused when it must be downloaded (``ChecksumError``); a new manifest is a new digest,
    a new folder. A named side file missing from the store is left missing (verification says
    so). Costs a sha256 of the cached files (config, tokenizer) per use, no request.

    Returns:
        ``(local folder, {data file name: (size, version)}, client)``: the data files the
        manifest lists that the store holds.

    Raises:
        ObjectStoreURIError, ObjectStoreNotFoundError (no such bucket), ObjectStoreAuthError,
        ArtifactNotFoundError (no ``lct.json`` under the prefix), ObjectStoreError (a named
        file over the size caps), ManifestError, ChecksumError (a file on the store differs
        from the manifest's record), WriteError (the cache folder), MissingDependencyError.
    """
    return _sync(uri, client)[:3]


def _sync(uri: str, client) -> tuple:
    """``fetch_small``'s work; also returns the small files it checked (``small_files``, the
    manifest included)."""
    from lct.format.manifest import Manifest
    client, bucket, prefix = client_for(uri, client)
    objects = client.listing(bucket, prefix)
    where = client.uri(bucket, prefix)
    if C.MANIFEST_NAME not in objects:
        raise ArtifactNotFoundError(f"{where}: not an LCT artifact (no {C.MANIFEST_NAME} under "
                                    f"the prefix)")
    _capped(where, C.MANIFEST_NAME, objects[C.MANIFEST_NAME][0], C.MAX_MANIFEST_BYTES)
    raw = client.fetch(bucket, f"{prefix}/{C.MANIFEST_NAME}", objects[C.MANIFEST_NAME][1])
    _capped(where, C.MANIFEST_NAME, len(raw), C.MAX_MANIFEST_BYTES)
    manifest = Manifest.from_json(raw, f"{where}/{C.MANIFEST_NAME}")
    data = {f["name"]: objects[f["name"]] for f in manifest.files if f["name"] in objects}
    wanted = small_files(manifest, f"{where}/{C.MANIFEST_NAME}")
    wanted[C.MANIFEST_NAME] = (len(raw), hashlib.sha256(raw).hexdigest())
    local = cache_root() / client.scheme / bucket / prefix / wanted[C.MANIFEST_NAME][1][:16]
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
            blobs = pool.map(lambda n: client.fetch(bucket, f"{prefix}/{n}", objects[n][1]),
                             fetch)
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
        raise WriteError(f"{local}: cannot write the small files of {where} ({e})") from e
    _listed[_listing_key(uri)] = (time.monotonic(), local, data, client, wanted)
    return local, data, client, wanted


def _capped(where: str, name: str, size: int, cap: int) -> None:
    if size > cap:
        raise ObjectStoreError(f"{where}/{name}: {size:,} bytes, more than the {cap:,} a small "
                               f"file of an artifact may have")


def open_cloud(uri: str, *, verify: bool = True, workers: int | None = None,
               pin_memory: bool = False, client: Backend | None = None):
    """Open the artifact at ``scheme://bucket/prefix`` for streaming: small files from the
    cache, chunks by range requests (see the module docstring).

    Returns:
        An ``Artifact`` (``art.store`` is the ``ObjectStore``); close it when done.

    Raises:
        What ``fetch_small`` raises; ``ManifestError`` and the reader's errors.

    Example:
        >>> with open_cloud("az://models/gemma-2b.lct") as art:
        ...     print(art.groups[:2])
    """
    from lct.io.reader import open_artifact
    cls, bucket, prefix = parse_uri(uri)
    key = _listing_key(uri)
    seen = _listed.pop(key, None) if client is None else None
    if seen is not None and time.monotonic() - seen[0] < RELIST_AFTER_S and \
            all(_intact(seen[1] / n, size, sha) for n, (size, sha) in seen[4].items()):
        local, data, client = seen[1:4]         # resolve() listed it a moment ago
    else:
        local, data, client = fetch_small(uri, client)
        _listed.pop(key, None)          # only a listing made before the open
    return open_artifact(local, verify=verify, workers=workers, pin_memory=pin_memory,
                         store=ObjectStore(client, bucket, prefix, data))


def _check(art, where: str) -> int:
    """Every chunk of the open ``art`` against its checksum; the number checked.

    Raises:
        ChecksumError: the first problem, naming the file and chunk.
    """
    from lct.io.check import check_artifact
    report = check_artifact(art, decode=False, side_files=False)
    if not report.ok:
        raise ChecksumError(f"{where}: {report.failures[0]}"
                            + (f" (and {len(report.failures) - 1} more)"
                               if len(report.failures) > 1 else ""))
    return report.chunks_checked


def pull(uri: str, local_dir, *, client: Backend | None = None, progress=None) -> Path:
    """Download the artifact at ``scheme://bucket/prefix`` into the new folder ``local_dir``:
    the manifest, the data files it lists and the small files it names (``fetch_small``), each
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

    Example:
        >>> pull("gs://models/gemma-2b.lct", "gemma-2b.lct")
    """
    from lct.io.reader import open_artifact
    local_dir = Path(local_dir)
    if local_dir.exists():
        raise WriteError(f"{local_dir}: already exists; pull into a new folder",
                         option="local_dir")
    small, data, client, wanted = _sync(uri, client)
    _, bucket, prefix = parse_uri(uri)
    store = ObjectStore(client, bucket, prefix, data)
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
        store.close()
        shutil.rmtree(staging, ignore_errors=True)
    return local_dir


def ensure_new_prefix(uri: str, client: Backend | None = None) -> None:
    """Raise ``WriteError`` unless no object is under the prefix of ``uri`` (nothing LCT did not
    write is overwritten); an unreachable store or a missing bucket is its own error."""
    client, bucket, prefix = client_for(uri, client)
    existing = client.listing(bucket, prefix)
    if existing:
        raise WriteError(f"{uri}: the prefix already holds {len(existing)} object(s) "
                         f"(first {next(iter(existing))!r}); push to a new prefix",
                         option="overwrite")


def push(artifact, uri: str, *, client: Backend | None = None, progress=None) -> int:
    """Upload the local artifact folder ``artifact`` to ``scheme://bucket/prefix`` (checked
    first), data files and side files before the manifest, so that an interrupted upload never
    looks like an artifact; then read every chunk back from the store and check it.

    Returns:
        The chunks checked after the upload.

    Raises:
        WriteError: the prefix already holds objects (nothing is overwritten).
        ChecksumError, ManifestError: the local artifact, or what the store gives back, is not
            valid.

    Example:
        >>> push("gemma-2b.lct", "az://models/gemma-2b.lct")
    """
    from lct.hub.push import artifact_files
    from lct.io.reader import open_artifact
    root = Path(artifact)
    client, bucket, prefix = client_for(uri, client)
    with open_artifact(root) as art:
        _check(art, str(root))
        names, _ = artifact_files(root, art.manifest)   # what the manifest lists, confined
    ensure_new_prefix(uri, client)
    order = [root / n for n in names if n != C.MANIFEST_NAME] + [root / C.MANIFEST_NAME]
    total = sum(p.stat().st_size for p in order)
    done = 0
    for p in order:
        name = p.relative_to(root).as_posix()
        try:
            client.put_file(bucket, f"{prefix}/{name}", p)
        except Exception as e:
            raise client.fail(e, client.uri(bucket, f"{prefix}/{name}")) from e
        done += p.stat().st_size
        if progress:
            progress(name, done, total)
    with open_cloud(uri, client=client) as art:
        return _check(art, uri)
