"""``az://`` artifacts (lct/cloud/azure.py) against a real Azure Blob Storage server on loopback
(Azurite, started by these tests: tests/cloud_servers.py), with a proxy of our own in front for
the faults: the cases every store passes (tests/cloud_cases.py) and what is Azure's own
(connection strings, keys, SAS)."""

import pytest
import torch

pytest.importorskip("azure.storage.blob")
from cloud_cases import *  # noqa: E402,F403 - the shared cases, collected here
from cloud_cases import BUCKET, IDS, _env, _one_line  # noqa: E402
from cloud_servers import AZURITE_ACCOUNT, AZURITE_KEY, AzuriteServer  # noqa: E402

import lct  # noqa: E402
from lct import cloud  # noqa: E402
from lct.errors import ObjectStoreAuthError, ObjectStoreError  # noqa: E402

SERVER = AzuriteServer
SCHEME = "az"
REPLACED = (ObjectStoreError, "changed while it was read")     # Azurite honours If-Match


def upload_order(server, log, prefix: str) -> list:
    """The names under ``prefix`` in the order their uploads finished (the proxy's log)."""
    order = []
    for e in log:
        if e["method"] == "PUT" and f"/{prefix}/" in e["path"]:
            name = e["path"].rsplit("/", 1)[1]
            order = [n for n in order if n != name] + [name]
    return order


def CONDITION(entry) -> str:  # noqa: N802 - the shared cases' name for it
    """The ETag a read asked for (``If-Match``)."""
    got = [v for k, v in entry["headers"] if k.lower() == "if-match"]
    return got[0].strip('"') if got else None


def test_no_account_is_one_line_naming_what_to_set(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, {})
    for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ObjectStoreAuthError, match="AZURE_STORAGE_CONNECTION_STRING") as e:
        lct.open(f"az://{BUCKET}/tiny/llama.lct")
    _one_line(e)


def test_a_wrong_key_and_a_read_only_sas_are_refused_where_they_must_be(server, pushed, tiny,
                                                                         monkeypatch, tmp_path):
    """A connection string with another key: access denied. One with a SAS that may read and
    list: the artifact opens, a push is refused."""
    from datetime import datetime, timedelta, timezone

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas
    wrong = AZURITE_KEY[:-8] + "AAAAAAA="
    _env(monkeypatch, tmp_path, {"AZURE_STORAGE_CONNECTION_STRING": server.connection_string(
        server.endpoint, AccountKey=wrong)})
    with pytest.raises(ObjectStoreAuthError, match="access denied") as e:
        lct.open(pushed)
    _one_line(e)
    sas = generate_container_sas(AZURITE_ACCOUNT, BUCKET, account_key=AZURITE_KEY,
                                 permission=ContainerSasPermissions(read=True, list=True),
                                 expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string(
        server.endpoint, AccountKey=None, SharedAccessSignature=sas))
    with lct.open(pushed) as art:
        assert art.read_group(art.groups[0])
    with pytest.raises(ObjectStoreAuthError, match="access denied") as e:
        cloud.push(tiny, f"az://{BUCKET}/readonly/llama.lct")
    _one_line(e)


# Azure's other spellings of an address ------------------------------------------------------

@pytest.mark.parametrize("uri", [
    f"abfs://{BUCKET}@{AZURITE_ACCOUNT}.dfs.core.windows.net/tiny/llama.lct",
    f"abfss://{BUCKET}@{AZURITE_ACCOUNT}.dfs.core.windows.net/tiny/llama.lct/",
    f"https://{AZURITE_ACCOUNT}.blob.core.windows.net/{BUCKET}/tiny/llama.lct",
])
def test_the_addresses_azure_users_paste_read_as_az(uri, pushed, tiny, direct):
    """abfs(s)://CONTAINER@ACCOUNT.dfs... and https://ACCOUNT.blob.../CONTAINER/PREFIX are the
    artifact at az://CONTAINER/PREFIX of that account: parsed so, and loaded equal to the local
    load (the connection string, here Azurite's, is the named account's)."""
    from lct.cloud.objects import client_options, parse_uri
    assert cloud.is_cloud_uri(uri)
    cls, bucket, prefix = parse_uri(uri)
    assert (cls.scheme, bucket, prefix) == ("az", BUCKET, "tiny/llama.lct")
    assert client_options(uri) == {"account": AZURITE_ACCOUNT}
    want = lct.load(tiny, cache=False)(IDS).logits
    assert torch.equal(lct.load(uri, cache=False)(IDS).logits, want)


def test_other_https_addresses_are_not_object_stores_and_a_folder_is_asked_for(direct):
    for uri in ("https://example.com/models/llama.lct",
                f"https://{AZURITE_ACCOUNT}.blob.core.windows.net.example.com/{BUCKET}/x",
                f"abfs://{BUCKET}@{AZURITE_ACCOUNT}.blob.core.windows.net/x"):
        assert not cloud.is_cloud_uri(uri), uri
    from lct.errors import ObjectStoreURIError
    with pytest.raises(ObjectStoreURIError, match="give the artifact's folder") as e:
        lct.open(f"https://{AZURITE_ACCOUNT}.blob.core.windows.net/{BUCKET}")
    _one_line(e)


def test_an_address_naming_another_account_than_the_credentials_is_refused(pushed, direct,
                                                                            monkeypatch):
    """The account an address names is the one read: a connection string, or a key in the
    environment, for another account is one line naming both, never a read of the wrong one."""
    uri = f"https://otheraccount.blob.core.windows.net/{BUCKET}/tiny/llama.lct"
    with pytest.raises(ObjectStoreAuthError, match="'otheraccount'.*'devstoreaccount1'") as e:
        lct.open(uri)
    _one_line(e)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_KEY", AZURITE_KEY)
    with pytest.raises(ObjectStoreAuthError, match="AZURE_STORAGE_ACCOUNT='devstoreaccount1'"):
        lct.open(uri)


def test_an_address_naming_its_account_needs_no_account_variable(monkeypatch, tmp_path):
    """With a key (or SAS) but no AZURE_STORAGE_ACCOUNT, the client is made for the account
    the address names, at its public endpoint (made, not connected: no request is sent)."""
    from lct.cloud.objects import client_for
    _env(monkeypatch, tmp_path, {"AZURE_STORAGE_KEY": AZURITE_KEY})
    for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT"):
        monkeypatch.delenv(k, raising=False)
    client, bucket, prefix = client_for(f"abfss://{BUCKET}@myaccount.dfs.core.windows.net/m.lct")
    assert client.client.account_name == "myaccount"
    assert client.client.url.startswith("https://myaccount.blob.core.windows.net")
    assert (bucket, prefix) == (BUCKET, "m.lct")
