"""`lct plan` against measured peak memory: an inference forward and two training steps of small
random models, each case in a fresh subprocess, on CPU (and on CUDA when one is available).

CPU: peak resident memory (VmHWM, reset through /proc/self/clear_refs once the model is built)
minus the resident memory before the weights existed; glibc is told to serve every allocation
over 64 KiB with mmap so that freed tensors leave the resident set at once. CUDA:
``torch.cuda.max_memory_allocated`` minus what was allocated before the weights. Libraries are
warmed up on a one-layer copy of each model first (thread pools, kernels), so their one-time
allocations are in the baseline.

Run (about 4 minutes on 2 cores):
    python benchmarks/bench_plan.py                 # prints the table, writes bench_out/plan.md
    python benchmarks/bench_plan.py --cases llama-train-bf16 --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Small real-shaped models (tens of millions of parameters: weights dominate the interpreter's
# own memory, and a step takes seconds on two cores).
LLAMA = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
             tie_word_embeddings=False)
GEMMA = dict(vocab_size=32768, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=1, head_dim=128,
             max_position_embeddings=2048, tie_word_embeddings=True)
QWEN2 = dict(vocab_size=48000, hidden_size=448, intermediate_size=1216, num_hidden_layers=6,
             num_attention_heads=7, num_key_value_heads=1, max_position_embeddings=2048,
             tie_word_embeddings=True)
GPT2 = dict(vocab_size=32000, n_embd=512, n_layer=6, n_head=8, n_positions=1024,
            tie_word_embeddings=True)

CASES = [
    dict(name="llama-infer-bf16", arch="llama", cfg=LLAMA, mode="infer", precision="bf16",
         batch=1, seq=1024),
    dict(name="llama-infer-lct", arch="llama", cfg=LLAMA, mode="infer", precision="bf16",
         batch=1, seq=512, format="lct"),
    dict(name="gemma-infer-fp32", arch="gemma", cfg=GEMMA, mode="infer", precision="fp32",
         batch=2, seq=512),
    dict(name="llama-train-bf16", arch="llama", cfg=LLAMA, mode="train", precision="bf16",
         optimizer="adamw", batch=1, seq=64),
    dict(name="llama-train-fp32", arch="llama", cfg=LLAMA, mode="train", precision="fp32",
         optimizer="adamw", batch=2, seq=256),
    dict(name="gemma-train-fp32-sgd", arch="gemma", cfg=GEMMA, mode="train", precision="fp32",
         optimizer="sgd", batch=2, seq=256),
    dict(name="qwen2-train-mixed", arch="qwen2", cfg=QWEN2, mode="train", precision="mixed",
         optimizer="adamw", batch=1, seq=64),
    dict(name="qwen2-train-fp32-adafactor", arch="qwen2", cfg=QWEN2, mode="train",
         precision="fp32", optimizer="adafactor", batch=2, seq=256),
    dict(name="llama-train-fp32-8bit", arch="llama", cfg=LLAMA, mode="train", precision="fp32",
         optimizer="adamw-8bit", batch=2, seq=256),
    dict(name="gpt2-train-fp32", arch="gpt2", cfg=GPT2, mode="train", precision="fp32",
         optimizer="adamw", batch=2, seq=256),
]


# ----------------------------------------------------------------------------------------------
# The worker: one case, in its own process


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _build(cfg, dtype, seed=0):
    from lct.demo.tiny import build_model
    return build_model(cfg, seed=seed, dtype=dtype)


def _optimizer(name, params):
    import torch
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-4)
    if name == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=1e-4, relative_step=False, scale_parameter=False)
    if name == "adamw-8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=1e-4)
    raise ValueError(name)


def _run(case: dict, model, device: str, ids) -> None:
    import torch
    if case["mode"] == "infer":
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)      # logits and KV cache live until the forward returns
        return
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    mixed = case["precision"] == "mixed"
    masters = [p.detach().float() for p in params] if mixed else None
    opt = _optimizer(case["optimizer"], masters if mixed else params)
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        del loss
        if mixed:
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
                p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mixed:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)


def worker(case: dict, device: str) -> dict:
    import torch
    from transformers import AutoConfig

    import lct
    from lct.plan.memory import PRECISION_DTYPE, plan
    torch.manual_seed(0)
    dtype = getattr(torch, PRECISION_DTYPE[case["precision"]])
    if case["precision"] == "mixed":
        dtype = torch.bfloat16
    cfg = AutoConfig.for_model(case["arch"], **case["cfg"])
    small = AutoConfig.for_model(case["arch"], **dict(
        case["cfg"], **({"n_layer": 1} if case["arch"] == "gpt2" else {"num_hidden_layers": 1})))
    ids = torch.randint(1, cfg.vocab_size, (case["batch"], case["seq"]), device=device)

    # Warm up thread pools and kernels on a one-layer copy, then forget it.
    warm = _build(small, dtype).to(device)
    _run(case, warm, device, ids[:, :16])
    del warm

    artifact = None
    if case.get("format") == "lct":
        tmp = Path(tempfile.mkdtemp(prefix="bench-plan-"))
        _build(cfg, dtype).save_pretrained(tmp / "src")
        artifact = tmp / "model.lct"
        lct.convert(str(tmp / "src"), artifact)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    else:
        base = _status("VmRSS")
    t0 = time.perf_counter()
    model = lct.load(str(artifact), device=device) if artifact else _build(cfg, dtype).to(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak()
    _run(case, model, device, ids)
    if cuda:
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    else:
        measured = _status("VmHWM") - base
    seconds = time.perf_counter() - t0
    p = plan(str(artifact) if artifact else cfg.to_dict(), mode=case["mode"],
             batch=case["batch"], seq=case["seq"], precision=case["precision"],
             optimizer=case.get("optimizer", "adamw"), format=case.get("format", "hf"),
             device=device)
    return {"name": case["name"], "device": device, "measured": measured, "planned": p.total,
            "error": (p.total - measured) / measured, "peak_phase": p.peak_phase,
            "phases": p.phases, "params": p.params, "seconds": round(seconds, 1),
            "torch": torch.__version__}


# ----------------------------------------------------------------------------------------------
# The driver


def run_case(case: dict, device: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(case), "--device",
                           device], capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{case['name']} on {device} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def table(results: list) -> str:
    head = ("| case | device | params | planned MiB | measured MiB | error | planned peak at |\n"
            "|---|---|---:|---:|---:|---:|---|")
    rows = [f"| {r['name']} | {r['device']} | {r['params'] / 1e6:.1f} M | {mib(r['planned'])} | "
            f"{mib(r['measured'])} | {r['error']:+.1%} | {r['peak_phase']} |" for r in results]
    return "\n".join([head, *rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                    help="cpu, cuda, or all (cuda only when available)")
    ap.add_argument("--cases", nargs="*", help="case names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "plan.md"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker), args.device)))
        return
    import torch
    devices = ["cpu"] if args.device == "cpu" else ["cuda"] if args.device == "cuda" else \
        ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    cases = [c for c in CASES if not args.cases or c["name"] in args.cases]
    results = []
    for device in devices:
        for case in cases:
            r = run_case(case, device)
            results.append(r)
            print(f"{r['name']:28s} {device:4s} planned {mib(r['planned']):>9s} MiB  measured "
                  f"{mib(r['measured']):>9s} MiB  error {r['error']:+6.1%}  ({r['peak_phase']}, "
                  f"{r['seconds']} s)", flush=True)
    worst = max(abs(r["error"]) for r in results)
    text = (f"{table(results)}\n\nworst |error| {worst:.1%} over {len(results)} cases "
            f"(torch {results[0]['torch']})\n")
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
