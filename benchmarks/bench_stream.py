"""Streaming throughput against its bound: min(read bandwidth, decode bandwidth x cores).

Each measurement runs in its own process on the Gemma-2B-shaped artifact that
``benchmarks/bench_load.py`` prepares (``bench_out/gemma-2b-random.lct``):

- read: the data files read sequentially with 16 MiB ``readinto`` calls, page cache dropped
  first (needs root; skipped otherwise) -- stored bytes/s, shown as decoded bytes/s too;
- decode per core: every chunk decoded by one thread (``workers=1``) from the page cache into a
  buffer that is dropped at once (second of two passes) -- decoded bytes/s;
- decode per core, kept: the same but every buffer kept, as a loader must (fresh pages);
- stream: ``art.stream(prefetch=2)`` with every group kept (what ``lct.load`` does, without the
  model), cold and warm -- decoded bytes/s.

    python benchmarks/bench_stream.py --out bench_out --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_load import drop_caches  # same folder: the script's directory is on sys.path

PY = sys.executable

READ = r'''
import json, sys, time
from pathlib import Path
import lct
art = lct.open(sys.argv[1])
files = [Path(sys.argv[1]) / f["name"] for f in art.manifest.files]
buf = bytearray(16 << 20)
t0 = time.perf_counter(); n = 0
for p in files:
    with open(p, "rb", buffering=0) as fh:
        while (k := fh.readinto(buf)):
            n += k
dt = time.perf_counter() - t0
print("RESULT " + json.dumps({"stored_per_s": n / dt}))
'''

DECODE = r'''
import json, sys, time
import lct
keep = sys.argv[2] == "keep"
art = lct.open(sys.argv[1], workers=1)
chunks = art.manifest.chunks
total = sum(c.decoded_size for c in chunks)
for i in range(len(chunks)):  # first pass: page cache warm, allocator warm
    art.read_chunk(i)
held = []
t0 = time.perf_counter()
for i in range(len(chunks)):
    b = art.read_chunk(i)
    if keep:
        held.append(b)
dt = time.perf_counter() - t0
print("RESULT " + json.dumps({"decoded_per_s": total / dt}))
'''

STREAM = r'''
import json, sys, time
import lct
art = lct.open(sys.argv[1])
held = []
t0 = time.perf_counter()
with art.stream(prefetch=2) as s:
    for g in s:
        held.append(g)
    st = s.stats
dt = time.perf_counter() - t0
print("RESULT " + json.dumps({"decoded_per_s": st.bytes_decoded / dt,
                              "stored_per_s": st.bytes_read / dt}))
'''


def run(code: str, *args: str) -> dict:
    proc = subprocess.run([PY, "-c", code, *args], capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"measurement failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    art = args.out / "gemma-2b-random.lct"
    if not (art / "lct.json").exists():
        sys.exit(f"{art}: missing; run benchmarks/bench_load.py first (it builds the artifact)")
    import lct
    with lct.open(art) as a:
        stored = sum(c.stored_size for c in a.manifest.chunks)
        decoded = sum(c.decoded_size for c in a.manifest.chunks)
    ratio = decoded / stored
    cores = os.cpu_count() or 1
    cold = drop_caches()
    rows: dict = {k: [] for k in ("read cold", "decode/core", "decode/core kept", "stream cold",
                                  "stream warm")}
    for rep in range(args.reps):
        if cold:
            drop_caches()
            rows["read cold"].append(run(READ, str(art))["stored_per_s"] * ratio)
            drop_caches()
            rows["stream cold"].append(run(STREAM, str(art))["decoded_per_s"])
        rows["stream warm"].append(run(STREAM, str(art))["decoded_per_s"])
        rows["decode/core"].append(run(DECODE, str(art), "drop")["decoded_per_s"])
        rows["decode/core kept"].append(run(DECODE, str(art), "keep")["decoded_per_s"])
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1] / 1e9:.2f}" for k, v in rows.items() if v),
              flush=True)
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    lines = [f"Artifact: {stored / 1e9:.2f} GB stored, {decoded / 1e9:.2f} GB decoded "
             f"(ratio {ratio:.3f}); {cores} cores; medians of {args.reps} runs, each in a fresh "
             f"process. All rates in decoded GB/s.", "",
             "| measurement | GB/s |", "|---|---|"]
    lines += [f"| {k} | {v / 1e9:.2f} |" for k, v in med.items()]
    for label, per_core in (("in cache", "decode/core"), ("kept (fresh pages)", "decode/core kept")):
        for s in ("stream cold", "stream warm"):
            if s not in med:
                continue
            # Warm, the data is in the page cache: only decoding bounds the stream.
            read = med.get("read cold", float("inf")) if s == "stream cold" else float("inf")
            bound = min(read, med[per_core] * cores)
            lines.append(f"| {s} / min(read, decode {label} × {cores}) | "
                         f"{med[s] / bound:.0%} of {bound / 1e9:.2f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    (args.out / "stream_results.md").write_text(report)
    (args.out / "stream_results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
