"""`lct demo`: the whole job on an embedded tiny model, offline.

Builds a small random Gemma (bf16) with a small trained tokenizer, converts it, verifies it
against the source, exports it back to a Hugging Face folder, reloads that with transformers and
compares logits with the source, then loads the artifact with the streaming loader (lossy parts kept) and
generates from a prompt. The weights are random, so the text is gibberish; the point is the path.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

OUTPUTS = ("source", "model.lct", "export")   # what the demo writes in its folder
MARKER = ".lct-demo"                          # says a folder's outputs are an earlier demo's
DEMO_CONFIG = dict(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=64)


@dataclass
class DemoResult:
    """Paths, sizes and timings of one demo run."""

    workdir: Path | None             # None: a temporary folder, removed when the demo ended
    source_bytes: int = 0
    artifact_bytes: int = 0
    ratio: float = 0.0               # lct.io.info.size_ratio, what convert and info print
    timings: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)   # info.GroupRow
    verify_ok: bool = False
    lossless_identical: str = ""
    nf4_cosine: float = 0.0          # lowest cosine of a lossy tensor with the source
    lossy: str = "none"              # what the policy stored the embedding/head as
    policy_line: str = ""            # the auto policy's choice and measured cost
    logits_cosine: float = 0.0
    prompt: str = ""
    output: str = ""
    load_agrees: bool = False        # same next token as the exported model at every position
    load_max_diff: float = 0.0       # largest |logit difference| (a kept head sums in float32)
    quality: object = None           # lct.conversion.quality.QualityReport of the artifact against the source


def _dir_bytes(path: Path, suffix: str) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(suffix))


def run_demo(workdir=None, log=print) -> DemoResult:
    """Run the demo in ``workdir``, which keeps its files (default: a new temporary folder,
    removed before this returns, and ``workdir`` None in the result); return what it measured."""
    if workdir is not None:
        _claim(Path(workdir))
        before = _digest(Path(workdir) / "model.lct")
        res = _run(Path(workdir), log)
        if before != _digest(Path(workdir) / "model.lct"):
            _forget(before)         # the earlier demo's artifact was replaced
        return res
    with tempfile.TemporaryDirectory(prefix="lct-demo-", ignore_cleanup_errors=True) as tmp:
        try:
            res = _run(Path(tmp), log)
        finally:
            _forget(_digest(Path(tmp) / "model.lct"))
    res.workdir = None
    return res


def _digest(art: Path) -> str | None:
    """The manifest digest of the artifact ``art``, or None where there is none (yet)."""
    from lct.errors import LCTError
    from lct.io.reader import open_artifact
    try:
        with open_artifact(art, verify=False) as a:
            return a.digest
    except LCTError:
        return None


def _forget(digest: str | None) -> None:
    """Remove the decoded cache's entry of a demo artifact that is gone (its temporary folder
    removed, or replaced by the next demo): nothing would map it again, and each demo would
    leave one more (the demo's load keeps one, as every load does by default)."""
    from lct.io import cache
    if digest is None:
        return
    cache.wait_fills()
    if any(e.digest == digest for e in cache.entries()):
        cache.prune(digest=digest)


def _claim(work: Path) -> None:
    """Make ``work`` the demo's folder: a new or empty one, or one an earlier demo wrote (its
    ``MARKER``); a folder holding someone else's ``source``, ``model.lct`` or ``export`` is
    refused before anything is written, and so is a file."""
    from lct.errors import LCTError
    if work.exists() and not work.is_dir():
        raise LCTError(f"{work} is a file, not a folder; give a new or empty folder to --workdir")
    if not (work / MARKER).is_file():
        taken = [name for name in OUTPUTS if (work / name).exists() or (work / name).is_symlink()]
        if taken:
            raise LCTError(f"{work / taken[0]} exists and lct demo did not write it; give a new "
                           f"or empty folder to --workdir (the demo writes "
                           f"{', '.join(OUTPUTS)} there)")
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("lct demo's outputs: source, model.lct and export are replaced "
                               "by the next demo run in this folder\n")


def _run(work: Path, log) -> DemoResult:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # the demo prints its own report; no library bars in it

    from lct.conversion.converter import convert
    from lct.conversion.exporter import export
    from lct.conversion.verifier import verify
    from lct.demo import tiny
    from lct.format.encodings import get_encoding, is_lossy
    from lct.io.info import size_ratio, summarize

    work.mkdir(parents=True, exist_ok=True)
    res = DemoResult(work)

    t = time.perf_counter()
    config = tiny.config_for("gemma", **DEMO_CONFIG)
    model = tiny.build_model(config, seed=0, dtype=torch.bfloat16)
    src = work / "source"
    model.save_pretrained(src, safe_serialization=True)
    tiny.save_tokenizer(src, vocab_size=512)
    res.timings["build tiny Gemma"] = time.perf_counter() - t
    res.source_bytes = _dir_bytes(src, ".safetensors")
    log(f"built a random Gemma ({sum(p.numel() for p in model.parameters()):,} parameters) in {src}")

    t = time.perf_counter()
    rep = convert(str(src), work / "model.lct", overwrite=True)
    res.timings["convert"] = time.perf_counter() - t
    encs = sorted({t.encoding for t in rep.manifest.tensors.values() if is_lossy(t.encoding)})
    res.lossy = ",".join(get_encoding(e).label for e in encs) or "none"
    res.policy_line = rep.decision.summary() if rep.decision is not None else ""
    res.artifact_bytes = _dir_bytes(work / "model.lct", ".lct")
    res.groups = summarize(rep.manifest)
    res.ratio = size_ratio(rep.manifest)

    t = time.perf_counter()
    ver = verify(work / "model.lct", against=str(src))
    res.timings["verify --against"] = time.perf_counter() - t
    res.verify_ok = ver.ok
    plain = [c for c in ver.tensors if not is_lossy(c.encoding)]
    res.lossless_identical = f"{sum(c.ok for c in plain)}/{len(plain)}"
    nf4 = [c for c in ver.tensors if is_lossy(c.encoding)]
    res.nf4_cosine = min((c.cosine for c in nf4), default=1.0)

    t = time.perf_counter()
    export(work / "model.lct", work / "export", overwrite=True)
    res.timings["export"] = time.perf_counter() - t

    from transformers import AutoModelForCausalLM
    t = time.perf_counter()
    back = AutoModelForCausalLM.from_pretrained(work / "export", dtype=torch.bfloat16).eval()
    res.timings["from_pretrained(export)"] = time.perf_counter() - t
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    ids = torch.randint(1, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits.float().reshape(-1), back(ids).logits.float().reshape(-1)
    res.logits_cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()

    from lct.loader import load
    from lct.loader.generate import generate_timed
    t = time.perf_counter()
    loaded = load(work / "model.lct", prefetch=2)
    res.timings["lct.load(prefetch=2)"] = time.perf_counter() - t
    with torch.no_grad():
        la, lb = loaded(ids).logits.float(), back(ids).logits.float()
    res.load_agrees = torch.equal(la.argmax(-1), lb.argmax(-1))
    res.load_max_diff = (la - lb).abs().max().item()
    res.prompt = "Hello world, the quick brown fox"
    gen = generate_timed(loaded, work / "model.lct", prompt=res.prompt, max_new_tokens=12)
    res.timings["first token"] = gen.first_token_s
    res.output = gen.text

    from transformers import AutoTokenizer

    from lct.conversion import sample_text
    from lct.conversion.quality import compare
    t = time.perf_counter()  # the models already loaded above: the artifact's and the source's
    res.quality = compare(loaded, ref, AutoTokenizer.from_pretrained(work / "model.lct"),
                          sample_text.samples(), max_tokens=512, block=256)
    res.timings["verify --quality (512 tokens)"] = time.perf_counter() - t
    return res
