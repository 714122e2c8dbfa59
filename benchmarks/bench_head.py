"""The CPU LM head of a Gemma-2B-shaped model (256,000 x 2,048) per call, for each way LCT can
store it: dense bf16 (``FlatLinear``, what ``from_pretrained`` gives), NF4 (fused kernel and the
chunked dequantize-and-matmul path), int8 per row and Q8_0 (each fused and chunked), over input
rows M = 1 .. 64: where each fused kernel stops paying (``NF4_FUSED_MAX_ROWS``,
``INT8_FUSED_MAX_ROWS``, ``Q8_0_FUSED_MAX_ROWS``), and what a generated token's head costs.

    python benchmarks/bench_head.py [--vocab 256000 --hidden 2048 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=256000)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64")
    args = ap.parse_args()
    from lct.format import int8, nf4, q8_0
    from lct.kernels import FlatLinear, Int8Linear, NF4Linear, Q8_0Linear
    from lct.kernels import int8 as kint8
    from lct.kernels import q8_0 as kq8
    from lct.kernels import linear as klin
    from lct.kernels import native
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(torch.bfloat16)
    dense = FlatLinear(args.hidden, args.vocab, bias=False, dtype=torch.bfloat16)
    dense.weight.data = w
    dense.weight.requires_grad_(True)
    packed, absmax = nf4.quantize(w, 64)
    h4 = NF4Linear(packed, absmax, args.vocab, args.hidden, 64, torch.bfloat16)
    q, scale = int8.quantize(w)
    h8 = Int8Linear(q, scale, torch.bfloat16)
    hq = Q8_0Linear(q8_0.quantize(w), torch.bfloat16)
    del w
    print(f"head {args.vocab} x {args.hidden}, {torch.get_num_threads()} threads, native "
          f"{native.available()}, ISA {native.matmul_isa() if native.available() else '-'}")
    print("| M | bf16 dense ms | NF4 fused ms | NF4 chunked ms | int8 fused ms | int8 chunked ms "
          "| Q8_0 fused ms | Q8_0 chunked ms |")
    print("|---|---|---|---|---|---|---|---|")
    real = [(m, m.use_fused) for m in (klin, kint8, kq8)]
    with torch.no_grad():
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(1, m, args.hidden, generator=g).to(torch.bfloat16)
            row = [timed(lambda: dense(x), args.repeats)]
            for mod, fused_attr in ((h4, klin), (h8, kint8), (hq, kq8)):
                for on in (True, False):
                    setattr(fused_attr, "use_fused", (lambda r: True) if on else (lambda r: False))
                    row.append(timed(lambda: mod(x), args.repeats) if (on is False or native.available())
                               else float("nan"))
            for module, fn in real:
                module.use_fused = fn
            print(f"| {m} | " + " | ".join(f"{v:.1f}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
