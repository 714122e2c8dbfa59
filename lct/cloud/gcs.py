"""Google Cloud Storage: ``gs://bucket/prefix``.

The client is google-cloud-storage (``pip install 'lct[gcs]'``; why this one:
docs/BENCHMARKS.md, "bench_cloud_clients"): credentials are found as Google's own tools find
them (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, the
metadata server on Google Cloud), ``STORAGE_EMULATOR_HOST`` points it at a local server and
``GOOGLE_CLOUD_PROJECT`` names the project (no request LCT makes needs one). Reads are
conditioned on the listed generation (``ifGenerationMatch``). What an artifact in a store is,
and how it is opened, pulled and pushed: ``lct.cloud.objects``.

Example:
    >>> with lct.open("gs://models/gemma-2b.lct") as art:
    ...     layer0 = art.read_group("layers.0")
"""

from __future__ import annotations

import os
from pathlib import Path

from lct.cloud.objects import DOWNLOAD_PIECE, Backend, first_line, request_timeout
from lct.errors import (
    LCTError,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    ObjectStoreOfflineError,
)

# HTTP statuses worth retrying (Google's guidance: 408, 429 and 5xx).
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
NO_CREDENTIALS = ("no Google credentials found (set GOOGLE_APPLICATION_CREDENTIALS to a service "
                  "account key file, or run `gcloud auth application-default login`; "
                  "STORAGE_EMULATOR_HOST for a local emulator)")


class GCS(Backend):
    """Google Cloud Storage through one google-cloud-storage client; every range read is one
    request of its own (the client's retries off: ``RemoteStore`` retries and resumes)."""

    scheme = "gs"
    label = "Google Cloud Storage"
    extra = "gcs"
    bucket_pattern = r"[a-z0-9][a-z0-9._\-]{1,61}[a-z0-9]"
    bucket_rule = "3-63 lowercase letters, digits, dots, hyphens and underscores"

    def connect(self):
        try:
            import google.auth.exceptions
            from google.cloud import storage
        except ImportError as e:
            raise self.missing(e, "google-cloud-storage") from e
        try:
            return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT"))
        except google.auth.exceptions.DefaultCredentialsError as e:
            raise ObjectStoreAuthError(f"gs://: {NO_CREDENTIALS}") from e

    def list(self, bucket: str, prefix: str) -> dict:
        from google.api_core import exceptions as gx
        out = {}
        try:
            for b in self.client.list_blobs(bucket, prefix=prefix + "/",
                                            timeout=request_timeout()):
                out[b.name[len(prefix) + 1:]] = (int(b.size), str(b.generation or ""))
        except gx.NotFound as e:
            raise ObjectStoreNotFoundError(f"{self.uri(bucket)}: no such bucket") from e
        return out

    def _blob(self, bucket: str, key: str):
        return self.client.bucket(bucket).blob(key, chunk_size=DOWNLOAD_PIECE)

    @staticmethod
    def _condition(version: str) -> dict:
        return {"if_generation_match": int(version)} if version else {}

    def get(self, bucket: str, key: str, version: str) -> bytes:
        return self._blob(bucket, key).download_as_bytes(
            checksum=None, retry=None, timeout=request_timeout(), **self._condition(version))

    def read_range(self, bucket: str, key: str, start: int, end: int, version: str, take,
                   where: str) -> None:
        self._blob(bucket, key).download_to_file(
            _Sink(take), start=start, end=end - 1, raw_download=True, checksum=None,
            retry=None, timeout=request_timeout(), **self._condition(version))

    def put_file(self, bucket: str, key: str, path: Path) -> None:
        # ifGenerationMatch=0: only if no such object exists (the store refuses a replace).
        self._blob(bucket, key).upload_from_filename(
            str(path), content_type="application/octet-stream", if_generation_match=0,
            timeout=request_timeout())

    def error(self, e: BaseException, where: str) -> LCTError:
        """LCT's one-line error for a google-cloud-storage / google-auth / requests exception
        about ``where``."""
        import google.auth.exceptions as ga
        import requests
        from google.api_core import exceptions as gx
        if isinstance(e, ga.DefaultCredentialsError):
            return ObjectStoreAuthError(f"{where}: {NO_CREDENTIALS}")
        if isinstance(e, ga.GoogleAuthError):
            return ObjectStoreAuthError(f"{where}: the Google credentials were refused "
                                        f"({first_line(e)})")
        if isinstance(e, gx.GoogleAPICallError):
            status = e.code
            if status in (401, 403):
                return ObjectStoreAuthError(f"{where}: access denied ({status}: "
                                            f"{first_line(e.message)})")
            if status == 404:
                return ObjectStoreNotFoundError(f"{where}: not found (404)")
            if status == 200:       # the SDK's answer to a whole object where a range was asked
                return ObjectStoreError(f"{where}: asked for a byte range, got HTTP 200 (the "
                                        f"server does not serve byte ranges)")
            if status == 412:
                return ObjectStoreError(f"{where}: the object changed while it was read (its "
                                        f"generation no longer matches); open the artifact "
                                        f"again")
            return ObjectStoreError(f"{where}: HTTP {status}: {first_line(e.message)}")
        if isinstance(e, (requests.ConnectionError, requests.Timeout)):
            return ObjectStoreOfflineError(f"{where}: cannot reach the object store "
                                           f"({first_line(e)})")
        return ObjectStoreError(f"{where}: {type(e).__name__}: {first_line(e)}")

    def transient(self, e: BaseException) -> str | None:
        import google.auth.exceptions as ga
        import requests
        from google.api_core import exceptions as gx
        from urllib3 import exceptions as ux
        if isinstance(e, gx.GoogleAPICallError):
            return f"HTTP {e.code}" if e.code in RETRY_STATUSES else None
        if isinstance(e, (requests.ConnectionError, requests.Timeout,
                          requests.exceptions.ChunkedEncodingError, ga.TransportError,
                          ux.ProtocolError, ux.ReadTimeoutError)):
            return type(e).__name__
        return super().transient(e)


class _Sink:
    """A file object for ``download_to_file`` that hands each block to ``take``."""

    def __init__(self, take):
        self.write_block = take

    def write(self, block) -> int:
        self.write_block(block)
        return len(block)
