"""The auto policy: the smallest encoding within the budget, NF4 for a head that tolerates it
and int8 for one that does not (by the text-free proxy and by calibration text), a tied table
decided once, and what the manifest, convert and info say about it."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import lct
from lct.conversion.converter import Policy
from lct.conversion.policy import (DEFAULT_BUDGET_KL, ESTIMATE_MARGIN, SHIPPED_CALIBRATION_TOKENS,
                                  choose, head_proxy, proxy_hidden)
from lct.demo import tiny
from lct.errors import PolicyError
from lct.format import constants as C


def _source(tmp_path, arch, head_std=None, seed=0, tokenizer=False):
    """A tiny model whose head (and, untied, embedding) rows are drawn with ``head_std``."""
    src = tiny.save_tiny(tmp_path / f"src-{arch}-{head_std}", arch, seed=seed)
    if head_std is not None:
        f = next(src.glob("*.safetensors"))
        sd = load_file(f)
        g = torch.Generator().manual_seed(seed)
        for name in list(sd):
            if name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight"):
                sd[name] = (torch.randn(sd[name].shape, generator=g) * head_std).to(sd[name].dtype)
        save_file(sd, f, metadata={"format": "pt"})
    if tokenizer:
        tiny.save_tokenizer(src, vocab_size=256)
    return src


def _encodings(art):
    m = json.loads((art / "lct.json").read_text())
    return {t["role"]: t["encoding"] for t in m["tensors"] if t["role"] in ("embed", "head")}, m


def test_choose_smallest_within_budget():
    shapes = {"embed": (1000, 64), "head": (1000, 64)}
    dtypes = {"embed": "bfloat16", "head": "bfloat16"}
    costs = {"embed": {"nf4": 0.004, "int8": 0.0001}, "head": {"nf4": 0.2, "int8": 0.003}}
    chosen, cost = choose(costs, shapes, dtypes, 0.01, 64)
    assert chosen == {"embed": "nf4", "head": "int8"} and cost == pytest.approx(0.007)
    # a tighter budget pushes the embedding to int8 too (the NF4 embed + int8 head case)
    chosen, _ = choose(costs, shapes, dtypes, 0.005, 64)
    assert chosen == {"embed": "int8", "head": "int8"}
    # nothing lossy fits: lossless
    chosen, cost = choose(costs, shapes, dtypes, 0.00001, 64)
    assert chosen == {"embed": "plain", "head": "plain"} and cost == 0
    tied, _ = choose({"embed+head": {"nf4": 0.3, "int8": 0.002}}, {"embed+head": (1000, 64)},
                     {"embed+head": "bfloat16"}, 0.01, 64)
    assert tied == {"embed": "int8", "head": "int8"}


def test_proxy_costs_scale_with_logit_spread():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(500, 64, generator=g)
    h = proxy_hidden(torch.ones(64), None, 64, 32)
    small, rel = head_proxy((w * 0.001).to(torch.bfloat16), h, ("nf4", "int8"), 64)
    big, rel_big = head_proxy((w * 0.5).to(torch.bfloat16), h, ("nf4", "int8"), 64)
    assert small["nf4"] < 1e-4 and big["nf4"] > 0.02
    assert big["int8"] < big["nf4"] / 20
    # the relative weight error does not depend on the scale
    assert rel["nf4"] == pytest.approx(rel_big["nf4"], rel=0.05)


def test_nf4_for_a_tolerant_head_int8_for_a_hostile_one(tmp_path):
    benign = _source(tmp_path, "llama", head_std=0.002)
    hostile = _source(tmp_path, "llama", head_std=0.5)
    lct.convert(str(benign), tmp_path / "b.lct")
    lct.convert(str(hostile), tmp_path / "h.lct")
    eb, mb = _encodings(tmp_path / "b.lct")
    eh, mh = _encodings(tmp_path / "h.lct")
    assert eb == {"embed": "nf4", "head": "nf4"}
    assert eh["head"] == "int8"
    meas = mh["policy"]["measured"]
    assert mh["policy"]["mode"] == "auto" and meas["method"] == "proxy"
    assert meas["costs"]["head"]["nf4"] > DEFAULT_BUDGET_KL > meas["costs"]["head"]["int8"]
    assert meas["cost_kl"] <= meas["budget_kl"]


def test_budget_decides(tmp_path):
    src = _source(tmp_path, "llama", head_std=0.5)
    lct.convert(str(src), tmp_path / "loose.lct", policy=Policy(budget=9.0))
    lct.convert(str(src), tmp_path / "tight.lct", policy=Policy(budget=1e-9))
    assert _encodings(tmp_path / "loose.lct")[0] == {"embed": "nf4", "head": "nf4"}
    assert _encodings(tmp_path / "tight.lct")[0] == {"embed": "plain", "head": "plain"}
    with pytest.raises(PolicyError, match="budget"):
        Policy(budget=0).check()


def test_tied_table_decided_once(tmp_path):
    src = _source(tmp_path, "gemma", head_std=0.5)
    rep = lct.convert(str(src), tmp_path / "g.lct")
    enc, m = _encodings(tmp_path / "g.lct")
    assert set(m["ties"].values()) == {"model.embed_tokens.weight"}
    assert list(rep.decision.costs) == ["embed+head"]
    assert enc["embed"] == rep.decision.chosen["embed"] == rep.decision.chosen["head"]
    assert "embed+head" in rep.decision.summary()


def test_calibration_measures_on_text(tmp_path):
    src = _source(tmp_path, "llama", head_std=0.5, tokenizer=True)
    text = tmp_path / "t.txt"
    from lct.conversion import sample_text
    text.write_text(sample_text.PROSE[:4000])
    rep = lct.convert(str(src), tmp_path / "c.lct",
                      policy=Policy(calibration=str(text), max_calibration_tokens=256))
    d = rep.decision
    assert d.method == "calibration" and 0 < d.tokens <= 256
    assert d.note == "the text given, in float32, layer by layer"
    assert set(d.costs) == {"embed", "head"}
    assert d.costs["head"]["nf4"] > d.costs["head"]["int8"] > 0
    # the calibration cost of the head equals an independent computation on the same tokens
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lct.conversion.policy import roundtrip
    from lct.conversion.quality import read_texts, token_blocks
    # in float32, as the calibration computes where the model fits in memory so
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    blocks = token_blocks(AutoTokenizer.from_pretrained(src), read_texts(text), 256, 512)
    ref = model.lm_head.weight.data.clone()
    total = n = 0
    with torch.no_grad():
        for ids in blocks:
            x = torch.tensor([ids])
            lr = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            model.lm_head.weight.data = roundtrip("int8", ref.bfloat16(), 64).to(ref.dtype)
            lq = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            model.lm_head.weight.data = ref
            total += float((lr.exp() * (lr - lq)).sum())
            n += len(ids) - 1
    assert d.costs["head"]["int8"] == pytest.approx(total / n, rel=1e-6)
    with pytest.raises(PolicyError, match="calibration"):
        Policy(nf4=("head",), calibration=str(text)).check()


def test_cli_prints_choice_and_info_shows_it(tmp_path):
    from click.testing import CliRunner

    from lct.cli.main import cli
    src = _source(tmp_path, "llama", head_std=0.5)
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "a.lct")])
    assert r.exit_code == 0, r.output
    # no tokenizer: the shipped calibration text cannot run, and the line says why
    assert "policy auto (proxy; no calibration: the source has no tokenizer): " in r.output
    assert "head int8" in r.output
    # each candidate's cost and stored size, lossless's size beside them
    assert "int8 0.0" in r.output and "plain 98.30 KB" in r.output
    r = CliRunner().invoke(cli, ["info", str(tmp_path / "a.lct")])
    assert "policy: auto" in r.output and "measured (proxy; no calibration" in r.output
    assert "within the budget" in r.output and "(50.69 KB)" in r.output
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "b.lct"),
                                 "--nf4", "embed,head"])
    assert r.exit_code == 0, r.output
    assert "policy manual (proxy; " in r.output and "OVER the budget" in r.output
    assert "head nf4" in r.output and "embed nf4" in r.output
    r = CliRunner().invoke(cli, ["info", str(tmp_path / "b.lct")])
    assert "policy: manual" in r.output and "OVER the budget" in r.output
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "d.lct"),
                                 "--nf4", "none"])
    assert r.exit_code == 0 and "every tensor lossless" in r.output
    r = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "c.lct"),
                                 "--nf4", "head", "--int8", "head"])
    assert r.exit_code != 0 and "both name 'head'" in r.output


def test_manual_policy_measures_only_what_it_forces(tmp_path):
    src = _source(tmp_path, "llama", head_std=0.5)
    rep = lct.convert(str(src), tmp_path / "a.lct", policy=Policy(nf4=("embed",)))
    d = rep.decision
    assert d.mode == "manual" and d.chosen == {"embed": "nf4", "head": "plain"}
    assert list(d.costs) == ["embed"] and list(d.costs["embed"]) == ["nf4"]
    assert d.cost == d.costs["embed"]["nf4"] > 0
    m = json.loads((tmp_path / "a.lct" / "lct.json").read_text())
    assert m["policy"]["measured"]["mode"] == "manual" and m["policy"]["nf4"] == ["embed"]


def _with_non_finite(src, names=("lm_head.weight", "embed_tokens.weight")):
    f = next(src.glob("*.safetensors"))
    sd = load_file(f)
    for name in list(sd):
        if name.endswith(names):
            t = sd[name].clone()
            t.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
            sd[name] = t
    save_file(sd, f, metadata={"format": "pt"})
    return sd


def test_a_table_holding_nan_or_inf_stays_lossless_bit_for_bit(tmp_path):
    """The auto policy measured NF4 on a table with a NaN and ended in "tensor: NF4 cannot
    encode NaN or Inf values" (no file, no tensor, no way out): it keeps such a table
    lossless and says why; forcing a lossy encoding on it is refused naming the tensor."""
    src = _source(tmp_path, "llama")
    sd = _with_non_finite(src)
    out = tmp_path / "a.lct"
    lct.convert(str(src), out)
    enc, m = _encodings(out)
    assert enc == {"embed": "plain", "head": "plain"}
    assert set(m["policy"]["measured"]["kept"]) == {"embed", "head"}
    with lct.open(out) as art:
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            got = art.read_tensor(name)
            assert torch.equal(got.view(torch.int16), sd[name].view(torch.int16))
    with pytest.raises(PolicyError, match=r"model.safetensors: tensor 'lm_head.weight' holds "
                                          r"NaN or Inf values, which NF4 cannot encode"):
        lct.convert(str(src), tmp_path / "b.lct", policy=Policy(nf4=("head",)))


def test_a_nan_cost_is_not_within_the_budget():
    """``nan > budget`` is False: a calibration run with non-finite logits made NF4 look
    free."""
    shapes, dtypes = {"head": (1000, 64)}, {"head": "bfloat16"}
    chosen, cost = choose({"head": {"nf4": float("nan"), "int8": float("nan")}}, shapes, dtypes,
                          0.01, 64)
    assert chosen["head"] == "plain" and cost == 0


def test_non_finite_calibration_costs_are_null_in_standard_json(tmp_path):
    """A NaN in a layer makes every calibration cost NaN: none is within the budget (NF4 was
    chosen), and the manifest says null where it wrote a bare NaN, which is not JSON."""
    src = _source(tmp_path, "llama", tokenizer=True)
    _with_non_finite(src, names=("layers.0.mlp.down_proj.weight",))
    text = tmp_path / "t.txt"
    from lct.conversion import sample_text
    text.write_text(sample_text.PROSE[:2000])
    out = tmp_path / "c.lct"
    lct.convert(str(src), out, policy=Policy(calibration=str(text), max_calibration_tokens=64))
    enc, m = _encodings(out)
    assert enc == {"embed": "plain", "head": "plain"}
    raw = (out / "lct.json").read_text()
    assert "NaN" not in raw
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert m["policy"]["measured"]["costs"]["head"] == {"nf4": None, "int8": None, "q8_0": None}
    with lct.open(out, verify=True):
        pass
    # and it says why (found by a new user: "estimated mean KL 0.0000", no word of the NaN)
    d = lct.convert(str(src), tmp_path / "d.lct", policy=Policy(
        calibration=str(text), max_calibration_tokens=64)).decision
    assert "logits on it are not finite" in d.note and "kept lossless" in d.note


def _full_forward_kl(src, module_of, wq_of, blocks) -> float:
    """Mean KL on ``blocks`` of the model with ``module_of(model)``'s weight replaced by
    ``wq_of(weight)``, every pass a whole forward (no kept trunk output), in float32."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    mod = module_of(model)
    total = n = 0
    with torch.no_grad():
        for ids in blocks:
            x = torch.tensor([ids])
            lr = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            keep = mod.weight
            mod.weight = torch.nn.Parameter(wq_of(keep.detach()), requires_grad=False)
            lq = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            mod.weight = keep
            total += float((lr.exp() * (lr - lq)).sum())
            n += len(ids) - 1
    return total / n


def _shipped_blocks(src):
    from transformers import AutoTokenizer

    from lct.conversion import sample_text
    from lct.conversion.quality import DEFAULT_BLOCK, token_blocks
    return token_blocks(AutoTokenizer.from_pretrained(src), sample_text.calibration_samples(),
                        SHIPPED_CALIBRATION_TOKENS, DEFAULT_BLOCK, spread=True)


def test_default_calibration_runs_the_shipped_text(tmp_path):
    """With a tokenizer and no --calibration, the policy measures on the text shipped with LCT
    (prose and code, none of it the text verify --quality scores): the head on the model's
    kept trunk output gives what whole forward passes give, for a tied table the head's and
    the embedding's costs add up."""
    from lct.conversion import sample_text
    from lct.conversion.policy import roundtrip
    shipped = {t for _, t in sample_text.calibration_samples()}
    assert not shipped & {t for _, t in sample_text.samples()}
    src = _source(tmp_path, "gemma", head_std=0.02, tokenizer=True)
    rep = lct.convert(str(src), tmp_path / "g.lct")
    d = rep.decision
    assert d.method == "calibration" and d.note.endswith(
        "calibration text (lct/conversion/sample_text.py), in float32, layer by layer")
    blocks = _shipped_blocks(src)
    assert d.tokens == sum(len(b) - 1 for b in blocks) and 0 < d.tokens <= 256
    assert len(blocks) >= 3             # a share of the prose and of each code module
    assert list(d.costs) == ["embed+head"]

    def wq(e):      # the stored (bfloat16) values' round trip
        return lambda w: roundtrip(e, w.bfloat16(), 64).to(w.dtype)
    for e in ("nf4", "int8"):     # forced, each is measured whole
        forced = lct.convert(str(src), tmp_path / f"{e}.lct",
                             policy=Policy(**{e: ("embed", "head")})).decision
        head = _full_forward_kl(src, lambda m: m.lm_head, wq(e), blocks)
        embed = _full_forward_kl(src, lambda m: m.model.embed_tokens, wq(e), blocks)
        assert head > 1e-6 and embed > 1e-6
        assert forced.costs["embed+head"][e] == pytest.approx(head + embed, rel=1e-4)
    m = json.loads((tmp_path / "g.lct" / "lct.json").read_text())["policy"]["measured"]
    assert m["method"] == "calibration" and m["tokens"] == d.tokens
    assert m["sizes"]["embed+head"]["plain"] > m["sizes"]["embed+head"]["int8"] \
        > m["sizes"]["embed+head"]["nf4"]


def test_default_calibration_falls_back_to_the_proxy_and_says_why(tmp_path, monkeypatch):
    import lct.proc
    src = _source(tmp_path, "llama", head_std=0.5, tokenizer=True)
    d = lct.convert(str(src), tmp_path / "n.lct", policy=Policy(calibration="none")).decision
    assert d.method == "proxy" and d.note == ""
    monkeypatch.setattr(lct.proc, "available_memory", lambda: 1000)
    d = lct.convert(str(src), tmp_path / "m.lct").decision
    assert d.method == "proxy" and "memory available" in d.note
    # a model that gives no next-token logits for text alone (an encoder-decoder)
    monkeypatch.undo()
    t5 = tiny.save_tiny(tmp_path / "t5", "t5")
    tiny.save_tokenizer(t5, vocab_size=256)
    d = lct.convert(str(t5), tmp_path / "t5.lct").decision
    assert d.method == "proxy" and d.note.startswith("no calibration: ")
    # a tokenizer whose ids pass the model's vocabulary (a new user's trial: the note held
    # "IndexError: index out of range in self")
    small = tiny.save_tiny(tmp_path / "small", "llama", vocab_size=100)
    tiny.save_tokenizer(small, vocab_size=512)
    d = lct.convert(str(small), tmp_path / "small.lct").decision
    assert d.method == "proxy" and "past the model's 100-row embedding: the tokenizer does " \
        "not match the model" in d.note, d.note
    # a text the user names must run: its failure is an error, not a silent proxy
    text = tmp_path / "t.txt"
    text.write_text(sample_text_prose())
    with pytest.raises(lct.errors.LCTError, match="could not run|no next-token"):
        lct.convert(str(t5), tmp_path / "t5b.lct", policy=Policy(calibration=str(text)))


def test_a_calibration_estimate_is_held_to_the_budget_times_its_measured_error(tmp_path):
    """The auto policy keeps a combination only where its estimate times ESTIMATE_MARGIN is
    within the budget; the manifest, convert's line and info say so. The proxy gets none."""
    from lct.io.info import measured_line
    src = _source(tmp_path, "llama", head_std=0.5, tokenizer=True)
    free = lct.convert(str(src), tmp_path / "free.lct", policy=Policy(budget=9.0)).decision
    assert free.method == "calibration" and free.margin == ESTIMATE_MARGIN == 2.0
    smallest = free.chosen
    assert set(smallest.values()) != {C.ENCODING_PLAIN} and free.cost > 0
    held = free.cost * free.margin
    at = lct.convert(str(src), tmp_path / "at.lct", policy=Policy(budget=held * 1.001)).decision
    assert at.chosen == smallest and at.held <= at.budget
    under = lct.convert(str(src), tmp_path / "u.lct",
                        policy=Policy(budget=free.cost * 1.5)).decision
    assert under.chosen != smallest     # the estimate fits, the estimate times its error not
    assert under.cost * under.margin <= under.budget
    m = json.loads((tmp_path / "at.lct" / "lct.json").read_text())["policy"]["measured"]
    assert m["margin"] == 2.0
    assert f"(x2 for the estimate's measured error: {held:.4f}), within" in measured_line(m)
    m["cost_kl"] = at.budget * 0.9      # within the budget alone, over it times the margin
    assert "OVER the budget" in measured_line(m)
    proxy = lct.convert(str(src), tmp_path / "p.lct", policy=Policy(calibration="none")).decision
    assert proxy.margin == 1.0
    assert "margin" not in json.loads((tmp_path / "p.lct" / "lct.json").read_text())[
        "policy"]["measured"]


def test_calibration_computes_in_the_source_dtype_where_float32_does_not_fit(tmp_path,
                                                                             monkeypatch):
    """A model the layer-wise calibration cannot run (here: made to refuse) runs whole, and
    float32 needs twice a bfloat16 model's memory: where only the bfloat16 model fits in the
    calibration's share, it computes in bfloat16 and the note says what that means."""
    import lct.proc
    from lct.conversion import layered
    from lct.conversion.source import resolve, scan
    from lct.errors import CalibrationUnavailable
    src = _source(tmp_path, "llama", head_std=0.5, tokenizer=True)
    params = sum(math.prod(st.shape) for st in scan(resolve(str(src))).values())

    def refuse(*a, **k):
        raise CalibrationUnavailable("not one stack of decoder layers")
    monkeypatch.setattr(layered, "layerwise_costs", refuse)
    monkeypatch.setattr(lct.proc, "available_memory", lambda: 6 * params)  # 2P <= 3P < 4P
    d = lct.convert(str(src), tmp_path / "b.lct").decision
    assert d.method == "calibration"
    assert d.note.endswith(", in bfloat16 (float32 would not fit in memory; the estimate holds "
                           "the compute's own rounding)"), d.note
    assert d.margin == 1.0      # larger than the float32 cost already: no margin on top
    monkeypatch.undo()
    f = lct.convert(str(src), tmp_path / "f.lct").decision
    assert f.note.endswith(", in float32, layer by layer") and f.costs != d.costs


def sample_text_prose() -> str:
    from lct.conversion import sample_text
    return sample_text.PROSE[:2000]


def test_a_tied_table_measures_the_embedding_only_where_it_can_change_the_choice(tmp_path):
    """Each embedding candidate is a whole forward pass: smallest first, a candidate whose head
    alone is over the budget, or that is larger than one within it, keeps its head's cost as a
    lower bound (``partial``, printed with ≥); a manual policy measures what it forces whole."""
    src = _source(tmp_path, "gemma", head_std=0.02, tokenizer=True)
    whole = lct.convert(str(src), tmp_path / "w.lct", policy=Policy(budget=9.0)).decision
    # a loose budget: NF4 (the smallest) fits, every larger candidate keeps its head's cost
    assert whole.chosen["embed"] == "nf4"
    assert sorted(whole.partial["embed+head"]) == ["int8", "q8_0"]
    blocks = _shipped_blocks(src)
    from lct.conversion.policy import roundtrip
    for e in ("int8", "q8_0"):
        head = _full_forward_kl(src, lambda m: m.lm_head,
                                lambda w: roundtrip(e, w, 64).to(w.dtype), blocks)
        assert whole.costs["embed+head"][e] == pytest.approx(head, rel=1e-4)
    assert "int8 ≥" in whole.summary() and "nf4 ≥" not in whole.summary()
    assert whole.summary().endswith("; ≥: a lower bound, the head's cost alone (measuring the "
                                    "embedding too could not change the choice)")
    # a budget NF4's head alone is over: its embedding is never run either
    tight = lct.convert(str(src), tmp_path / "t.lct", policy=Policy(budget=1e-9)).decision
    assert "nf4" in tight.partial["embed+head"]
    assert tight.chosen["embed"] == "plain"
    forced = lct.convert(str(src), tmp_path / "f.lct", policy=Policy(int8=("embed", "head")))
    assert forced.decision.partial == {}
    m = json.loads((tmp_path / "w.lct" / "lct.json").read_text())["policy"]["measured"]
    assert sorted(m["partial"]["embed+head"]) == ["int8", "q8_0"]
    from lct.io.info import LOWER_BOUND, measured_line
    assert measured_line(m).endswith(LOWER_BOUND)
    assert LOWER_BOUND not in forced.decision.summary()


def test_the_calibration_reports_its_passes_to_a_progress_callback(tmp_path):
    """Issue 37.7: convert said 'measuring NF4, int8, ...' and then nothing for ~115 s on a
    real model. The calibration tells ``measuring(what, done, total)`` the tokens it has run
    through the model of all it will run, naming the candidate and the part: from 0 with the
    reference to the end, never backwards, each pruned embedding pass taken off the total."""
    from lct.format.encodings import get_encoding
    src = _source(tmp_path, "gemma", head_std=0.02, tokenizer=True)
    calls = []
    d = lct.convert(str(src), tmp_path / "g.lct",
                    measuring=lambda what, done, total: calls.append((what, done, total))
                    ).decision
    assert d.method == "calibration" and list(d.costs) == ["embed+head"]
    sweep = sum(len(b) for b in _shipped_blocks(src))      # one pass over the text, in tokens
    reference = "the source model as it is (the reference)"
    assert calls[0] == (reference, 0, calls[0][2])
    # layer by layer, the reference and the smallest candidate's embedding run together
    assert sum(c[1] - b[1] for b, c in zip(calls, calls[1:]) if c[0] == reference) == sweep
    done = [c[1] for c in calls]
    assert done == sorted(done) and all(0 <= n <= t for _, n, t in calls)
    cands, pruned = list(d.costs["embed+head"]), d.partial.get("embed+head", [])
    whats = {c[0] for c in calls}
    unrun = [e for e in pruned
             if f"{get_encoding(e).label} on embed+head: embed (layer by layer)" not in whats]
    assert unrun        # the test's point: the total shrinks as passes are left out
    assert calls[0][2] == sweep * (1 + 2 * len(cands))
    assert calls[-1][1] == calls[-1][2] == sweep * (1 + 2 * len(cands) - len(unrun))
    for e in cands:
        label = get_encoding(e).label
        assert {f"{label} on embed+head: quantizing", f"{label} on embed+head: head"} <= whats
        # layer by layer, a pass of several embeddings may run one a smaller one made moot
        assert f"{label} on embed+head: embed (layer by layer)" in whats or e in pruned
    # the text-free proxy runs no text: nothing to report
    calls.clear()
    lct.convert(str(src), tmp_path / "p.lct", policy=Policy(calibration="none"),
                measuring=lambda *a: calls.append(a))
    assert calls == []


def test_convert_draws_the_measurement_and_says_where_the_time_went(tmp_path, monkeypatch):
    """Issue 37.7: lct convert draws the measurement as a bar on stderr (tokens, the candidate
    and part being measured) and its summary line splits the time between reading,
    measuring and encoding; --quiet draws nothing."""
    import re

    from click.testing import CliRunner

    from lct.cli.main import cli
    src = _source(tmp_path, "gemma", head_std=0.02, tokenizer=True)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    res = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "a.lct")])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("wrote "))
    got = re.search(r" in ([\d.]+) s: read in ([\d.]+) s, measured in ([\d.]+) s, encoded in "
                    r"([\d.]+) s \(", line)
    assert got, line
    total, read, measured, encoded = map(float, got.groups())
    assert measured > 0 and read + measured + encoded == pytest.approx(total, abs=0.15), line
    err = res.stderr
    # the bar's last state: every token run, and the candidate and part it measured last
    assert re.search(r"measure: 100%\|[^\n]*\| (\d+)/\1 \[[^]]*tok/s, Q8_0 on embed\+head: ",
                     err), err
    assert err.index("convert: measuring NF4") < err.index("measure: ") \
        < err.index("convert: encoding"), err
    quiet = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "q.lct"), "-q"])
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr


def test_int8_b128_has_one_name_in_every_message():
    """Issue 37.7: messages spelled int8_b128 with a slash where the encoding's registry name
    and its flag (--int8_b128) say int8_b128; no source of LCT, its benchmarks or tests spells
    it so."""
    from pathlib import Path

    from lct.format.encodings import get_encoding
    assert get_encoding(C.ENCODING_INT8_B128).label == C.ENCODING_INT8_B128 == "int8_b128"
    old = "int8" + "/128"
    root = Path(__file__).parent.parent
    found = [f"{f.relative_to(root)}:{n}" for d in ("lct", "loader", "kernels", "cli",
                                                     "benchmarks", "tests")
             for f in sorted((root / d).rglob("*")) if f.suffix in (".py", ".c", ".h")
             for n, text in enumerate(f.read_text(errors="replace").splitlines(), 1)
             if old in text]
    assert found == [], found
