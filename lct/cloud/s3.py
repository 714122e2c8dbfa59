"""S3 and S3-compatible object stores (MinIO, SeaweedFS, Ceph, R2): ``s3://bucket/prefix``.

The client is boto3 (``pip install 'lct[s3]'``): credentials and endpoints are found the way the
AWS CLI finds them (environment, shared config and credentials files, ``AWS_PROFILE``, SSO,
instance roles; ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for an S3-compatible store).
Reads are conditioned on the listed ETag (``If-Match``). What an artifact in a store is, and how
it is opened, pulled and pushed: ``lct.cloud.objects``.

Example:
    >>> with lct.open("s3://models/gemma-2b.lct") as art:
    ...     layer0 = art.read_group("layers.0")      # range-reads only that group's chunks
"""

from __future__ import annotations

import os
from pathlib import Path

from lct.cloud.objects import DOWNLOAD_PIECE, Backend, request_timeout
from lct.errors import (
    LCTError,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    ObjectStoreOfflineError,
)

# S3 error codes and HTTP statuses worth retrying (the request may succeed a moment later).
RETRY_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
               "RequestTimeoutException", "Throttling", "ThrottlingException", "500", "502",
               "503", "504"}
# Connections boto3 pools (the read-ahead's threads and pull's, with room to spare).
MAX_CONNECTIONS = 16
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
               "ExpiredToken", "InvalidToken", "AllAccessDisabled"}


class S3(Backend):
    """S3 through boto3: uploads by a client with botocore's standard retries (throttling,
    5xx, dropped connections before the body), listings and reads by one without them, which
    LCT retries itself, saying so (``reads``); ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` win
    for both. ``MAX_CONNECTIONS`` pooled connections each."""

    scheme = "s3"
    label = "S3"
    extra = "s3"

    def connect(self):
        return self._client(attempts=5)

    @property
    def reads(self):
        """The client for listings and reads (``list``, ``get``, ``read_range``), with no
        retries of botocore's: LCT retries those itself (``Backend._retried``, and
        ``RemoteStore`` resumes a range), and the two
        together made a stalled server one request's timeout times 25 before a word. Where
        ``AWS_MAX_ATTEMPTS`` or ``AWS_RETRY_MODE`` is set, the user's choice holds for both."""
        if getattr(self, "_reads", None) is None:
            self._reads = self._client(attempts=1)
        return self._reads

    def _client(self, attempts: int):
        try:
            import boto3
            from botocore import exceptions as bx
            from botocore.config import Config
        except ImportError as e:
            raise self.missing(e, "boto3") from e
        timeout = request_timeout()
        retries = {} if "AWS_MAX_ATTEMPTS" in os.environ or "AWS_RETRY_MODE" in os.environ \
            else {"retries": {"max_attempts": attempts, "mode": "standard"}}
        try:
            return boto3.session.Session().client("s3", config=Config(
                max_pool_connections=MAX_CONNECTIONS, connect_timeout=timeout,
                read_timeout=timeout, **retries))
        except bx.ProfileNotFound as e:
            raise ObjectStoreAuthError(f"S3: {e} (AWS_PROFILE={os.environ.get('AWS_PROFILE')!r}"
                                       f"; unset it or add the profile to ~/.aws/config)") from e
        except ValueError as e:     # botocore's "Invalid endpoint: 127.0.0.1:9000"
            url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            hint = f" (AWS_ENDPOINT_URL {url!r} needs http:// or https://)" \
                if url and "://" not in url else ""
            raise ObjectStoreError(f"S3: cannot make a client: {e}{hint}") from e

    def list(self, bucket: str, prefix: str) -> dict:
        out = {}
        for page in self.reads.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix + "/"):
            for o in page.get("Contents", []):
                out[o["Key"][len(prefix) + 1:]] = (int(o["Size"]), o.get("ETag", ""))
        return out

    def get(self, bucket: str, key: str, version: str) -> bytes:
        args = dict(Bucket=bucket, Key=key, **({"IfMatch": version} if version else {}))
        r = self.reads.get_object(**args)
        with r["Body"] as body:
            data = body.read()
        if len(data) != int(r.get("ContentLength", len(data))):
            raise ConnectionError("short read")
        return data

    def read_range(self, bucket: str, key: str, start: int, end: int, version: str, take,
                   where: str) -> None:
        want = end - start
        args = dict(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                    **({"IfMatch": version} if version else {}))
        r = self.reads.get_object(**args)
        body = r["Body"]
        try:
            status = r.get("ResponseMetadata", {}).get("HTTPStatusCode")
            crange = r.get("ContentRange") or ""
            if status != 206 or not crange.startswith(f"bytes {start}-{end - 1}/"):
                raise ObjectStoreError(f"{where}: asked for bytes {start}-{end - 1}, got HTTP "
                                       f"{status} {crange or 'without a Content-Range'} (the "
                                       f"server does not serve byte ranges)")
            if int(r.get("ContentLength", want)) != want:
                raise ObjectStoreError(f"{where}: asked for {want} bytes at {start}, the "
                                       f"server announces {r['ContentLength']}")
            if version and r.get("ETag") and r["ETag"] != version:
                raise ObjectStoreError(f"{where}: the object changed while it was read (ETag "
                                       f"{r['ETag']}, listed {version}); open the artifact "
                                       f"again")
            for block in body.iter_chunks(1 << 20):
                take(block)
        finally:
            body.close()

    def put_file(self, bucket: str, key: str, path: Path) -> None:
        from boto3.s3.transfer import TransferConfig
        self.client.upload_file(str(path), bucket, key, Config=TransferConfig(
            multipart_chunksize=DOWNLOAD_PIECE, max_concurrency=4))

    def error(self, e: BaseException, where: str) -> LCTError:
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
            return ObjectStoreAuthError(f"{where}: no AWS credentials found (set "
                                        f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                        f"AWS_PROFILE, or a shared credentials file)")
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
                return ObjectStoreError(f"{where}: the object changed while it was read (its "
                                        f"ETag no longer matches); open the artifact again")
            return ObjectStoreError(f"{where}: {code or status}: {msg}")
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError,
                          bx.ReadTimeoutError, bx.ConnectionClosedError)):
            return ObjectStoreOfflineError(f"{where}: cannot reach the object store ({e})")
        return ObjectStoreError(f"{where}: {type(e).__name__}: {e}")

    def transient(self, e: BaseException) -> str | None:
        from botocore import exceptions as bx
        from urllib3 import exceptions as ux
        if isinstance(e, bx.ClientError):
            code = _code(e)
            return code if code in RETRY_CODES else None
        if isinstance(e, (bx.ReadTimeoutError, bx.ConnectTimeoutError, bx.ConnectionClosedError,
                          bx.EndpointConnectionError, bx.ResponseStreamingError,
                          bx.IncompleteReadError, ux.ProtocolError, ux.ReadTimeoutError)):
            return type(e).__name__
        return super().transient(e)


def _code(e: BaseException) -> str:
    from botocore import exceptions as bx
    if isinstance(e, bx.ClientError):
        return str(e.response.get("Error", {}).get("Code", "")) or \
            str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""
