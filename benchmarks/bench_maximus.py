"""Maximus benchmark: a Zipf(1.1) token stream over a 256,000-token vocabulary, hidden 2048.

Reports resident bytes vs the full table, the hit rate of resident shards, lookup+backward
throughput against ``nn.Embedding`` (dense and sparse gradients) and bitsandbytes
``EmbeddingNF4`` (lookup only: it has no gradient), and the memory Maximus saves for Gemma-2B's
vocabulary in training (weights + gradients + AdamW states).

    python benchmarks/bench_maximus.py [--steps 40] [--batch 4096] [--vocab 256000] [--dim 2048]
"""

from __future__ import annotations

import argparse
import time

import torch

from lct.kernels.maximus import MaximusEmbedding, MaximusPolicy


def zipf_ranks(vocab: int, n: int, s: float, seed: int) -> torch.Tensor:
    """``n`` frequency ranks (0 = most frequent) drawn from Zipf(s) over ``vocab`` ranks."""
    p = torch.arange(1, vocab + 1, dtype=torch.float64) ** -s
    return torch.multinomial(p / p.sum(), n, replacement=True,
                             generator=torch.Generator().manual_seed(seed))


def timed(fn, steps: int, batches) -> float:
    fn(batches[0])  # warm-up
    t0 = time.perf_counter()
    for b in batches[1:steps + 1]:
        fn(b)
    return steps * batches[0].numel() / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=256_000)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--resident", type=float, default=0.25, help="fraction of shards resident")
    ap.add_argument("--batch", type=int, default=4096, help="tokens per step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--zipf", type=float, default=1.1)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    V, H = args.vocab, args.dim
    # A fixed random id for each frequency rank (hot ids are not simply the low ids); the
    # frequencies come from a separate sample, as a converter would count a corpus.
    rank_to_id = torch.randperm(V, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(rank_to_id[zipf_ranks(V, 2_000_000, args.zipf, 2)], minlength=V)
    batches = [rank_to_id[zipf_ranks(V, args.batch, args.zipf, 100 + i)]
               for i in range(args.steps + 1)]

    weight = torch.randn(V, H, generator=gen) * 0.02
    budget = max(1, int(round(args.shards * args.resident)))
    rows = []

    ref = torch.nn.Embedding(V, H, _weight=weight.clone())
    def step_dense(ids):
        ref.weight.grad = None
        ref(ids).sum().backward()
    rows.append(("nn.Embedding (dense grad)", timed(step_dense, args.steps, batches), None))

    ref_sparse = torch.nn.Embedding(V, H, _weight=weight.clone(), sparse=True)
    def step_sparse(ids):
        ref_sparse.weight.grad = None
        ref_sparse(ids).sum().backward()
    rows.append(("nn.Embedding (sparse grad)", timed(step_sparse, args.steps, batches), None))

    mx = MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=args.shards, budget_shards=budget,
                                                     sparse=True),
                          counts=counts, weight=weight)
    def step_mx(ids):
        mx.weight.grad = None
        mx(ids).sum().backward()
    for b in batches[:5]:  # let residency settle from the stored frequencies
        with torch.no_grad():
            mx(b)
    mx_stats_start = (mx.stats.hits, mx.stats.misses)
    rows.append(("MaximusEmbedding (sparse grad)", timed(step_mx, args.steps, batches), mx))
    hits = mx.stats.hits - mx_stats_start[0]
    misses = mx.stats.misses - mx_stats_start[1]

    try:
        import bitsandbytes as bnb
        e4 = bnb.nn.EmbeddingNF4(V, H, dtype=torch.float32)
        e4.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4",
                                      blocksize=64)
        e4 = e4.to("cpu")  # .to() quantizes
        def step_nf4(ids):
            with torch.no_grad():
                e4(ids)
        rows.append(("bitsandbytes EmbeddingNF4 (lookup only, no grad)",
                     timed(step_nf4, args.steps, batches), None))
    except Exception as e:  # noqa: BLE001 - report and go on: it is a peer, not ours
        rows.append((f"bitsandbytes EmbeddingNF4: unavailable ({type(e).__name__}: {e})", None,
                     None))

    base = rows[0][1]
    print(f"Zipf({args.zipf}) stream, vocabulary {V:,}, hidden {H}, {args.shards} shards, "
          f"{budget} resident ({budget / args.shards:.0%}), {args.batch} tokens/step, "
          f"{args.steps} steps, fp32 table.\n")
    print("| embedding | lookups+backward / s | × nn.Embedding (dense) |")
    print("|---|---|---|")
    for name, rate, _ in rows:
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f} |" if rate else f"| {name} | – | – |")
    full = V * H * 4
    print(f"\nHit rate of resident shards: {hits / max(hits + misses, 1):.2%} "
          f"({hits:,} hits, {misses:,} misses); resident {mx.resident_bytes / 1e6:,.0f} MB of a "
          f"{full / 1e6:,.0f} MB table ({mx.resident_bytes / full:.0%}); shard loads "
          f"{mx.stats.shard_loads}, evictions {mx.stats.shard_evictions}.")
    # Gemma-2B vocabulary in mixed-precision AdamW training: bf16 weights and grads, fp32 master
    # weights and two fp32 moments = 16 bytes a parameter, all of it on the accelerator without
    # Maximus; with it only the resident shards are (the rest in host memory).
    gv, gh = 256_000, 2048
    per_param = 2 + 2 + 4 + 4 + 4
    full_b = gv * gh * per_param
    resident_b = full_b * budget / args.shards
    print(f"\nGemma-2B vocabulary ({gv:,} x {gh}) in mixed-precision AdamW training "
          f"(bf16 weight + bf16 grad + fp32 master + 2 fp32 moments = {per_param} B/param): "
          f"{full_b / 2**30:.2f} GiB on the accelerator without Maximus, "
          f"{resident_b / 2**30:.2f} GiB with {budget}/{args.shards} shards resident "
          f"(saves {(full_b - resident_b) / 2**30:.2f} GiB of accelerator memory; the cold rows "
          f"live in host memory).")


if __name__ == "__main__":
    main()
