"""Decoded GB/s of an artifact by the number of decode threads: what the loader's decoders can
give once the import is done, and how it scales with cores.

Each thread count runs in a fresh process that opens the artifact with ``lct.open(ART,
workers=N)`` and decodes every group by the loader's own path (``Artifact.stream``:
``--prefetch`` groups in flight, each chunk's frames and its checksum on the N decode threads,
``Artifact.decode_verified``).
The page cache is warmed first (one untimed pass over the data files), so that the figure is
the decoders' rate and not the disk's. Two columns:

* **into reused buffers**: groups are handed back (``Group.recycle``) and later ones decode into
  them, so after the first window no first touch of fresh memory is timed: the decoders' rate;
* **into fresh memory**: a fresh buffer per chunk, as a first load does: the rate a load meets
  where fresh memory costs a page fault per 4 KiB.

    python benchmarks/bench_decode.py ART [--threads 1,2] [--passes 3] [--max-gb 2] [--json out.json]

The threads default to 1, 2, 4, ... up to the cores this process may use. The last lines are a
Markdown table: decoded GB/s, GB/s per thread and the speedup over one thread, medians of
``--passes`` timed passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import json, sys, time
import lct
path, workers, passes, fresh = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
max_bytes, prefetch = float(sys.argv[5]) * 1e9, int(sys.argv[6])
with lct.open(path, workers=workers) as art:
    names, decoded, stored = [], 0, 0
    for name in art.groups:                  # the first groups, up to --max-gb decoded
        chunks = art.manifest.group_chunks(name)
        size = sum(c.decoded_size for c in chunks)
        if names and decoded + size > max_bytes:
            break
        names.append(name)
        decoded += size
        stored += sum(c.stored_size for c in chunks)
    def one_pass():
        # the loader's own path: prefetch groups in flight, each chunk's frames on the pool
        with art.stream(names, prefetch=prefetch, recycle=not fresh) as stream:
            for group in stream:
                if not fresh:
                    group.recycle()
    one_pass()                                    # untimed: threads started, pages mapped
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t)
    print(json.dumps({"times": times, "decoded": decoded, "stored": stored,
                      "workers": art.workers}))
'''


def warm(art: Path) -> None:
    """Read every file of the artifact once, so that its pages are in the page cache."""
    for f in sorted(art.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def measure(art: Path, workers: int, passes: int, fresh: bool, max_gb: float,
            prefetch: int) -> dict:
    """One fresh process decoding the groups of ``art`` (up to ``max_gb`` decoded) with
    ``workers`` threads, ``prefetch`` groups in flight."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(art), str(workers), str(passes),
                          "1" if fresh else "0", str(max_gb), str(prefetch)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"bench_decode: the child with {workers} threads failed:\n"
                         f"{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["median_s"] = statistics.median(res["times"])
    res["gb_s"] = res["decoded"] / res["median_s"] / 1e9
    return res


def default_threads() -> list:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return out + [cores]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--threads", default=None,
                    help="comma-separated thread counts (default: 1, 2, 4, ... the cores)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=2, help="groups in flight (the loader's "
                    "default, 2)")
    ap.add_argument("--max-gb", type=float, default=float("inf"),
                    help="decode only the first chunks, up to this many GB decoded (a bounded "
                         "run; default: every chunk)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")] if args.threads else default_threads()
    t0 = time.perf_counter()
    warm(args.artifact)
    rows = []
    for n in threads:
        reused = measure(args.artifact, n, args.passes, False, args.max_gb, args.prefetch)
        fresh = measure(args.artifact, n, args.passes, True, args.max_gb, args.prefetch)
        rows.append({"threads": n, "reused_gb_s": reused["gb_s"], "fresh_gb_s": fresh["gb_s"],
                     "decoded": reused["decoded"], "stored": reused["stored"]})
        print(f"{n} threads: {reused['gb_s']:.2f} GB/s into reused buffers, "
              f"{fresh['gb_s']:.2f} GB/s into fresh memory", flush=True)
    one = rows[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [f"Decode of {args.artifact.name}: {one['decoded'] / 1e9:.2f} GB decoded from "
             f"{one['stored'] / 1e9:.2f} GB stored, checksums verified, page cache warm, "
             f"{cores} cores, {args.prefetch} groups in flight; medians of {args.passes} "
             f"passes, each thread count a fresh process.", "",
             "| threads | GB/s (reused buffers) | per thread | × 1 thread | GB/s (fresh memory) "
             "| per thread | × 1 thread |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['reused_gb_s']:.2f} | "
                     f"{r['reused_gb_s'] / r['threads']:.2f} | "
                     f"{r['reused_gb_s'] / one['reused_gb_s']:.2f} | {r['fresh_gb_s']:.2f} | "
                     f"{r['fresh_gb_s'] / r['threads']:.2f} | "
                     f"{r['fresh_gb_s'] / one['fresh_gb_s']:.2f} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"artifact": str(args.artifact), "cores": cores,
                                         "rows": rows, "table": "\n".join(lines)}, indent=1))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
