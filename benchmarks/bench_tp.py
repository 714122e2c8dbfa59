"""Tensor-parallel loading on this machine (issue 15): 2 gloo ranks, each a fresh process.

Contenders, on a Gemma-2B-shaped checkpoint (random bf16 weights) converted with
``lct convert --tp-pieces 2``:

* one process: ``lct.load(ART)`` (reads and decodes everything);
* ``torchrun --nproc_per_node 2 -m lct load ART --tp --json``: each rank reads its pieces;
* ``torchrun --nproc_per_node 2``: ``AutoModelForCausalLM.from_pretrained(SRC, tp_plan="auto")``
  on the safetensors source, the peer.

Per rank: bytes read and decoded, peak RSS (VmHWM), time from process start to ready and to
the first generated token (greedy, from token ids: the checkpoint has no tokenizer). Before
every contender free memory is primed (``--prime`` GiB touched and freed, as
``benchmarks/bench_load.py`` does): this VM hands idle memory back to the host and charges 1-2 s
per GB for touching it again, which a loader that decodes into fresh memory pays and one that
maps the page cache does not. Gemma-2B
itself has one key/value head, which no tensor-parallel plan can split over 2 ranks (transformers
builds it and fails in the first forward; LCT refuses it at load), so the checkpoint is
Gemma-2B's shape with 2 key/value heads (0.5 % more parameters).

    python benchmarks/bench_tp.py --out bench_out      # ~5 min; writes bench_out/tp_results.md
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--prime", type=int, default=8,
                    help="GiB of memory touched and freed before each contender (0: none)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    src, art = prepare(args.out)
    def prime():
        if args.prime:
            subprocess.run([PY, "-c", f"import numpy as np; a = np.ones({args.prime} << 30, "
                                      f"np.uint8); del a"], check=True)
    prime()
    print("one process ...", flush=True)
    single = json.loads(subprocess.run([PY, "-c", SINGLE.format(art=str(art))], check=True,
                                       capture_output=True, text=True).stdout.splitlines()[-1])
    prime()
    print("lct load --tp ...", flush=True)
    lct_tp = _torchrun(["-m", "lct", "load", str(art), "--tp", "--ids", "1,5,9",
                        "--max-new-tokens", "1", "--json"], args.world)
    prime()
    print("from_pretrained(tp_plan='auto') ...", flush=True)
    script = args.out / "bench_tp_peer.py"
    script.write_text(PEER.format(src=str(src)))
    peer = _torchrun([str(script)], args.world)
    gb = 1e9
    rows = [("one process, lct.load", f"{single['bytes_read'] / gb:.2f}",
             f"{single['bytes_decoded'] / gb:.2f}", f"{single['peak_rss_bytes'] / gb:.2f}",
             f"{single['ready_s']:.1f}", f"{single['first_token_s']:.1f}")]
    for r in lct_tp:
        rows.append((f"lct load --tp, rank {r['rank']}", f"{r['bytes_read'] / gb:.2f}",
                     f"{r['bytes_decoded'] / gb:.2f}", f"{r['peak_rss_bytes'] / gb:.2f}",
                     f"{r['process_start_to_ready_s']:.1f}",
                     f"{r['process_start_to_first_token_s']:.1f}"))
    for r in peer:
        rows.append((f"from_pretrained(tp_plan='auto'), rank {r['rank']}", "-", "-",
                     f"{r['peak_rss_bytes'] / gb:.2f}", f"{r['ready_s']:.1f}",
                     f"{r['first_token_s']:.1f}"))
    worst = max(lct_tp, key=lambda r: r["bytes_read"])
    lines = ["| contender | read GB | decoded GB | peak RSS GB | start to ready s | "
             "start to first token s |", "|---|---|---|---|---|---|"] + \
        ["| " + " | ".join(r) + " |" for r in rows]
    ratio_read = worst["bytes_read"] / single["bytes_read"]
    ratio_dec = max(r["bytes_decoded"] for r in lct_tp) / single["bytes_decoded"]
    ratio_rss = max(r["peak_rss_bytes"] for r in lct_tp) / single["peak_rss_bytes"]
    ready = max(r["process_start_to_first_token_s"] for r in lct_tp)
    peer_ready = max(r["first_token_s"] for r in peer)
    lines += ["", f"per-rank read / one process: {ratio_read:.3f} (target <= 0.55); decoded: "
                  f"{ratio_dec:.3f} (<= 0.55); peak RSS: {ratio_rss:.3f} (<= 0.6); first token "
                  f"{ready:.1f} s vs from_pretrained(tp_plan) {peer_ready:.1f} s "
                  f"(target: no later)",
              f"notes (rank 0): {'; '.join(lct_tp[0]['notes'])}",
              f"measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores, "
              f"{args.prime} GiB primed before each contender"]
    text = "\n".join(lines)
    (args.out / "tp_results.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
