"""Real Google Cloud Storage and Azure Blob Storage servers on loopback for tests, started here.

``GCSServer`` runs gcp-storage-emulator (PyPI: ``pip install gcp-storage-emulator`` puts its
``gcp-storage-emulator`` script in the venv's ``bin/``) in memory; clients find it through
``STORAGE_EMULATOR_HOST``. ``AzuriteServer`` runs Azurite's blob service (npm: ``npm install
--prefix DIR azurite``; found in ``LCT_AZURITE_DIR``, the venv's ``azurite/`` folder, where
``.ci/run`` installs it, or on PATH) with ``--skipApiVersionCheck`` (today's azure-storage-blob
sends an API version newer than Azurite 3.37 knows) and telemetry off; clients find it through
``AZURE_STORAGE_CONNECTION_STRING`` with the well-known development account. Both listen on a
free port of 127.0.0.1 and keep their data in a temporary folder (or memory); ``stop()`` kills
the process group::

    with GCSServer() as gcs:
        gcs.make_bucket("models")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)

``env(endpoint)`` gives a client's variables for the server or for a ``FaultProxy`` in front of
it (tests/s3_server.py: it forwards requests byte for byte, so Azure's SharedKey signature, which
does not cover the host, is checked by the real server). A missing server binary raises
``ServerNotFound`` (a fixture turns it into ``pytest.skip`` with the install command).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import quote, urlsplit

from s3_server import free_ports

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/"
               "K1SZFPTOtr/KBHBeksoGMGw==")


class ServerNotFound(RuntimeError):
    """The server's program is not installed (the message says how to install it)."""


class ServerError(RuntimeError):
    """The server did not start; the message has its log tail."""


def _request(endpoint: str, method: str, path: str, body: bytes = b"", headers=None,
             timeout: float = 10.0):
    u = urlsplit(endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class _Process:
    """A server process in a session of its own, its output in a log in ``dir``."""

    name = "server"

    def __init__(self, *, timeout: float = 60.0):
        self.timeout = timeout
        self.port = free_ports(1)[0]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.dir = None
        self.startup_s = None
        self._proc = None
        self._log = None

    def command(self) -> list:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self):
        self.dir = tempfile.mkdtemp(prefix=f"lct-{self.name}-")
        self._log = open(os.path.join(self.dir, "server.log"), "wb")  # noqa: SIM115 (stop())
        t0 = time.monotonic()
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, cwd=self.dir,
                                      start_new_session=True)
        try:
            while not self._ready():
                if self._proc.poll() is not None:
                    raise ServerError(f"{self.name} exited with status {self._proc.returncode}"
                                      f"\n{self.log_tail()}")
                if time.monotonic() - t0 > self.timeout:
                    raise ServerError(f"{self.name} at {self.endpoint} not ready after "
                                      f"{self.timeout:.0f} s\n{self.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _ready(self) -> bool:
        try:
            return self.ready()
        except OSError:
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(os.path.join(self.dir, "server.log"), "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except (OSError, TypeError):
            return "(no log)"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


class GCSServer(_Process):
    """gcp-storage-emulator on 127.0.0.1, in memory (``in_memory=False``: in its folder)."""

    name = "gcs"

    def __init__(self, *, in_memory: bool = True, **kw):
        exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
        self.exe = exe if os.path.isfile(exe) else shutil.which("gcp-storage-emulator")
        if not self.exe:
            raise ServerNotFound("gcp-storage-emulator is not installed: pip install "
                                 "gcp-storage-emulator")
        self.in_memory = in_memory
        super().__init__(**kw)

    def command(self) -> list:
        return [self.exe, "start", "--host=127.0.0.1", f"--port={self.port}", "--quiet",
                *(["--in-memory"] if self.in_memory else [])]

    def ready(self) -> bool:
        return _request(self.endpoint, "GET", "/")[0] == 200

    @staticmethod
    def env(endpoint: str) -> dict:
        """A client's variables for the server (or a proxy) at ``endpoint``."""
        return {"STORAGE_EMULATOR_HOST": endpoint}

    def make_bucket(self, name: str) -> str:
        status, body = _request(self.endpoint, "POST", "/storage/v1/b?project=lct",
                                json.dumps({"name": name}).encode(),
                                {"Content-Type": "application/json"})
        if status not in (200, 409):
            raise ServerError(f"creating bucket {name!r}: HTTP {status} {body[:200]!r}")
        return name

    def put(self, bucket: str, key: str, data, timeout: float = 10.0) -> None:
        """Store ``data`` (bytes, or a file's path, sent as it is read) as the object ``key`` (a
        new generation), as another writer would, in one request: the emulator rewrites a
        resumable upload whole at every chunk, which for a file of gigabytes takes hours."""
        headers = {"Content-Type": "application/octet-stream"}
        path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}"
        if isinstance(data, (str, os.PathLike)):
            headers["Content-Length"] = str(os.path.getsize(data))
            with open(data, "rb") as f:
                status, body = _request(self.endpoint, "POST", path, f, headers, timeout)
        else:
            status, body = _request(self.endpoint, "POST", path, data, headers, timeout)
        if status != 200:
            raise ServerError(f"uploading {key!r}: HTTP {status} {body[:200]!r}")

    def get(self, bucket: str, key: str) -> bytes:
        status, body = _request(self.endpoint, "GET", f"/storage/v1/b/{bucket}/o/"
                                f"{quote(key, safe='')}?alt=media")
        if status != 200:
            raise ServerError(f"reading {key!r}: HTTP {status}")
        return body


def find_azurite() -> str | None:
    """Azurite's ``azurite-blob``: under ``LCT_AZURITE_DIR``, the venv's ``azurite/``, or on
    PATH."""
    for base in (os.environ.get("LCT_AZURITE_DIR"), os.path.join(sys.prefix, "azurite")):
        if base:
            exe = os.path.join(base, "node_modules", ".bin", "azurite-blob")
            if os.path.isfile(exe):
                return exe
    return shutil.which("azurite-blob")


class AzuriteServer(_Process):
    """Azurite's blob service on 127.0.0.1, its data in a temporary folder (or, ``in_memory``,
    in its memory)."""

    name = "azurite"

    def __init__(self, *, in_memory: bool = False, **kw):
        self.in_memory = in_memory
        self.exe = find_azurite()
        if not self.exe:
            raise ServerNotFound("Azurite is not installed: npm install --prefix "
                                 f"{os.path.join(sys.prefix, 'azurite')} azurite (or set "
                                 f"LCT_AZURITE_DIR)")
        super().__init__(**kw)

    def command(self) -> list:
        return [self.exe, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--silent",
                "--skipApiVersionCheck", "--disableTelemetry",
                *(["--inMemoryPersistence"] if self.in_memory else ["--location", self.dir])]

    def ready(self) -> bool:     # an unsigned listing is refused: the service answers
        return _request(self.endpoint, "GET", f"/{AZURITE_ACCOUNT}?comp=list")[0] in (200, 403)

    @staticmethod
    def connection_string(endpoint: str, **extra) -> str:
        """The development account's connection string for the server (or a proxy) at
        ``endpoint``; ``extra`` replaces or adds fields (``AccountKey=None`` drops one)."""
        fields = {"DefaultEndpointsProtocol": "http", "AccountName": AZURITE_ACCOUNT,
                  "AccountKey": AZURITE_KEY, "BlobEndpoint": f"{endpoint}/{AZURITE_ACCOUNT}",
                  **extra}
        return ";".join(f"{k}={v}" for k, v in fields.items() if v is not None) + ";"

    @classmethod
    def env(cls, endpoint: str) -> dict:
        """A client's variables for the server (or a proxy) at ``endpoint``."""
        return {"AZURE_STORAGE_CONNECTION_STRING": cls.connection_string(endpoint)}

    def service(self):
        from azure.storage.blob import BlobServiceClient
        return BlobServiceClient.from_connection_string(self.connection_string(self.endpoint))

    def make_bucket(self, name: str) -> str:
        from azure.core.exceptions import ResourceExistsError
        try:
            self.service().create_container(name)
        except ResourceExistsError:
            pass
        return name

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Store ``data`` as the blob ``key`` (a new ETag), as another writer would."""
        self.service().get_blob_client(bucket, key).upload_blob(data, overwrite=True)

    def get(self, bucket: str, key: str) -> bytes:
        return self.service().get_blob_client(bucket, key).download_blob().readall()
