"""Tensor-parallel loading on this machine (issue 15): 2 gloo ranks, each a fresh process.

Contenders, on a Gemma-2B-shaped checkpoint (random bf16 weights) converted with
``lct convert --tp-pieces 2``:

* one process: ``lct.load(ART)`` (reads and decodes everything);
* ``torchrun --nproc_per_node 2 -m lct load ART --tp --json``: each rank reads its pieces;
* ``torchrun --nproc_per_node 2``: ``AutoModelForCausalLM.from_pretrained(SRC, tp_plan="auto")``
  on the safetensors source, the peer.

Per rank: bytes read and decoded, peak RSS (VmHWM), time from process start to ready and to
the first generated token (greedy, from token ids: the checkpoint has no tokenizer); a job is
ready when its slowest rank is. The contenders run ``--runs`` times, interleaved, and the table
gives medians with their ranges: on this VM one contender's time moves by a second from run to
run, more than the difference under test. Before
every contender free memory is primed (``--prime`` GiB touched and freed, as
``benchmarks/bench_load.py`` does): this VM hands idle memory back to the host and charges 1-2 s
per GB for touching it again, which a loader that decodes into fresh memory pays and one that
maps the page cache does not. Gemma-2B
itself has one key/value head, which no tensor-parallel plan can split over 2 ranks (transformers
builds it and fails in the first forward; LCT refuses it at load), so the checkpoint is
Gemma-2B's shape with 2 key/value heads (0.5 % more parameters).

    python benchmarks/bench_tp.py --out bench_out      # ~4 min with 3 runs; writes
                                                       # bench_out/tp2_results.md (+ .json)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from bench_load import drop_caches, prime_memory  # this folder is on sys.path as a script

PY = sys.executable

SINGLE = """
import json, time
t0 = time.perf_counter()
import lct, torch
from lct.loader import LoadStats
from lct.proc import peak_rss, process_age
s = LoadStats()
model = lct.load({art!r}, stats=s)
ready = process_age()
model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=1, do_sample=False)
print(json.dumps({{"ready_s": ready, "first_token_s": process_age(), "bytes_read": s.bytes_read,
                  "bytes_decoded": s.bytes_decoded, "peak_rss_bytes": peak_rss()}}))
"""

PEER = """
import json, torch, torch.distributed as dist
dist.init_process_group("gloo")
from transformers import AutoModelForCausalLM
from lct.proc import peak_rss, process_age
model = AutoModelForCausalLM.from_pretrained({src!r}, tp_plan="auto", dtype=torch.bfloat16)
ready = process_age()
model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=1, do_sample=False)
line = json.dumps({{"rank": dist.get_rank(), "ready_s": ready, "first_token_s": process_age(),
                   "peak_rss_bytes": peak_rss()}})
for turn in range(dist.get_world_size()):
    if turn == dist.get_rank():
        print(line, flush=True)
    dist.barrier()
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list, world: int) -> list:
    out = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                          "--master_port", str(_port()), *args], capture_output=True, text=True,
                         check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return sorted((json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")),
                  key=lambda r: r.get("rank", 0))


def prepare(out: Path) -> tuple:
    import torch

    from lct.demo import tiny
    src = out / "gemma-2b-kv2"
    if not (src / "model.safetensors").exists():
        print("building the Gemma-2B-shaped checkpoint with 2 KV heads ...", flush=True)
        tiny.save_tiny(src, "gemma", dtype=torch.bfloat16,
                       **dict(tiny.GEMMA_2B, num_key_value_heads=2))
    art = out / "gemma-2b-kv2-tp2.lct"
    if not (art / "lct.json").exists():
        print("converting with --tp-pieces 2 ...", flush=True)
        subprocess.run([PY, "-m", "lct", "convert", str(src), "-o", str(art), "--tp-pieces",
                        "2", "--force", "-q"], check=True)
    return src, art


def _spread(values: list, fmt: str = "{:.1f}") -> str:
    """The median, with the range when there were several runs."""
    med = fmt.format(median(values))
    if len(values) < 2:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3,
                    help="interleaved runs of each contender; the table gives medians (ranges)")
    ap.add_argument("--cold", action="store_true",
                    help="empty the page cache before each contender (root; a job starting on "
                         "a node that has not read the weights yet)")
    ap.add_argument("--prime", type=int, default=8,
                    help="GiB of memory touched and freed before each contender (0: none)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    src, art = prepare(args.out)

    if args.cold and not drop_caches():
        sys.exit("--cold needs root (writes /proc/sys/vm/drop_caches)")

    def prime():
        if args.prime:
            prime_memory(args.prime)
        if args.cold:
            drop_caches()
    script = args.out / "bench_tp_peer.py"
    script.write_text(PEER.format(src=str(src)))
    singles, lct_runs, peer_runs = [], [], []
    for run in range(args.runs):
        # Interleaved, so that the VM's slow minutes fall on every contender alike.
        print(f"run {run + 1}/{args.runs}: one process ...", flush=True)
        prime()
        singles.append(json.loads(subprocess.run(
            [PY, "-c", SINGLE.format(art=str(art))], check=True, capture_output=True,
            text=True).stdout.splitlines()[-1]))
        print(f"run {run + 1}/{args.runs}: lct load --tp ...", flush=True)
        prime()
        lct_runs.append(_torchrun(["-m", "lct", "load", str(art), "--tp", "--ids", "1,5,9",
                                   "--max-new-tokens", "1", "--json"], args.world))
        print(f"run {run + 1}/{args.runs}: from_pretrained(tp_plan='auto') ...", flush=True)
        prime()
        peer_runs.append(_torchrun([str(script)], args.world))
    gb = 1e9
    rows = [("one process, lct.load", _spread([r["bytes_read"] / gb for r in singles], "{:.2f}"),
             _spread([r["bytes_decoded"] / gb for r in singles], "{:.2f}"),
             _spread([r["peak_rss_bytes"] / gb for r in singles], "{:.2f}"),
             _spread([r["ready_s"] for r in singles]),
             _spread([r["first_token_s"] for r in singles]))]
    for rank in range(args.world):
        rs = [run[rank] for run in lct_runs]
        rows.append((f"lct load --tp, rank {rank}",
                     _spread([r["bytes_read"] / gb for r in rs], "{:.2f}"),
                     _spread([r["bytes_decoded"] / gb for r in rs], "{:.2f}"),
                     _spread([r["peak_rss_bytes"] / gb for r in rs], "{:.2f}"),
                     _spread([r["process_start_to_ready_s"] for r in rs]),
                     _spread([r["process_start_to_first_token_s"] for r in rs])))
    for rank in range(args.world):
        rs = [run[rank] for run in peer_runs]
        rows.append((f"from_pretrained(tp_plan='auto'), rank {rank}", "-", "-",
                     _spread([r["peak_rss_bytes"] / gb for r in rs], "{:.2f}"),
                     _spread([r["ready_s"] for r in rs]),
                     _spread([r["first_token_s"] for r in rs])))
    # A job is ready when its slowest rank is: per run, the latest rank.
    def job(runs, key):
        return [max(r[key] for r in run) for run in runs]
    single = {k: median([r[k] for r in singles])
              for k in ("bytes_read", "bytes_decoded", "peak_rss_bytes")}
    ratio_read = max(r["bytes_read"] for run in lct_runs for r in run) / single["bytes_read"]
    ratio_dec = max(r["bytes_decoded"] for run in lct_runs for r in run) / \
        single["bytes_decoded"]
    ratio_rss = median(job(lct_runs, "peak_rss_bytes")) / single["peak_rss_bytes"]
    ready, peer_ready = (median(job(lct_runs, "process_start_to_ready_s")),
                         median(job(peer_runs, "ready_s")))
    first, peer_first = (median(job(lct_runs, "process_start_to_first_token_s")),
                         median(job(peer_runs, "first_token_s")))
    lines = ["| contender | read GB | decoded GB | peak RSS GB | start to ready s | "
             "start to first token s |", "|---|---|---|---|---|---|"] + \
        ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", f"per-rank read / one process: {ratio_read:.3f} (target <= 0.55); decoded: "
                  f"{ratio_dec:.3f} (<= 0.55); peak RSS (median of the slowest rank): "
                  f"{ratio_rss:.3f} (<= 0.6)",
              f"job ready (slowest rank, median of {args.runs}): {ready:.2f} s vs "
              f"from_pretrained(tp_plan) {peer_ready:.2f} s (target: no later); first token "
              f"{first:.2f} s vs {peer_first:.2f} s",
              f"notes (rank 0): {'; '.join(lct_runs[0][0]['notes'])}",
              f"measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores, "
              f"{args.prime} GiB primed before each contender, "
              f"{'page cache emptied' if args.cold else 'page cache warm'}, "
              f"{args.runs} interleaved runs (medians, ranges in brackets)"]
    text = "\n".join(lines)
    tag = f"tp{args.world}{'_cold' if args.cold else ''}"
    (args.out / f"{tag}_results.md").write_text(text + "\n")
    (args.out / f"{tag}_results.json").write_text(json.dumps(
        {"single": singles, "lct": lct_runs, "peer": peer_runs}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
