"""The CPU LM head of a Gemma-2B-shaped model (256,000 x 2,048) per call, for each way LCT can
store it: dense bf16 (``FlatLinear``, what ``from_pretrained`` gives), and NF4, int8 per row, int8
per 128 values (int8_b128), Q8_0 and Q6_K, each by every path (``lct.kernels.paths``: the fused kernel, the tiled kernel, the
chunked dequantize-and-matmul, each forced) and by the path LCT picks (``auto``: measured on the
first call of each M bucket, which the untimed warm-up call pays), over input rows M = 1 .. 64;
the ``auto`` cell names the path it took. What a generated token's head costs, and a batch's.

    python benchmarks/bench_head.py [--vocab 256000 --hidden 2048 --repeats 5 --rows 1,8,64]
    python benchmarks/bench_head.py --device cuda --rows 1,4,16,64 --json heads.json

With ``--device cuda`` the heads are quantized on the CPU, moved to the GPU, and each call is
timed between ``torch.cuda.synchronize()`` calls; the paths are the CPU's, so only the module's
own forward (bitsandbytes' 4-bit matmul for NF4, dequantize-then-matmul for the others) is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

ENCODINGS = ("NF4", "int8", "int8_b128", "Q8_0", "Q6_K")


def timed(fn, repeats: int, sync=lambda: None) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after one untimed call; ``sync``
    waits for the device (a GPU's queued kernels) before and after each call."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def _to(x, device: str):
    """``x`` (a tensor, numpy array or a tuple of them) on ``device``."""
    if isinstance(x, tuple):
        return tuple(_to(t, device) for t in x)
    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(x)
    return x.to(device)


def heads(w: torch.Tensor, encodings, device: str = "cpu") -> dict:
    """Each encoding's head over ``w``, quantized by LCT's codecs on the CPU, its tensors then
    on ``device``."""
    from lct.format import int8, nf4, q6_k, q8_0
    from lct.kernels import Int8Linear, NF4Linear, Q6_KLinear, Q8_0Linear
    n, k = w.shape
    out = {}
    for enc in encodings:
        if enc == "NF4":
            packed, absmax = _to(nf4.quantize(w, 64), device)
            out[enc] = NF4Linear(packed, absmax, n, k, 64, torch.bfloat16)
        elif enc == "int8":
            out[enc] = Int8Linear(*_to(int8.quantize(w), device), torch.bfloat16)
        elif enc == "int8_b128":
            out[enc] = Int8Linear(*_to(int8.quantize(w, block=128), device), torch.bfloat16)
        elif enc == "Q8_0":
            out[enc] = Q8_0Linear(_to(q8_0.quantize(w), device), torch.bfloat16)
        else:
            out[enc] = Q6_KLinear(_to(q6_k.quantize(w), device), torch.bfloat16)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=256000)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64")
    ap.add_argument("--encodings", default=",".join(ENCODINGS),
                    help=f"a subset of {','.join(ENCODINGS)}")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", default=None, help="write the milliseconds here (the module's "
                    "own forward per encoding, as on a GPU, not the CPU's paths)")
    args = ap.parse_args()
    if args.device != "cpu" or args.json:
        return on_device(args)
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


def on_device(args) -> None:
    """The heads on a GPU: dense bf16 against each encoding's module, at each row count."""
    encodings = [e for e in args.encodings.split(",") if e]
    dev = args.device
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(torch.bfloat16)
    dense = torch.nn.Linear(args.hidden, args.vocab, bias=False, dtype=torch.bfloat16,
                            device=dev)
    with torch.no_grad():
        dense.weight.copy_(w.to(dev))
    quantized = {}
    for enc in encodings:
        try:
            quantized.update(heads(w, [enc], dev))
        except Exception as e:     # a missing bitsandbytes, an encoding with no GPU path: said
            print(f"{enc}: no head on {dev} ({type(e).__name__}: {e})")
    del w
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else dev
    print(f"head {args.vocab} x {args.hidden} on {name}, ms per call (median of {args.repeats})")
    cols = ["M", "bf16 dense ms"] + [f"{e} ms" for e in quantized] + \
        [f"{e} × dense" for e in quantized]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    res = []
    with torch.no_grad():
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(1, m, args.hidden, generator=g).to(torch.bfloat16).to(dev)
            d = timed(lambda: dense(x), args.repeats, sync)
            ms = {e: timed(lambda h=h: h(x), args.repeats, sync) for e, h in quantized.items()}
            res.append({"rows": m, "dense_ms": d, **{f"{e}_ms": v for e, v in ms.items()}})
            lines.append(f"| {m} | {d:.3f} | " + " | ".join(f"{v:.3f}" for v in ms.values())
                         + " | " + " | ".join(f"{v / d:.2f}" for v in ms.values()) + " |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "vocab": args.vocab, "hidden": args.hidden,
                       "rows": res, "table": "\n".join(lines)}, f, indent=1)


if __name__ == "__main__":
    main()
