"""A mixture of experts reads only the experts its tokens are routed to (issue 38, item 4): the
layer-wise model and modules a device map leaves on "disk" read, of a block's experts group,
exactly the chunks of the experts the router chose (checked against the router's own choice in
the fully loaded model), give the fully loaded model's logits and tokens, and read the whole
group where LCT cannot know the routing."""

import pytest
import torch

import lct
from lct.demo.tiny import save_tiny
from lct.format.layout import EXPERT_INDEX
from lct.io.reader import Artifact
from lct.loader import LayerwiseModel
from lct.loader.experts import RoutedExperts

IDS = torch.tensor([[1, 5, 9]])


@pytest.fixture(scope="module", params=[
    ("mixtral", dict(num_local_experts=8)),
    ("qwen2_moe", dict(num_experts=8, shared_expert_intermediate_size=32)),
], ids=["mixtral", "qwen2_moe"])
def moe(request, tmp_path_factory):
    """A tiny MoE of 2 layers, 8 experts, 2 per token: one expert a chunk (EXPERT_CHUNKS = 8),
    so each routed expert is chunks of its own."""
    model_type, experts = request.param
    d = tmp_path_factory.mktemp(model_type)
    src = save_tiny(d / "src", model_type, num_attention_heads=4, num_key_value_heads=2,
                    num_experts_per_tok=2, **experts)
    art = d / "a.lct"
    lct.convert(str(src), art, policy=lct.Policy(nf4=()))
    return art


def _chosen(model, ids) -> list:
    """``[{layer: experts}]`` per forward: what each experts module was handed, the router's
    choice, recorded in the fully loaded model."""
    seen: list = []
    hooks = []
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            layer = int(name.split(".")[2])

            def pre(m, args, kwargs, layer=layer):
                index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
                seen[-1].setdefault(layer, set()).update(torch.unique(index).tolist())
            hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    hooks.append(model.register_forward_pre_hook(lambda m, a: seen.append({})))
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        for h in hooks:
            h.remove()
    return seen, out


def _chunks_of(art, layer: int, experts) -> set:
    m = lct.open(art).manifest
    return {p.chunk for t in m.group_tensors(f"layers.{layer}.experts")
            for p in t.placements() if int(EXPERT_INDEX.search(t.name).group(1)) in experts}


def _expert_reads(monkeypatch) -> list:
    """The experts chunks read, one set per model forward (a forward starts at the layer-0
    block's group, read before any of its experts)."""
    seen: list = []
    real = Artifact.read_stored

    def spy(self, chunk, **kw):
        if chunk.group == "layers.0":
            seen.append(set())
        elif chunk.group.endswith(".experts"):
            seen[-1].add((int(chunk.group.split(".")[1]), chunk.id))
        return real(self, chunk, **kw)
    monkeypatch.setattr(Artifact, "read_stored", spy)
    return seen


def _want_reads(art, chosen) -> list:
    return [{(layer, c) for layer, experts in forward.items()
             for c in _chunks_of(art, layer, experts)} for forward in chosen]


def test_layerwise_reads_exactly_the_routed_experts(moe, monkeypatch):
    full = lct.load(moe)
    chosen, want_tokens = _chosen(full, IDS)
    with torch.no_grad():
        want = full(IDS).logits
    with LayerwiseModel(moe, prefetch=2, cache=False) as lw:
        assert sorted(lw.routed) == ["layers.0.experts", "layers.1.experts"]
        assert lw.layer_groups == ["layers.0", "layers.1"]    # the experts leave the stream
        seen = _expert_reads(monkeypatch)
        tokens = lw.generate(IDS, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, want_tokens)
        assert seen == _want_reads(moe, chosen)
        stats = lw.expert_stats
        assert stats["whole_reads"] == 0 and stats["routed_groups"] == 2
        assert 0 < stats["read"] < stats["all"]
        m = lct.open(moe).manifest
        every = sum(c.stored_size for c in m.chunks if c.group.endswith(".experts"))
        assert [f[1] for f in stats["forwards"]] == [every] * 4     # the prompt, 3 tokens
        sizes = {c.id: c.stored_size for c in m.chunks}
        assert [f[0] for f in stats["forwards"]] == [sum(sizes[c] for _, c in forward)
                                                     for forward in seen]
        # a generated token (one position): 2 of 8 experts in each of 2 layers, a chunk each
        assert [len(forward) for forward in seen[1:]] == [4] * 3
        with torch.no_grad():
            assert torch.equal(lw(IDS).logits, want)


def test_disk_modules_read_exactly_the_routed_experts(moe, monkeypatch):
    full = lct.load(moe)
    chosen, want_tokens = _chosen(full, IDS)
    dmap = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
            "lm_head": "cpu", "model.layers.0": "disk", "model.layers.1": "disk"}
    model = lct.load(moe, device_map=dmap)
    seen = _expert_reads(monkeypatch)
    assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), want_tokens)
    assert seen == _want_reads(moe, chosen)
    b = model.lct_expert_bytes
    assert b.whole == 0 and 0 < b.read < b.all and b.reads == 8     # 2 layers, 4 forwards


def test_auto_map_below_the_model_reads_the_routed_experts(moe):
    full = lct.load(moe)
    with torch.no_grad():
        want = full(IDS).logits
    model = lct.load(moe, device_map="auto", max_memory={"cpu": 150_000})
    assert "disk" in set(model.hf_device_map.values())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)
    b = model.lct_expert_bytes
    assert b.reads and b.whole == 0 and b.read < b.all


def test_an_unknown_experts_implementation_reads_the_whole_group(moe, monkeypatch):
    """Where LCT does not know that the experts module reads only the routed rows, every
    expert is read (the reason is kept), and the answers are the same."""
    from lct.loader import experts
    monkeypatch.setattr(experts, "ROUTED_IMPLEMENTATIONS", (None, "eager"))   # not grouped_mm
    full = lct.load(moe)
    with torch.no_grad():
        want = full(IDS).logits
    with LayerwiseModel(moe, prefetch=1, cache=False) as lw:
        assert lw.routed == {}
        assert lw.layer_groups == ["layers.0", "layers.0.experts", "layers.1",
                                   "layers.1.experts"]
        assert all("grouped_mm" in why for why in lw.expert_stats["whole_groups"].values())
        with torch.no_grad():
            assert torch.equal(lw(IDS).logits, want)
        s = lw.expert_stats
        assert s["read"] == s["all"] > 0 and s["whole_reads"] == 2


def test_a_routing_lct_cannot_read_falls_back_to_every_expert(moe):
    """At run time, indices that are not experts of the module (a sentinel, a float tensor)
    mean the whole group: ``experts_of`` says None and ``read(None)`` reads every chunk."""
    art = lct.open(moe)
    with LayerwiseModel(moe, cache=False) as lw:
        r: RoutedExperts = lw.routed["layers.0.experts"]
        assert r.experts_of(torch.tensor([[3, 1], [1, 6]])) == [1, 3, 6]
        assert r.experts_of(torch.tensor([[0, 8]])) is None          # 8 experts: 0..7
        assert r.experts_of(torch.tensor([[0, -1]])) is None
        assert r.experts_of(torch.tensor([[0.0, 1.0]])) is None
        assert r.experts_of(None) is None
        from lct.loader.experts import ExpertBytes
        b = ExpertBytes()
        whole = r.read(None, bytes_=b)
        assert b.read == b.all == r.all_bytes and b.whole == 1
        assert set(r.chunks(range(8))) == {c.id for c in
                                           art.manifest.group_chunks("layers.0.experts")}
        part = r.read([2, 5], bytes_=b)
        for name, t in part.items():
            assert torch.equal(t[[2, 5]], whole[name][[2, 5]]), name


def test_experts_without_top_k_index_are_read_whole(tmp_path):
    """GPT-OSS's experts module takes ``router_indices``, not transformers' ``top_k_index``:
    LCT reads its experts whole, and says why."""
    src = save_tiny(tmp_path / "src", "gpt_oss", num_attention_heads=4, num_key_value_heads=2)
    art = tmp_path / "a.lct"
    lct.convert(str(src), art, policy=lct.Policy(nf4=()))
    with torch.no_grad():
        want = lct.load(art)(IDS).logits
    with LayerwiseModel(art, cache=False) as lw:
        assert lw.routed == {}
        whys = set(lw.expert_stats["whole_groups"].values())
        assert whys == {"GptOssExperts.forward takes no top_k_index"}, whys
        with torch.no_grad():
            assert torch.equal(lw(IDS).logits, want)


def test_load_layerwise_json_reports_expert_bytes(moe, run):
    import json
    res = run("load", moe, "--layerwise", "--ids", "1,5,9", "--max-new-tokens", "3", "--json",
              "--no-cache")
    assert res.exit_code == 0, res.output
    e = json.loads(res.stdout)["expert_bytes"]
    assert e["routed_groups"] == 2 and e["whole_groups"] == {} and e["whole_reads"] == 0
    assert len(e["forwards"]) == 3 and 0 < e["read"] < e["all"]
    assert [sum(f) for f in zip(*e["forwards"])] == [e["read"], e["all"]]
    res = run("load", moe, "--layerwise", "--ids", "1,5,9", "--max-new-tokens", "2",
              "--no-cache")
    assert "expert bytes read / all experts'" in res.output


@pytest.fixture(scope="module")
def shared_chunks(tmp_path_factory):
    """16 experts, 2 per token: two experts a chunk (ceil(16 / EXPERT_CHUNKS))."""
    d = tmp_path_factory.mktemp("mixtral16")
    src = save_tiny(d / "src", "mixtral", num_attention_heads=4, num_key_value_heads=2,
                    num_experts_per_tok=2, num_local_experts=16)
    art = d / "a.lct"
    lct.convert(str(src), art, policy=lct.Policy(nf4=()))
    return art


def test_routed_experts_are_read_a_batch_at_a_time_each_chunk_once(shared_chunks, monkeypatch):
    """The routed experts are read and converted in batches that share no chunk (the experts of
    one chunk together), one batch's bytes held at a time, not all of them: each chunk is read
    once per forward, and the tokens are the fully loaded model's."""
    full = lct.load(shared_chunks)
    chosen, want_tokens = _chosen(full, IDS)
    calls: list = []
    real = RoutedExperts._convert

    def spy(self, ids, experts, cached):
        calls.append((self.group, tuple(ids), tuple(experts)))
        return real(self, ids, experts, cached)
    monkeypatch.setattr(RoutedExperts, "_convert", spy)
    reads: list = []
    real_read = Artifact.read_stored

    def read_spy(self, chunk, **kw):
        if chunk.group.endswith(".experts"):
            reads.append((chunk.group, chunk.id))
        return real_read(self, chunk, **kw)
    monkeypatch.setattr(Artifact, "read_stored", read_spy)
    with LayerwiseModel(shared_chunks, prefetch=2, cache=False) as lw:
        r = lw.routed["layers.0.experts"]
        assert any(len(b) == 2 for b, _ in r.batches(range(16)))     # two experts a chunk
        tokens = lw.generate(IDS, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, want_tokens)
    assert len(reads) == sum(len(_chunks_of(shared_chunks, layer, experts))   # each chunk once
                             for forward in chosen for layer, experts in forward.items())
    for group, ids, experts in calls:
        rr = lw.routed[group]
        assert set(ids) == set().union(*(rr.chunks_of[e] for e in experts))
        assert len(experts) <= 2                                    # one chunk's experts
    assert len(calls) == sum(len(lw.routed[f"layers.{layer}.experts"].batches(experts))
                             for forward in chosen for layer, experts in forward.items())
