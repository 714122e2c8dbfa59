"""Which client LCT speaks each object store with: range-read throughput on LCT's request sizes,
import time and installed size, per store, each candidate against the same real server on
loopback (tests/cloud_servers.py, tests/s3_server.py).

Candidates: for Google Cloud Storage (gcp-storage-emulator) google-cloud-storage, gcsfs and
obstore; for Azure Blob Storage (Azurite) azure-storage-blob, adlfs and obstore; for S3
(SeaweedFS, ``--s3``) boto3 and obstore. Each must be installed (``pip install obstore gcsfs adlfs
google-cloud-storage azure-storage-blob``); one that is not, or cannot speak to the server, is a
row saying why.

* throughput: one object of ``--size`` MiB read as ranges of ``--piece`` MiB (LCT's read-ahead
  request, ``lct.io.store.READAHEAD_PIECE``) on ``--threads`` threads (``READAHEAD_THREADS``),
  every range checked against the object's bytes; the median of ``--reps`` passes in MB/s. The
  server runs on the same cores, so the figures compare clients on one server, not servers.
  gcp-storage-emulator reads the whole object for every range (its ``download`` handler), so its
  object is smaller (``--gcs-size``).
* import: a fresh interpreter importing the client and constructing it for the server, minus a
  bare interpreter's start; median of ``--reps``.
* installed size: the files of the client's distribution and every distribution it requires
  (``importlib.metadata``, transitively, markers evaluated), as installed here.

    python benchmarks/bench_cloud_clients.py --out bench_out/cloud_clients.md
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from cloud_servers import AzuriteServer, GCSServer  # noqa: E402

BUCKET = "bench"
KEY = "bench/object.bin"
MiB = 1 << 20


# Each candidate: distribution, the code that builds a client (``env`` holds the server's
# variables), and ``read(client, start, end) -> bytes``.
def gcs_sdk():
    from google.cloud import storage
    blob = storage.Client(project="bench").bucket(BUCKET).blob(KEY)
    return lambda a, b: blob.download_as_bytes(start=a, end=b - 1, raw_download=True,
                                               checksum=None, retry=None)


def gcs_fsspec():
    import gcsfs
    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"])
    return lambda a, b: fs.cat_file(f"{BUCKET}/{KEY}", start=a, end=b)


def gcs_obstore():
    import json
    import tempfile

    import obstore
    from obstore.store import GCSStore
    key = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)  # noqa: SIM115
    json.dump({"gcs_base_url": os.environ["STORAGE_EMULATOR_HOST"], "disable_oauth": True,
               "client_email": "", "private_key": "", "private_key_id": ""}, key)
    key.close()
    store = GCSStore(BUCKET, service_account_path=key.name, client_options={"allow_http": True})
    return lambda a, b: bytes(obstore.get_range(store, KEY, start=a, end=b))


def az_sdk(block: int | None = None):
    """azure-storage-blob as LCT configures it (``lct.cloud.azure.BLOCK``: bodies read 1 MiB at
    a time); ``az_sdk_default`` with azure-core's default of 4 KiB."""
    from azure.storage.blob import BlobServiceClient
    blob = BlobServiceClient.from_connection_string(   # 1 << 20: lct.cloud.azure.BLOCK, not
        os.environ["AZURE_STORAGE_CONNECTION_STRING"],  # imported: lct would count as import
        connection_data_block_size=block or 1 << 20).get_blob_client(BUCKET, KEY)
    return lambda a, b: blob.download_blob(offset=a, length=b - a, max_concurrency=1).readall()


def az_sdk_default():
    return az_sdk(4096)


def az_fsspec():
    import adlfs
    fs = adlfs.AzureBlobFileSystem(
        connection_string=os.environ["AZURE_STORAGE_CONNECTION_STRING"])
    return lambda a, b: fs.cat_file(f"{BUCKET}/{KEY}", start=a, end=b)


def az_obstore():
    import obstore
    from obstore.store import AzureStore
    fields = dict(f.split("=", 1) for f in
                  os.environ["AZURE_STORAGE_CONNECTION_STRING"].strip(";").split(";"))
    store = AzureStore(BUCKET, account_name=fields["AccountName"],
                       account_key=fields["AccountKey"], endpoint=fields["BlobEndpoint"],
                       client_options={"allow_http": True})
    return lambda a, b: bytes(obstore.get_range(store, KEY, start=a, end=b))


def s3_boto3():
    import boto3
    s3 = boto3.client("s3")
    return lambda a, b: s3.get_object(Bucket=BUCKET, Key=KEY,
                                      Range=f"bytes={a}-{b - 1}")["Body"].read()


def s3_obstore():
    import obstore
    from obstore.store import S3Store
    store = S3Store(BUCKET, endpoint=os.environ["AWS_ENDPOINT_URL"],
                    access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                    secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                    region=os.environ["AWS_DEFAULT_REGION"], client_options={"allow_http": True})
    return lambda a, b: bytes(obstore.get_range(store, KEY, start=a, end=b))


CANDIDATES = {
    "gs": [("google-cloud-storage", gcs_sdk), ("gcsfs", gcs_fsspec), ("obstore", gcs_obstore)],
    "az": [("azure-storage-blob", az_sdk), ("azure-storage-blob", az_sdk_default),
           ("adlfs", az_fsspec), ("obstore", az_obstore)],
    "s3": [("boto3", s3_boto3), ("obstore", s3_obstore)],
}


def closure_size(dist: str) -> tuple:
    """``(bytes, distributions)`` installed for ``dist`` and what it requires, transitively."""
    from importlib import metadata

    from packaging.requirements import Requirement
    seen, todo, total = set(), [dist], 0
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            d = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for f in d.files or []:
            try:
                total += f.locate().stat().st_size
            except OSError:
                pass
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return total, len(seen)


def import_time(fn, env: dict, reps: int) -> float:
    """Seconds a fresh interpreter takes to import and build the client, less a bare start."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); "
            f"import bench_cloud_clients as b; b.{fn.__name__}()")

    def once(c: str) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", c], env={**os.environ, **env}, check=True,
                       capture_output=True)
        return time.perf_counter() - t
    bare = statistics.median(once("import sys") for _ in range(reps))
    # bench_cloud_clients itself imports only the standard library and cloud_servers
    base = statistics.median(once(code.rsplit(";", 1)[0]) for _ in range(reps))
    return statistics.median(once(code) for _ in range(reps)) - max(bare, base)


def throughput(read, data: bytes, piece: int, threads: int, reps: int) -> float:
    """Median MB/s of reading ``data`` as ranges of ``piece`` bytes on ``threads`` threads."""
    spans = [(a, min(a + piece, len(data))) for a in range(0, len(data), piece)]

    def one(span):
        got = read(*span)
        if bytes(got) != data[span[0]:span[1]]:
            raise AssertionError(f"bytes {span} differ")
    rates = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, spans[:threads]))           # connections open, first requests made
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(one, spans))
            rates.append(len(data) / (time.perf_counter() - t) / 1e6)
    return statistics.median(rates)


def start(store: str, size: int):
    """The server for ``store`` with ``size`` random bytes at ``BUCKET/KEY``: ``(server, env,
    data)``."""
    data = os.urandom(size)
    if store == "gs":
        srv = GCSServer().start()
        srv.make_bucket(BUCKET)
        srv.put(BUCKET, KEY, data)
        return srv, srv.env(srv.endpoint), data
    if store == "az":
        srv = AzuriteServer().start()
        srv.make_bucket(BUCKET)
        srv.put(BUCKET, KEY, data)
        return srv, srv.env(srv.endpoint), data
    from s3_server import S3Server
    srv = S3Server().start()
    srv.make_bucket(BUCKET)
    env = srv.env()
    import boto3
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env[
        "AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"]).put_object(Bucket=BUCKET, Key=KEY, Body=data)
    return srv, env, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", nargs="+", choices=list(CANDIDATES), default=["gs", "az"])
    ap.add_argument("--s3", action="store_true", help="add the S3 rows (SeaweedFS)")
    ap.add_argument("--size", type=int, default=256, help="object size in MiB")
    ap.add_argument("--gcs-size", type=int, default=64, help="object size in MiB for GCS")
    ap.add_argument("--piece", type=int, default=16, help="range size in MiB")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    stores = args.stores + (["s3"] if args.s3 and "s3" not in args.stores else [])
    rows = ["| store | client | range reads (MB/s) | import + client (s) | installed (MB, "
            "distributions) |", "|---|---|---|---|---|"]
    for store in stores:
        size = (args.gcs_size if store == "gs" else args.size) * MiB
        srv, env, data = start(store, size)
        try:
            os.environ.update(env)
            for dist, fn in CANDIDATES[store]:
                try:
                    rate = throughput(fn(), data, args.piece * MiB, args.threads, args.reps)
                    rate = f"{rate:.0f}"
                    imp = f"{max(0.0, import_time(fn, env, args.reps)):.2f}"
                except Exception as e:      # noqa: BLE001 - a row saying why
                    why = str(e).strip().splitlines()[0][:90] if str(e).strip() else ""
                    rate, imp = f"fails: {type(e).__name__} {why}", "-"
                nbytes, ndist = closure_size(dist)
                label = dist + (" (4 KiB body reads, its default)" if fn is az_sdk_default
                                else "")
                rows.append(f"| {store}:// ({size // MiB} MiB object) | {label} | {rate} | {imp} "
                            f"| {nbytes / 1e6:.0f} ({ndist}) |")
                print(rows[-1], flush=True)
        finally:
            for k in env:
                os.environ.pop(k, None)
            srv.stop()
    text = "\n".join(rows) + (f"\n\n{args.piece} MiB ranges on {args.threads} threads, medians "
                              f"of {args.reps}; {os.cpu_count()} cores, Python "
                              f"{sys.version.split()[0]}.\n")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
