"""Breadth: every model type transformers knows, converted and loaded by LCT.

For each model type of transformers' causal-LM mapping (and the multimodal, encoder-decoder and
speech classes below), a tiny random model is built from the config's defaults with small
sizes (``lct.demo.tiny.tiny_config``), saved with ``save_pretrained`` and reloaded with
``from_pretrained`` (the baseline: a type whose tiny model transformers cannot build or
round-trip is reported as such, not counted against LCT). Then ``lct convert`` (lossless, and
the default policy), ``lct verify`` and ``lct.load``; the loaded model must equal
``from_pretrained``'s: the state dict with its dtypes, and the logits of one forward (when the
reference's own forward runs and is deterministic).

    python benchmarks/bench_architectures.py --out bench_out            # every model type
    python benchmarks/bench_architectures.py --out bench_out llama t5   # some

Writes ``architectures.json`` and ``architectures.md`` (one row per type) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Classes to build for model types whose causal LM is not the checkpoint's own class.
EXTRA = {
    "llava": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "t5": "T5ForConditionalGeneration",
    "bart": "BartForConditionalGeneration",
    "whisper": "WhisperForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def run_one(model_type: str, class_name: str, work: Path) -> dict:
    """One model type through the baseline and LCT; the row of the report."""
    import torch

    import lct
    from lct.arch import hf
    from lct.demo.tiny import build_model, probe_inputs, tiny_config
    row = {"model_type": model_type, "class": class_name}
    cls = hf.class_by_name(class_name)
    src = work / "src"
    try:
        model = build_model(tiny_config(model_type), dtype=torch.bfloat16, model_class=cls)
        model.save_pretrained(src)
        ref = cls.from_pretrained(src, dtype=torch.bfloat16).eval()
        a, b = model.state_dict(), ref.state_dict()
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            raise RuntimeError("save_pretrained + from_pretrained changes the weights")
    except Exception as e:  # noqa: BLE001 - the baseline's failure, reported as such
        row["baseline"] = _first_line(e)
        return row
    row["baseline"] = "ok"
    t0 = time.perf_counter()
    try:
        art = work / "a.lct"
        rep = lct.convert(str(src), art, policy=lct.Policy(nf4=()))
        row["groups"] = len(rep.manifest.groups)
        row["misc"] = sum(t.group == "misc" for t in rep.manifest.tensors.values())
        row["experts"] = rep.manifest.architecture.get("experts")
        report = lct.verify(art)
        if not report.ok:
            raise RuntimeError(f"verify: {report.failures[0]}")
        got = lct.load(art)
        a, b = ref.state_dict(), got.state_dict()
        bad = [k for k in a if k not in b or a[k].dtype != b[k].dtype or
               not torch.equal(a[k], b[k])] + [k for k in b if k not in a]
        if bad:
            raise RuntimeError(f"state dict differs at {bad[0]!r} ({len(bad)} entries)")
        row["state_dict"] = "equal"
        inputs = probe_inputs(ref)
        with torch.no_grad():
            try:
                want, again = ref(**inputs).logits, ref(**inputs).logits
            except Exception as e:  # noqa: BLE001 - the reference itself cannot run
                row["logits"] = f"reference forward fails ({_first_line(e)[:80]})"
            else:
                if not torch.equal(want, again):
                    row["logits"] = "reference not deterministic"
                else:
                    row["logits"] = "equal" if torch.equal(got(**inputs).logits, want) \
                        else "DIFFER"
        default = lct.convert(str(src), work / "d.lct")
        lct.load(work / "d.lct")
        row["default"] = ",".join(sorted({t.encoding for t in default.manifest.tensors.values()}))
        row["lct"] = "ok" if row["logits"] != "DIFFER" else "logits differ"
    except Exception as e:  # noqa: BLE001 - LCT's failure: the finding
        row["lct"] = _first_line(e)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("types", nargs="*", help="model types (default: all)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    import transformers
    import transformers.models.auto.modeling_auto as auto
    transformers.logging.set_verbosity_error()
    todo = {mt: auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]
            for mt in sorted(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)}
    todo.update(EXTRA)
    if args.types:
        todo = {mt: todo[mt] for mt in args.types}
    rows = []
    for mt, cls in todo.items():
        work = Path(tempfile.mkdtemp(prefix=f"lct-arch-{mt}-"))
        try:
            row = run_one(mt, cls, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows.append(row)
        print(f"{mt:28s} baseline {row['baseline'][:40]:40s} lct {row.get('lct', '-')}",
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "architectures.json").write_text(json.dumps(rows, indent=1))
    built = [r for r in rows if r["baseline"] == "ok"]
    ok = [r for r in built if r.get("lct") == "ok"]
    lines = [f"transformers {transformers.__version__}: {len(rows)} model types, "
             f"{len(built)} built and round-tripped by transformers, {len(ok)} of those "
             f"exact through LCT", "",
             "| model type | class | LCT | logits | groups | misc | default encodings |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["baseline"] != "ok":
            lines.append(f"| {r['model_type']} | {r['class']} | (not built: "
                         f"{r['baseline'][:70]}) | | | | |")
            continue
        lines.append(f"| {r['model_type']} | {r['class']} | {r.get('lct')} | "
                     f"{r.get('logits', '')} | {r.get('groups', '')} | {r.get('misc', '')} | "
                     f"{r.get('default', '')} |")
    (args.out / "architectures.md").write_text("\n".join(lines) + "\n")
    print(lines[0])
    return 0 if len(ok) == len(built) else 1


if __name__ == "__main__":
    sys.exit(main())
