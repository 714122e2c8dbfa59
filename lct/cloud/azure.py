"""Azure Blob Storage: ``az://container/prefix``, and the spellings Azure users paste:
``abfs://container@ACCOUNT.dfs.core.windows.net/prefix`` (``abfss://`` too, as fsspec's adlfs
and Spark write them) and ``https://ACCOUNT.blob.core.windows.net/container/prefix`` (the
portal's URL), which name the account as well.

The client is azure-storage-blob (``pip install 'lct[azure]'``; why this one:
docs/BENCHMARKS.md, "bench_cloud_clients"). The account and its credential are found as the
Azure CLI finds them: ``AZURE_STORAGE_CONNECTION_STRING`` (it names the endpoint too: Azurite's
development account is one), else ``AZURE_STORAGE_ACCOUNT`` with ``AZURE_STORAGE_KEY`` or
``AZURE_STORAGE_SAS_TOKEN``, else ``DefaultAzureCredential`` (``pip install azure-identity``:
environment, workload and managed identity, the Azure CLI's login). Reads are conditioned on the
listed ETag (``If-Match``). What an artifact in a store is, and how it is opened, pulled and
pushed: ``lct.cloud.objects``.

Example:
    >>> with lct.open("az://models/gemma-2b.lct") as art:
    ...     layer0 = art.read_group("layers.0")
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lct.cloud.objects import Backend, first_line, request_timeout
from lct.errors import (
    LCTError,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    ObjectStoreOfflineError,
)

RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
BLOCK = 1 << 20     # bytes of a response body read at a time
NO_ACCOUNT = ("no Azure storage account given (set AZURE_STORAGE_CONNECTION_STRING, or "
              "AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN)")
# Azure's other spellings of an address: the container, the account, the prefix.
ACCOUNT = r"(?P<account>[a-z0-9]{3,24})"
SPELLINGS = (
    re.compile(r"abfss?://(?P<bucket>[^@/]+)@" + ACCOUNT
               + r"\.dfs\.core\.windows\.net(?:/(?P<prefix>.*))?"),
    re.compile(r"https://" + ACCOUNT
               + r"\.blob\.core\.windows\.net/(?P<bucket>[^/]+)(?:/(?P<prefix>.*))?"),
)
NO_CREDENTIAL = ("no credential for the Azure storage account (set AZURE_STORAGE_KEY or "
                 "AZURE_STORAGE_SAS_TOKEN, or pip install azure-identity and log in for "
                 "DefaultAzureCredential)")


class Azure(Backend):
    """Azure Blob Storage through one azure-storage-blob service client; its own retries are
    off for reads (``RemoteStore`` retries and resumes) and short for uploads."""

    scheme = "az"
    label = "Azure Blob Storage"
    extra = "azure"
    container = "container"
    bucket_pattern = r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}"
    bucket_rule = "3-63 lowercase letters, digits and single hyphens"

    def __init__(self, account: str | None = None):
        self.account = account          # the account the address names, if it names one
        super().__init__()

    @classmethod
    def canonical(cls, uri: str) -> tuple | None:
        for spelling in SPELLINGS:
            m = spelling.fullmatch(uri)
            if m:
                return f"az://{m['bucket']}/{m['prefix'] or ''}", {"account": m["account"]}
        return None

    def connect(self):
        try:
            from azure.storage.blob import BlobServiceClient, ExponentialRetry
        except ImportError as e:
            raise self.missing(e, "azure-storage-blob") from e
        t = request_timeout()
        # Bodies read 1 MiB at a time, not azure-core's 4 KiB: 2.2x the range reads of 16 MiB
        # on 4 threads at a third of the client's CPU (Azurite, docs/BENCHMARKS.md).
        kw = dict(connection_timeout=t, read_timeout=t, connection_data_block_size=BLOCK,
                  retry_policy=ExponentialRetry(initial_backoff=1, increment_base=2,
                                                retry_total=3))
        conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        if conn:
            try:
                client = BlobServiceClient.from_connection_string(conn, **kw)
            except ValueError as e:
                raise ObjectStoreAuthError(f"az://: AZURE_STORAGE_CONNECTION_STRING is not a "
                                           f"connection string ({first_line(e)})") from e
            if self.account and client.account_name != self.account:
                raise ObjectStoreAuthError(
                    f"az://: the address names the account {self.account!r}, "
                    f"AZURE_STORAGE_CONNECTION_STRING is for {client.account_name!r} (unset "
                    f"it, or write the address as az://CONTAINER/PREFIX)")
            return client
        named = os.environ.get("AZURE_STORAGE_ACCOUNT")
        key = os.environ.get("AZURE_STORAGE_KEY") or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
        if self.account and named and named != self.account and key:
            raise ObjectStoreAuthError(
                f"az://: the address names the account {self.account!r}, the key or SAS in the "
                f"environment is for AZURE_STORAGE_ACCOUNT={named!r}")
        account = self.account or named
        if not account:
            raise ObjectStoreAuthError(f"az://: {NO_ACCOUNT}")
        url = f"https://{account}.blob.core.windows.net"
        credential = key
        if credential is None:
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError as e:
                raise ObjectStoreAuthError(f"az://{account}: {NO_CREDENTIAL}") from e
            credential = DefaultAzureCredential()
        return BlobServiceClient(url, credential=credential, **kw)

    def list(self, bucket: str, prefix: str) -> dict:
        from azure.core.exceptions import ResourceNotFoundError
        out = {}
        try:
            for b in self.client.get_container_client(bucket).list_blobs(
                    name_starts_with=prefix + "/"):
                out[b.name[len(prefix) + 1:]] = (int(b.size), str(b.etag or ""))
        except ResourceNotFoundError as e:
            if getattr(e, "error_code", None) == "ContainerNotFound":
                raise ObjectStoreNotFoundError(f"{self.uri(bucket)}: no such container") from e
            raise
        return out

    def _download(self, bucket: str, key: str, version: str, **kw):
        from azure.core import MatchConditions
        cond = dict(etag=version, match_condition=MatchConditions.IfNotModified) \
            if version else {}
        return self.client.get_blob_client(bucket, key).download_blob(
            max_concurrency=1, retry_total=0, **cond, **kw)

    def get(self, bucket: str, key: str, version: str) -> bytes:
        return self._download(bucket, key, version).readall()

    def read_range(self, bucket: str, key: str, start: int, end: int, version: str, take,
                   where: str) -> None:
        d = self._download(bucket, key, version, offset=start, length=end - start)
        if d.size != end - start:
            raise ObjectStoreError(f"{where}: asked for bytes {start}-{end - 1}, the server "
                                   f"announces {d.size} bytes (the server does not serve "
                                   f"byte ranges)")
        if version and d.properties.etag and d.properties.etag.strip('"') != version.strip('"'):
            raise ObjectStoreError(f"{where}: the object changed while it was read (ETag "
                                   f"{d.properties.etag}, listed {version}); open the artifact "
                                   f"again")
        for block in d.chunks():
            take(block)

    def put_file(self, bucket: str, key: str, path: Path) -> None:
        with open(path, "rb") as fh:    # overwrite=False: If-None-Match *, never a replace
            self.client.get_blob_client(bucket, key).upload_blob(
                fh, length=os.fstat(fh.fileno()).st_size, overwrite=False, max_concurrency=4)

    def error(self, e: BaseException, where: str) -> LCTError:
        """LCT's one-line error for an azure-core / azure-identity exception about
        ``where``."""
        from azure.core import exceptions as ax
        if type(e).__name__ == "CredentialUnavailableError":    # azure-identity's
            return ObjectStoreAuthError(f"{where}: {NO_CREDENTIAL}")
        if isinstance(e, ax.ClientAuthenticationError):
            return ObjectStoreAuthError(f"{where}: access denied ({_code(e)})")
        if isinstance(e, ax.ResourceNotFoundError):
            what = "no such container" if _code(e) == "ContainerNotFound" else "not found"
            return ObjectStoreNotFoundError(f"{where}: {what} ({_code(e)})")
        if isinstance(e, ax.ResourceModifiedError) or getattr(e, "status_code", None) == 412:
            return ObjectStoreError(f"{where}: the object changed while it was read (its ETag "
                                    f"no longer matches); open the artifact again")
        if isinstance(e, ax.ResourceExistsError):
            return ObjectStoreError(f"{where}: already exists ({_code(e)})")
        if isinstance(e, ax.HttpResponseError) and e.status_code in (401, 403):
            return ObjectStoreAuthError(f"{where}: access denied ({_code(e)})")
        if isinstance(e, (ax.ServiceRequestError, ax.ServiceResponseError)):
            return ObjectStoreOfflineError(f"{where}: cannot reach the object store "
                                           f"({first_line(e)})")
        if isinstance(e, ax.HttpResponseError):
            return ObjectStoreError(f"{where}: HTTP {e.status_code}: {_code(e)}")
        return ObjectStoreError(f"{where}: {type(e).__name__}: {first_line(e)}")

    def transient(self, e: BaseException) -> str | None:
        from azure.core import exceptions as ax
        if isinstance(e, ax.HttpResponseError) and not isinstance(e, ax.IncompleteReadError):
            return f"HTTP {e.status_code}" if e.status_code in RETRY_STATUSES else None
        if isinstance(e, (ax.ServiceRequestError, ax.ServiceResponseError,
                          ax.IncompleteReadError)):
            return type(e).__name__
        return super().transient(e)


def _code(e) -> str:
    """The storage error code of an azure-core error, else its HTTP status."""
    return str(getattr(e, "error_code", None) or getattr(e, "status_code", None)
               or type(e).__name__)
