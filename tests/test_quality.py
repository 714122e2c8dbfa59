"""`lct verify --quality`: perplexity, agreement and KL equal an independent computation, and a
lossless artifact costs exactly nothing."""

import json
import math

import pytest
import torch
from torch.nn import functional as F

import lct
from lct.conversion.converter import Policy
from lct.conversion.policy import DEFAULT_BUDGET_KL
from lct.conversion.quality import measure_quality, token_blocks


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from lct.demo import tiny
    out = tiny.save_tiny(tmp_path_factory.mktemp("q") / "src", "llama")
    tiny.save_tokenizer(out, vocab_size=256)
    return out


@pytest.fixture(scope="module")
def arts(src, tmp_path_factory):
    d = tmp_path_factory.mktemp("qa")
    lct.convert(str(src), d / "default.lct")
    lct.convert(str(src), d / "lossless.lct", policy=Policy(nf4=()))
    return d / "default.lct", d / "lossless.lct"


def test_quality_equals_an_independent_computation(src, arts):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    art = arts[0]
    q = measure_quality(art, str(src), max_tokens=300, block=64)
    tok = AutoTokenizer.from_pretrained(art)
    from lct.conversion import sample_text
    ids = tok(sample_text.PROSE).input_ids  # the prose comes first and is long enough
    blocks, scored = [], 0  # non-overlapping 64-token blocks until 300 positions are scored
    for i in range(0, len(ids), 64):
        b = ids[i:i + 64][: 300 - scored + 1]
        blocks.append(b)
        scored += len(b) - 1
        if scored == 300:
            break
    assert token_blocks(tok, sample_text.samples(), 300, 64) == blocks
    # both in float32 by default, where they fit in memory so
    model = lct.load(art, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    nll = nll_ref = 0.0
    agree = n = 0
    kls = []
    with torch.no_grad():
        for b in blocks:
            x = torch.tensor([b])
            a, r = model(x).logits[0, :-1].float(), ref(x).logits[0, :-1].float()
            nll += F.cross_entropy(a, x[0, 1:], reduction="sum").item()
            nll_ref += F.cross_entropy(r, x[0, 1:], reduction="sum").item()
            agree += int((a.argmax(-1) == r.argmax(-1)).sum())
            kls.append(F.kl_div(F.log_softmax(a, -1), F.log_softmax(r, -1), log_target=True,
                                reduction="none").sum(-1))
            n += len(b) - 1
    kl = torch.cat(kls)
    assert q.tokens == n == 300 and q.dtype == "float32"
    assert q.ppl == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert q.ppl_reference == pytest.approx(math.exp(nll_ref / n), rel=1e-5)
    assert q.top1_agreement == agree / n
    assert q.kl_mean == pytest.approx(kl.mean().item(), rel=1e-4, abs=1e-7)
    assert q.kl_max == pytest.approx(kl.max().item(), rel=1e-4, abs=1e-7)
    assert q.delta_pct != 0.0  # the default artifact's NF4 embedding/head changes something


def test_quality_computes_in_the_artifacts_dtype_where_float32_does_not_fit(src, arts, run,
                                                                           monkeypatch):
    """float32 by default, which the report and the verdict name; the artifact's dtype where two
    float32 models would not fit in memory, or where --dtype says so."""
    import lct.proc
    res = run("verify", arts[0], "--against", src, "--quality", "--max-tokens", "64")
    assert res.exit_code in (0, 1) and "tokens in float32: " in res.output, res.output
    f32 = measure_quality(arts[0], str(src), max_tokens=64, block=64)
    bf16 = measure_quality(arts[0], str(src), max_tokens=64, block=64, dtype=torch.bfloat16)
    assert (f32.dtype, bf16.dtype) == ("float32", "bfloat16") and f32.kl_mean != bf16.kl_mean
    monkeypatch.setattr(lct.proc, "available_memory", lambda: 1000)
    short = measure_quality(arts[0], str(src), max_tokens=64, block=64)
    assert short.dtype == "bfloat16" and short.kl_mean == bf16.kl_mean
    assert measure_quality(arts[0], str(src), max_tokens=64, block=64,
                           layerwise=True).dtype == "float32"   # a layer at a time


def test_lossless_artifact_costs_exactly_nothing(src, arts, run):
    res = run("verify", arts[1], "--against", src, "--quality", "--max-tokens", "200", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)    # the whole stdout is the JSON report
    assert report["ok"] and report["lossless_identical"] == report["lossless_tensors"]
    q = report["quality"]
    assert q["delta_pct"] == 0.0 and q["kl_mean"] == 0.0 and q["kl_max"] == 0.0
    assert q["top1_agreement"] == 1.0 and q["tokens"] == 200


def test_quality_says_within_or_over_the_budget_and_exits_1_over_it(src, arts, run, tmp_path):
    """The budget is the conversion's (policy.measured.budget_kl) unless --budget says; over it,
    the table, -q and --json all say so and verify exits 1."""
    nf4 = tmp_path / "nf4.lct"
    lct.convert(str(src), nf4, policy=Policy(nf4=("embed", "head"), budget=0.5))
    args = ("verify", nf4, "--against", src, "--quality", "--max-tokens", "100")
    res = run(*args, "--json")
    q = json.loads(res.stdout)["quality"]
    assert q["budget_kl"] == 0.5 and 0 < q["kl_mean"] and res.exit_code == (
        0 if q["kl_mean"] <= 0.5 else 1), res.output
    tight = q["kl_mean"] / 2                        # certainly over
    res = run(*args, "--budget", str(tight))
    assert res.exit_code == 1 and f"OVER the budget {tight:g}" in res.output, res.output
    assert "quality OVER the budget" in res.output
    res = run(*args, "--budget", str(tight), "-q")
    assert res.exit_code == 1 and res.stdout.strip() == "OVER", res.output
    res = run(*args, "--budget", str(q["kl_mean"] * 2), "-q")
    assert res.exit_code == 0 and res.stdout.strip() == "OK", res.output
    res = run(*args, "--budget", str(tight), "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["quality"]["within_budget"] is False
    rep = lct.verify(arts[1], against=str(src), quality=True, max_tokens=50)
    assert rep.quality.budget_kl == DEFAULT_BUDGET_KL and rep.quality.within_budget
    res = run("verify", arts[1], "--against", src, "--quality", "--budget", "0")
    assert res.exit_code != 0 and "--budget" in res.output


def test_quality_text_folder_and_errors(src, arts, run, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("Hello world, the quick brown fox. " * 20)
    res = run("verify", arts[0], "--against", src, "--quality", "--text", tmp_path / "t")
    assert res.exit_code == 0 and "perplexity change" in res.output
    res = run("verify", arts[0], "--quality")
    assert res.exit_code != 0 and "--quality needs --against" in res.output
    (tmp_path / "empty").mkdir()
    res = run("verify", arts[0], "--against", src, "--quality", "--text", tmp_path / "empty")
    assert res.exit_code == 1 and "no text to score" in res.output
    with pytest.raises(lct.errors.LCTError, match="lossless reference"):
        lct.verify(arts[0], quality=True)


@pytest.mark.parametrize("which", [0, 1])
def test_layerwise_quality_equals_the_loaded_one(src, arts, which):
    """Streaming both models layer by layer gives the numbers of loading them whole (the
    reference is the source run a layer at a time from its safetensors files)."""
    whole = measure_quality(arts[which], str(src), max_tokens=200, block=64)
    streamed = measure_quality(arts[which], str(src), max_tokens=200, block=64, layerwise=True)
    assert streamed.tokens == whole.tokens == 200
    for key in ("ppl", "ppl_reference", "top1_agreement", "kl_mean", "kl_max"):
        assert getattr(streamed, key) == pytest.approx(getattr(whole, key), rel=1e-4,
                                                       abs=1e-6), key


@pytest.mark.parametrize("args,flag", [
    (["--layerwise"], "--layerwise goes with --quality"),
    (["--dtype", "bfloat16"], "--dtype goes with --quality"),
    (["--budget", "0.1"], "--budget goes with --quality"),
    (["--max-tokens", "5"], "--max-tokens goes with --quality"),
    (["--text", "TEXT"], "--text goes with --quality"),
    (["--revision", "main"], "--revision is the revision of --against SOURCE"),
])
def test_quality_options_without_quality_are_refused(src, arts, run, tmp_path, args, flag):
    """Found by a new user: --text, --budget, --max-tokens without --quality printed OK as if
    they had been used; --revision without --against was dropped."""
    (tmp_path / "t.txt").write_text("some text")
    args = [str(tmp_path / "t.txt") if a == "TEXT" else a for a in args]
    res = run("verify", arts[0], *args)
    assert res.exit_code == 2 and flag in res.output


def test_layerwise_quality_on_a_tied_table(tmp_path):
    """A tied table (one stored tensor, two parameters): the layer-wise reference reads the
    source's one table as its embedding's rows and as its head's."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "gemma")
    tiny.save_tokenizer(src, vocab_size=256)
    art = tmp_path / "g.lct"
    lct.convert(str(src), art, policy=Policy(nf4=("embed", "head")))
    whole = measure_quality(art, str(src), max_tokens=120, block=64)
    streamed = measure_quality(art, str(src), max_tokens=120, block=64, layerwise=True)
    assert streamed.ppl_reference == pytest.approx(whole.ppl_reference, rel=1e-5)
    assert streamed.kl_mean == pytest.approx(whole.kl_mean, rel=1e-4, abs=1e-7)


def _whole_sums(model, ref, blocks) -> dict:
    """``score``'s sums from each block's whole logits, as it computed them before issue 37.6."""
    sums = {"nll": 0.0, "nll_ref": 0.0, "agree": 0, "kl": 0.0, "kl_max": 0.0, "n": 0}
    with torch.no_grad():
        for b in blocks:
            x = torch.tensor([b])
            lp = F.log_softmax(model(x).logits[0, :-1].float(), -1)
            lr = F.log_softmax(ref(x).logits[0, :-1].float(), -1)
            sums["nll"] -= lp.gather(1, x[0, 1:, None]).sum().item()
            sums["nll_ref"] -= lr.gather(1, x[0, 1:, None]).sum().item()
            sums["agree"] += int((lp.argmax(-1) == lr.argmax(-1)).sum())
            kl = (lr.exp() * (lr - lp)).sum(-1)
            sums["kl"] += kl.sum().item()
            sums["kl_max"] = max(sums["kl_max"], kl.max().item())
            sums["n"] += len(b) - 1
    return sums


@pytest.mark.parametrize("head", ["plain", "nf4"])
def test_scoring_holds_the_logits_of_a_few_positions_and_gives_the_whole_numbers(src, arts,
                                                                                 head, tmp_path):
    """Issue 37.6: the logits of a whole block ([tokens, vocab]: 0.5 GB in float32 for 512
    positions of a 262k vocabulary) never exist. Each model's trunk runs once a block, its head
    on at most ``positions`` positions a call, and the sums equal those of whole logits: within
    1e-6 relative where the head is a plain matrix (NF4 embedding, plain head). LCT's kept NF4
    head picks its kernel by the rows it is given, so its logits move by an ulp between a
    slice and the whole, and the KL (a difference of close log-probabilities) by about 2e-5
    relative; perplexities stay within 1e-6."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lct.conversion import sample_text
    from lct.conversion.quality import score
    art = arts[0]
    if head == "plain":
        art = tmp_path / "embed-nf4.lct"
        lct.convert(str(src), art, policy=Policy(nf4=("embed",)))
    model = lct.load(art, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert (type(model.get_output_embeddings()).__name__ == "NF4Linear") == (head == "nf4")
    blocks = token_blocks(AutoTokenizer.from_pretrained(art), sample_text.samples(), 300, 130)
    assert [len(b) for b in blocks] == [130, 130, 43]     # slices of 50, 50 and 30
    sums = _whole_sums(model, ref, blocks)
    heads, trunks = [], []
    hooks = [m.get_output_embeddings().register_forward_hook(
        lambda mod, i, o: heads.append(o.shape[-2])) for m in (model, ref)]
    hooks += [m.model.layers[0].register_forward_hook(lambda *a: trunks.append(1))
              for m in (model, ref)]
    try:
        got = score(model, ref, blocks, positions=50)
    finally:
        for h in hooks:
            h.remove()
    # every position, the last one's logits (which score nothing) in the last slice
    assert max(heads) == 50 and sum(heads) == 2 * sum(len(b) for b in blocks)
    assert len(trunks) == 2 * len(blocks)                 # each model's trunk once a block
    assert got["n"] == sums["n"] and got["agree"] == sums["agree"]
    assert sums["kl"] > 0                                 # the embedding is lossy
    for key in ("nll", "nll_ref", "kl", "kl_max"):
        rel = 1e-6 if head == "plain" or key.startswith("nll") else 1e-4
        assert got[key] == pytest.approx(sums[key], rel=rel), key


@pytest.mark.parametrize("arch,ok", [("t5", False), ("bart", True)])
def test_quality_on_encoder_decoders_scores_or_says_why_in_one_line(run, tmp_path, arch, ok):
    """Found by a new user: --quality built the reference with AutoModelForCausalLM (a
    traceback listing 200 config classes for T5, Llava, Qwen2-VL) and scored blocks longer than
    a learned position table (BART's IndexError). The reference is the class the artifact
    builds, blocks stop at the model's positions, and a model that cannot score text alone (T5
    needs decoder inputs) is one line."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / arch, arch, max_position_embeddings=64)
    tiny.save_tokenizer(src, vocab_size=256)
    art = tmp_path / f"{arch}.lct"
    assert run("convert", src, "-o", art, "--nf4", "none", "-q").exit_code == 0
    res = run("verify", art, "--against", src, "--quality", "--max-tokens", "150")
    assert "Traceback" not in res.output
    if ok:
        assert res.exit_code == 0 and "KL mean / max (nats)" in res.output, res.output
    else:
        assert res.exit_code == 1 and "T5ForConditionalGeneration could not run on text " \
            "alone (ValueError" in res.output, res.output
