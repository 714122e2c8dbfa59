"""Streaming an artifact's chunks straight from the Hub by HTTP range requests.

``open_remote("org/name", "main")`` downloads only the small files (manifest, config, tokenizer,
Maximus state) through the Hugging Face cache, pins the revision to its commit so that every
request reads one immutable snapshot, and returns an ``Artifact`` whose data files are read by
``HttpRangeStore``: each chunk is one ``Range`` request on the file's resolve URL, verified
against its checksum like a local read, with the loader's prefetch window deciding how many are
in flight. No data file is downloaded whole.

Example:
    >>> with lct.hub.remote.open_remote("me/gemma-2b-lct") as art:
    ...     layer0 = art.read_group("layers.0")      # fetches only that group's chunks
"""

from __future__ import annotations

import time

from lct.errors import ArtifactNotFoundError, ChecksumError, HubError, HubOfflineError
from lct.format import constants as C
from lct.hub.address import parse_hf_uri, split_address, where
from lct.hub.client import _hub, hub_error, hub_timeout
from lct.hub.pull import check_files, check_snapshot, raise_corrupt, transient_status
from lct.io.store import STREAM_MIN_RATE, RemoteStore, receive_range

# Statuses worth retrying (the request may succeed a moment later).
RETRY_STATUS = (408, 429, 500, 502, 503, 504)


class _Transient(Exception):
    pass


class HttpRangeStore(RemoteStore):
    """Data files of a Hub repo at one commit, read by HTTP range requests.

    The same interface as ``lct.io.store.LocalStore`` (``describe``, ``size``, ``read_range``,
    ``release``, ``close``); thread-safe. Requests go through ``huggingface_hub``'s HTTP session
    (its proxy settings and ``HF_HUB_OFFLINE`` apply) with the caller's token; redirects to the
    storage host are followed (the token is not sent off the Hub). Transient failures (connection
    errors, timeouts, 429/5xx, a connection dropped mid-body) are retried with backoff, resuming
    from the bytes already received. Every answer must be ``206 Partial Content`` with exactly
    the requested range: a server that ignores ``Range`` is refused rather than letting it send
    a whole file.

    Args:
        repo_id: ``org/name``.
        revision: the commit sha (a branch works, but may move between requests).
        token: a Hub token (default: ``HF_TOKEN`` or the stored login).
        endpoint: the Hub URL (default: ``HF_ENDPOINT``).
        sizes: known file sizes ``{name: bytes}`` (others are asked with a HEAD request).
        timeout: seconds to wait for the server on each request (default: LCT_HUB_TIMEOUT or
            ``lct.hub.client.HUB_TIMEOUT``).
        retries: attempts after transient failures between which less than
            ``lct.io.store.STREAM_PROGRESS_RESET`` bytes arrived (a server that sends a few
            bytes and hangs up every time runs out of them).
        backoff: first retry delay in seconds (doubles each time).
        min_rate: bytes a second a transfer must average, after ``timeout`` seconds of grace:
            a server trickling slower is dropped and retried (``STREAM_MIN_RATE``).
    """

    def __init__(self, repo_id: str, revision: str, token=None, *, endpoint: str | None = None,
                 sizes: dict | None = None, timeout: float | None = None, retries: int = 5,
                 backoff: float = 0.5, min_rate: int = STREAM_MIN_RATE):
        hh = _hub()
        from huggingface_hub.utils import build_hf_headers, get_session
        self.repo_id, self.revision, self.token, self.endpoint = repo_id, revision, token, endpoint
        if timeout is None:
            timeout = hub_timeout()
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.min_rate = min_rate
        self._hh = hh
        self._session = get_session()
        self._headers = build_hf_headers(token=token)
        self._headers["Accept-Encoding"] = "identity"   # byte ranges of the stored bytes
        self._sizes = dict(sizes or {})
        self._start()
        self.ranges: list = []      # (name, offset, size) of every range read, in order

    def url(self, name: str) -> str:
        """The resolve URL of file ``name`` at this store's revision."""
        return self._hh.hf_hub_url(self.repo_id, name, revision=self.revision,
                                   endpoint=self.endpoint)

    def describe(self, name: str) -> str:
        """How to name the file in messages: ``hf://org/name@rev/file``."""
        return f"hf://{self.repo_id}@{self.revision[:12]}/{name}"

    def size(self, name: str) -> int:
        """The file's size in bytes (from the repo listing, or a HEAD request).

        Raises:
            ArtifactNotFoundError: the file is not in the repo at this revision.
        """
        with self._lock:
            if name in self._sizes:
                return self._sizes[name]
        from huggingface_hub import errors as herr
        try:
            meta = self._hh.get_hf_file_metadata(self.url(name), token=self.token,
                                                 endpoint=self.endpoint, retry_on_errors=True)
        except herr.RemoteEntryNotFoundError as e:
            raise ArtifactNotFoundError(f"{self.describe(name)}: data file missing from the "
                                        f"repo") from e
        except Exception as e:  # noqa: BLE001
            raise hub_error(e, self.repo_id, self.revision) from e
        if meta.size is None:
            raise HubError(f"{self.describe(name)}: the Hub did not say the file's size")
        with self._lock:
            self._sizes[name] = meta.size
        return meta.size

    @staticmethod
    def _transient(e: Exception, name: str) -> str:
        """Why ``e`` is worth retrying (a ``_Transient``); anything else is raised as it is."""
        if not isinstance(e, _Transient):
            raise e
        return str(e)

    @staticmethod
    def _gave_up(message: str) -> Exception:
        return HubOfflineError(message)

    def _fetched(self, name: str, offset: int, n: int) -> None:
        with self._lock:
            self.ranges.append((name, offset, n))

    def _fetch(self, name: str, offset: int, end: int, buf: bytearray, got: list) -> None:
        import httpx2
        from huggingface_hub import errors as herr
        from huggingface_hub.utils import hf_raise_for_status
        start, url = offset + got[0], self.url(name)
        want = end - start
        headers = dict(self._headers, Range=f"bytes={start}-{end - 1}")
        try:
            with self._session.stream("GET", url, headers=headers, timeout=self.timeout) as r:
                with self._lock:
                    self.requests += 1
                if r.status_code in RETRY_STATUS:
                    raise _Transient(f"HTTP {r.status_code}")
                if r.status_code != 206:
                    if r.status_code >= 400:
                        r.read()
                        hf_raise_for_status(r)
                    raise HubError(f"{self.describe(name)}: asked for bytes {start}-{end - 1}, "
                                   f"got HTTP {r.status_code} instead of 206 Partial Content "
                                   f"(the server does not serve byte ranges; use lct pull)")
                length = r.headers.get("Content-Length")
                if length is not None and int(length) != want:
                    raise HubError(f"{self.describe(name)}: asked for {want} bytes at {start}, "
                                   f"the server announces {length}")
                crange = r.headers.get("Content-Range", "")
                if crange and not crange.startswith(f"bytes {start}-{end - 1}/"):
                    raise HubError(f"{self.describe(name)}: asked for bytes {start}-{end - 1}, "
                                   f"got {crange}")
                try:
                    receive_range(r.iter_bytes(), buf, got, start=start, want=want,
                                  timeout=self.timeout, min_rate=self.min_rate,
                                  where=self.describe(name), error=HubError,
                                  counted=self._count)
                except TimeoutError as e:
                    raise _Transient(str(e)) from e
        except (httpx2.TransportError, httpx2.StreamError) as e:
            if isinstance(e, httpx2.ProxyError):
                raise hub_error(e, self.repo_id, self.revision) from e
            raise _Transient(f"{type(e).__name__}: {e}") from e
        except herr.OfflineModeIsEnabled as e:
            raise HubOfflineError(f"{self.describe(name)}: HF_HUB_OFFLINE is set; streaming "
                                  f"needs the Hub (use lct pull while online)") from e
        except herr.HfHubHTTPError as e:
            raise hub_error(e, self.repo_id, self.revision) from e
        if got[0] < len(buf):
            raise _Transient(f"connection closed after {got[0] - (len(buf) - want)} of {want} "
                             f"bytes")


def fetch_small(repo_id: str, revision: str | None = None, token=None, *,
                endpoint: str | None = None) -> tuple:
    """Download every file of the repo except the data files (``*.lct``) into the Hugging Face
    cache, at the commit ``revision`` resolves to, and check them against the Hub's hashes.

    Returns:
        ``(local_dir, commit_sha, {data file name: size})``.

    Raises:
        HubOfflineError: offline mode (streaming needs the Hub).
        ArtifactNotFoundError: the repo holds no ``lct.json``.
        ChecksumError: a downloaded file does not match its hash (it was discarded).
    """
    from pathlib import Path

    repo_id, revision = split_address(repo_id, revision)
    hh = _hub()
    at = where(repo_id, revision)
    if hh.constants.is_offline_mode():
        raise HubOfflineError(f"{at}: HF_HUB_OFFLINE is set, and streaming reads the chunks "
                              f"from the Hub; load it without streaming (from the cache), or "
                              f"unset HF_HUB_OFFLINE", option="stream")
    api = hh.HfApi(token=token, endpoint=endpoint)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001
        raise hub_error(e, repo_id, revision) from e
    sha = info.sha
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    if C.MANIFEST_NAME not in siblings:
        raise ArtifactNotFoundError(f"{at}: not an LCT artifact (no {C.MANIFEST_NAME} in the "
                                    f"repo)")
    sizes = {n: s.size for n, s in siblings.items() if n.endswith(".lct") and s.size is not None}
    # As a pull does (lct.hub.pull.pull_detailed): a 5xx/429, or a file that arrived corrupt
    # (removed from the cache), is fetched once more before giving up.
    for attempt in range(2):
        try:
            local = Path(hh.snapshot_download(repo_id, revision=sha, token=token,
                                              endpoint=endpoint, ignore_patterns=["*.lct"]))
        except Exception as e:  # noqa: BLE001
            if attempt == 0 and transient_status(e):
                time.sleep(1.0)
                continue
            raise hub_error(e, repo_id, revision) from e
        check_snapshot(local, at)
        _, problems = check_files(local, repo_id, sha)
        if not problems:
            return local, sha, sizes
        try:
            raise_corrupt(local, at, problems)      # which removes them from the cache
        except ChecksumError:
            if attempt == 1:
                raise


def open_remote(repo_id: str, revision: str | None = None, token=None, *, verify: bool = True,
                workers: int | None = None, pin_memory: bool = False,
                endpoint: str | None = None):
    """Open the LCT artifact in Hub repo ``repo_id`` for streaming: small files from the cache,
    chunks by HTTP range requests (see the module docstring).

    Args:
        repo_id: ``org/name`` or ``hf://org/name@revision``.
        revision: branch, tag or commit; resolved once to a commit sha.
        token: a Hub token (default: ``HF_TOKEN`` or the stored login).
        verify, workers, pin_memory: as for ``lct.io.reader.open_artifact``.
        endpoint: the Hub URL (default: ``HF_ENDPOINT``).

    Returns:
        An ``Artifact`` (``art.store`` is the ``HttpRangeStore``); close it when done.

    Raises:
        HubAuthError, HubNotFoundError, HubOfflineError, HubError: with a one-line hint.
        ManifestError: the manifest disagrees with the data files on the Hub.
    """
    from lct.io.reader import open_artifact
    local, sha, sizes = fetch_small(repo_id, revision, token, endpoint=endpoint)
    repo_id = parse_hf_uri(repo_id)[0]
    return open_artifact(local, verify=verify, workers=workers, pin_memory=pin_memory,
                         store=HttpRangeStore(repo_id, sha, token, endpoint=endpoint,
                                              sizes=sizes))
