"""The auto policy's calibration layer by layer (lct/conversion/layered.py, issue 38): the same
costs as the whole source model gives, with one decoder layer in memory at a time and neither
table ever whole."""

from __future__ import annotations

import pytest

from lct.arch.model import Architecture
from lct.conversion.converter import Policy
from lct.conversion.policy import calibration_costs
from lct.conversion.source import resolve, scan
from lct.demo import tiny
from lct.format import constants as C


def _calibrate(folder, policy=None, layered=None, progress=None):
    src = resolve(str(folder))
    tensors = scan(src)
    arch = Architecture.from_folder(src.root, names=list(tensors))
    lossy: dict = {}
    for name, st in tensors.items():
        role = arch.place(name)[1]
        if role in C.LOSSY_ROLES and len(st.shape) == 2:
            lossy.setdefault(role, name)
    return calibration_costs(src, tensors, lossy, "head" not in lossy, arch,
                             policy or Policy(), progress, layered=layered)


# llama and qwen2: untied tables; gemma: a tied, scaled embedding; gemma2: a logit soft-cap
# and sliding-window layers; gemma3_text: local and global rotary tables; gpt2: learned
# position embeddings and dropout (off in eval); mixtral: routed experts, fused by the model
# from the checkpoint's tensors as from_pretrained fuses them
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gemma2", "gemma3_text", "gpt2",
                                  "mixtral"])
def test_layer_wise_calibration_equals_the_whole_model(tmp_path, arch):
    src = tiny.save_tiny(tmp_path / arch, arch)
    tiny.save_tokenizer(src, vocab_size=256)
    whole = _calibrate(src, layered=False)
    layered = _calibrate(src, layered=True)
    assert whole[3] == layered[3] == "float32" and (whole[4], layered[4]) == (False, True)
    assert whole[1] == layered[1] > 0               # the same scored tokens
    compared = 0
    for part, costs in whole[0].items():
        assert list(costs) == list(layered[0][part])   # the same candidates, in order
        for e, v in costs.items():
            if e in whole[2].get(part, ()) or e in layered[2].get(part, ()):
                continue                           # a lower bound in one of them
            # abs: a near-lossless table's cost (~4e-7 nats a token on mixtral) differs by
            # ~3e-9 between the two runs, float32 sums in another order (transformers
            # 5.25's experts); the encodings' costs are 1e-7 to 1e-2 apart
            assert layered[0][part][e] == pytest.approx(v, rel=1e-3, abs=1e-8), (part, e)
            assert v > 0
            compared += 1
    assert compared >= len(whole[0])
    if arch == "gemma":     # a tied table forced lossy: embedding and head measured in full
        forced = Policy(int8=("embed", "head"))
        w, lw = _calibrate(src, forced, False), _calibrate(src, forced, True)
        assert lw[0]["embed+head"]["int8"] == pytest.approx(w[0]["embed+head"]["int8"],
                                                            rel=1e-3)


def test_one_layer_in_memory_and_neither_table_whole(tmp_path, monkeypatch):
    """When a layer runs, it alone of the decoder layers holds real tensors; the embedding and
    the head modules never hold a table of the vocabulary's rows."""
    from lct.conversion import layered
    src = tiny.save_tiny(tmp_path / "llama", "llama", num_hidden_layers=4)
    tiny.save_tokenizer(src, vocab_size=256)
    vocab = tiny.config_for("llama").vocab_size
    seen = []
    pre = layered.SourceTrunk._pre

    def watch(self, index):
        hook = pre(self, index)

        def check(module, args):
            hook(module, args)
            layers = self.model.get_submodule(self.arch.main.path)
            real = [i for i, m in enumerate(layers)
                    if any(not p.is_meta for p in m.parameters())]
            tables = [m.weight.shape[0] for m in (self.embed_module, self.head_module)
                      if not m.weight.is_meta]
            seen.append((index, real, tables))
        return check
    monkeypatch.setattr(layered.SourceTrunk, "_pre", watch)
    costs = _calibrate(src, layered=True)[0]
    assert set(costs) == {"embed", "head"}
    assert [s[0] for s in seen] == list(range(4)) * (len(seen) // 4) and seen
    assert all(real == [index] for index, real, _ in seen)
    assert all(all(rows < vocab for rows in tables) for _, _, tables in seen)


def test_a_model_that_cannot_run_layer_by_layer_runs_whole(tmp_path, monkeypatch):
    """The layer-wise path is the default; a model it cannot run (here: made to refuse) is run
    whole as before, and ``layered=True`` says why it cannot."""
    from lct.conversion import layered
    from lct.errors import CalibrationUnavailable
    src = tiny.save_tiny(tmp_path / "gemma", "gemma")
    tiny.save_tokenizer(src, vocab_size=256)
    assert _calibrate(src)[4] is True

    def refuse(*a, **k):
        raise CalibrationUnavailable("not one stack of decoder layers")
    monkeypatch.setattr(layered, "layerwise_costs", refuse)
    assert _calibrate(src)[4] is False
    with pytest.raises(CalibrationUnavailable, match="not one stack"):
        _calibrate(src, layered=True)


def test_the_trunk_reads_the_source_files_only_while_it_reads(tmp_path, monkeypatch):
    """Every read opens its file and closes it (a file kept open keeps every page it mapped
    in the resident set: 12.9 GB on the Qwen2-7B shape before this)."""
    import safetensors
    src = tiny.save_tiny(tmp_path / "qwen2", "qwen2")
    tiny.save_tokenizer(src, vocab_size=256)
    open_now = [0]
    real = safetensors.safe_open

    class Counted:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)
            open_now[0] += 1        # until closed (a handle kept open stays counted)

        def __enter__(self):
            return self.f.__enter__()

        def __exit__(self, *exc):
            open_now[0] -= 1
            return self.f.__exit__(*exc)
    monkeypatch.setattr(safetensors, "safe_open", Counted)
    peak = []
    _calibrate(src, layered=True, progress=lambda *a: peak.append(open_now[0]))
    assert peak and max(peak) == 0


def test_progress_counts_every_pass_layer_by_layer(tmp_path):
    """The layer-wise calibration tells ``progress`` what the whole-model one tells, in the
    same total of tokens: the reference and each embedding candidate after every layer, each
    head candidate once, a pruned embedding taken off the total; never backwards."""
    src = tiny.save_tiny(tmp_path / "gemma", "gemma")
    tiny.save_tokenizer(src, vocab_size=256)
    for layered in (False, True):
        calls = []
        costs, n, partial, _, _ = _calibrate(src, layered=layered,
                                             progress=lambda *a: calls.append(a))
        done = [c[1] for c in calls]
        assert done == sorted(done) and calls[-1][1] == calls[-1][2]
        cands = list(costs["embed+head"])
        pruned = partial.get("embed+head", [])
        assert calls[0][2] == calls[0][2] // (1 + 2 * len(cands)) * (1 + 2 * len(cands))
        sweep = calls[0][2] // (1 + 2 * len(cands))
        assert calls[-1][2] == sweep * (1 + 2 * len(cands) - len(pruned))
        whats = {c[0] for c in calls}
        how = "layer by layer" if layered else "whole model"
        for e in cands:
            assert any(w.endswith(f"on embed+head: embed ({how})") for w in whats) or pruned
