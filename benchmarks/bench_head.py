"""The CPU LM head of a Gemma-2B-shaped model (256,000 x 2,048) per call, for each way LCT can
store it: dense bf16 (``FlatLinear``, what ``from_pretrained`` gives), and NF4, int8 per row, int8
per 128 values (int8_b128), Q8_0 and Q6_K, each by every path (``lct.kernels.paths``: the fused kernel, the tiled kernel, the
chunked dequantize-and-matmul, each forced) and by the path LCT picks (``auto``: measured on the
first call of each M bucket, which the untimed warm-up call pays), over input rows M = 1 .. 64;
the ``auto`` cell names the path it took. What a generated token's head costs, and a batch's.

    python benchmarks/bench_head.py [--vocab 256000 --hidden 2048 --repeats 5 --rows 1,8,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ENCODINGS = ("NF4", "int8", "int8_b128", "Q8_0", "Q6_K")


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def heads(w: torch.Tensor, encodings) -> dict:
    """Each encoding's head over ``w``, quantized by LCT's codecs."""
    from lct.format import int8, nf4, q6_k, q8_0
    from lct.kernels import Int8Linear, NF4Linear, Q6_KLinear, Q8_0Linear
    n, k = w.shape
    out = {}
    for enc in encodings:
        if enc == "NF4":
            packed, absmax = nf4.quantize(w, 64)
            out[enc] = NF4Linear(packed, absmax, n, k, 64, torch.bfloat16)
        elif enc == "int8":
            out[enc] = Int8Linear(*int8.quantize(w), torch.bfloat16)
        elif enc == "int8_b128":
            out[enc] = Int8Linear(*int8.quantize(w, block=128), torch.bfloat16)
        elif enc == "Q8_0":
            out[enc] = Q8_0Linear(q8_0.quantize(w), torch.bfloat16)
        else:
            out[enc] = Q6_KLinear(q6_k.quantize(w), torch.bfloat16)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=256000)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64")
    ap.add_argument("--encodings", default=",".join(ENCODINGS),
                    help=f"a subset of {','.join(ENCODINGS)}")
    args = ap.parse_args()
    from lct.kernels import FlatLinear, native, paths
    encodings = [e for e in args.encodings.split(",") if e]
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(torch.bfloat16)
    dense = FlatLinear(args.hidden, args.vocab, bias=False, dtype=torch.bfloat16)
    dense.weight.data = w
    dense.weight.requires_grad_(True)
    quantized = heads(w, encodings)
    del w
    runnable = paths.PATHS if native.available() else ("chunked",)
    print(f"head {args.vocab} x {args.hidden}, {torch.get_num_threads()} threads, native "
          f"{native.available()}, ISA {native.matmul_isa() if native.available() else '-'}")
    cols = ["M", "bf16 dense ms"] + [f"{e} {p} ms" for e in encodings for p in (*paths.PATHS,
                                                                                  "auto")]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    with torch.no_grad():
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(1, m, args.hidden, generator=g).to(torch.bfloat16)
            row = [f"{timed(lambda: dense(x), args.repeats):.1f}"]
            for enc in encodings:
                head = quantized[enc]
                for path in paths.PATHS:
                    paths.force(path)
                    row.append(f"{timed(lambda: head(x), args.repeats):.1f}"
                               if path in runnable else "-")
                paths.force(None)
                ms = timed(lambda: head(x), args.repeats)
                picked = [p for key, p in paths.chosen().items()
                          if key[0] == head.encoding and key[-1] == paths.bucket(m)]
                row.append(f"{ms:.1f} {picked[0] if picked else 'chunked'}")
            print(f"| {m} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
