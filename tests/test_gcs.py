"""``gs://`` artifacts (lct/cloud/gcs.py) against a real Google Cloud Storage server on loopback
(gcp-storage-emulator, started by these tests: tests/cloud_servers.py), with a proxy of our own in
front for the faults: the cases every store passes (tests/cloud_cases.py) and what is Google's
own (credentials, generations)."""

import re

import pytest

pytest.importorskip("google.cloud.storage")
from cloud_cases import *  # noqa: E402,F403 - the shared cases, collected here
from cloud_cases import BUCKET, DATA, _env, _one_line  # noqa: E402
from cloud_servers import GCSServer  # noqa: E402

import lct  # noqa: E402
from lct import cloud  # noqa: E402
from lct.errors import ChecksumError, ObjectStoreAuthError, ObjectStoreError  # noqa: E402

SERVER = GCSServer
SCHEME = "gs"
# gcp-storage-emulator ignores ifGenerationMatch (real GCS answers 412, "changed while it was
# read"; the request carries it, test_a_streamed_load_...): here the replaced bytes are caught
# by the chunk checksums, naming the object.
REPLACED = (ChecksumError, "checksum mismatch")


def upload_order(server, log, prefix: str) -> list:
    """The names under ``prefix`` in the order they were written: their generations."""
    client, bucket, pre = cloud.objects.client_for(f"gs://{BUCKET}/{prefix}")
    listed = client.list(bucket, pre)
    return sorted(listed, key=lambda n: int(listed[n][1]))


def CONDITION(entry) -> str:  # noqa: N802 - the shared cases' name for it
    """The generation a read asked for (``ifGenerationMatch``)."""
    m = re.search(r"[?&]ifGenerationMatch=(\d+)", entry["target"])
    return m[1] if m else None


def test_a_server_that_ignores_range_is_refused(pushed, faulty):
    faulty.set_fault("ignore_range", match=DATA)
    with pytest.raises(ObjectStoreError, match="does not serve byte ranges") as e:
        lct.load(pushed, cache=False)
    _one_line(e)


def test_no_credentials_is_one_line_naming_what_to_set(monkeypatch, tmp_path):
    """Neither an emulator nor application-default credentials (and, so that nothing leaves
    the machine, no metadata server probe): one line naming GOOGLE_APPLICATION_CREDENTIALS."""
    _env(monkeypatch, tmp_path, {})
    for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    with pytest.raises(ObjectStoreAuthError, match="GOOGLE_APPLICATION_CREDENTIALS") as e:
        lct.open(f"gs://{BUCKET}/tiny/llama.lct")
    _one_line(e)


def test_the_registry_serves_every_scheme_the_reader_lets_through():
    from lct.io.reader import ADDRESS_SCHEMES
    assert set(ADDRESS_SCHEMES) == {"hf"} | set(cloud.Backend.registry)
    assert lct.cloud.is_cloud_uri("gs://b/x") and not lct.cloud.is_cloud_uri("gs:/b/x")
