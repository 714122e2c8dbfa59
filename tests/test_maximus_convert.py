"""Converting with Maximus shards: frequency order, one chunk per shard, state in the artifact,
reading/exporting/loading back in token-id order, and bad frequency sources."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import manifest_text
from safetensors.torch import load_file

import lct
from lct.conversion.converter import Policy
from lct.errors import ChecksumError, ManifestError, PolicyError, SourceError
from lct.format import nf4

V = 384  # the tiny Llama's vocabulary


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    rng = np.random.default_rng(0)
    c = np.bincount(rng.zipf(1.2, 5000) % V, minlength=V)
    path = tmp_path_factory.mktemp("freq") / "counts.npy"
    np.save(path, c)
    return c, path


@pytest.fixture(scope="module")
def mx_art(llama_src, counts, tmp_path_factory):
    out = tmp_path_factory.mktemp("mx") / "llama-mx.lct"
    lct.convert(str(llama_src), out, policy=Policy(maximus_shards=5), token_freq=str(counts[1]))
    return out


def test_shards_follow_counts_one_chunk_each(mx_art, counts):
    with lct.open(mx_art) as art:
        m = art.manifest
        assert m.maximus["num_shards"] == 5
        assert sorted(m.maximus["tensors"]) == ["lm_head.weight", "model.embed_tokens.weight"]
        emb = m.tensors["model.embed_tokens.weight"]
        assert emb.row_order == "maximus" and len(emb.pieces) == 5
        assert len({p.chunk for p in emb.pieces}) == 5
        assert [p.rows for p in emb.pieces] == [(0, 77), (77, 154), (154, 231), (231, 308),
                                                (308, 384)]
        state = art.maximus_state()
        order = state["maximus.row_to_id"]
        freq = torch.as_tensor(counts[0])[order]
        assert bool((freq[:-1] >= freq[1:]).all())  # hottest first
        assert torch.equal(state["maximus.token_freq"], torch.as_tensor(counts[0]))


def test_pieces_decode_alone_and_read_back_in_id_order(mx_art, llama_src):
    ref = load_file(llama_src / "model.safetensors")
    with lct.open(mx_art) as art:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            p, a = nf4.quantize(ref[name], 64)
            expected = nf4.dequantize(p, a, ref[name].shape, 64, torch.bfloat16)
            assert torch.equal(art.read_tensor(name), expected)
            w = art.read_tensor(name, dequantize=False)
            assert torch.equal(w.packed, p) and torch.equal(w.absmax, a)
        info = art.manifest.tensors["model.embed_tokens.weight"]
        piece = info.pieces[2]
        hot = art.tensor_from_buffer(piece, art.read_chunk(piece.chunk), dequantize=True)
        ids = art.maximus_state()["maximus.row_to_id"][154:231]
        p, a = nf4.quantize(ref["model.embed_tokens.weight"][ids], 64)
        assert torch.equal(hot, nf4.dequantize(p, a, (77, 128), 64, torch.bfloat16))
    assert lct.verify(mx_art, against=str(llama_src)).ok


def test_export_and_load_equal_unsharded(mx_art, llama_art, tmp_path):
    lct.export(mx_art, tmp_path / "hf")
    a = load_file(tmp_path / "hf" / "model.safetensors")
    lct.export(llama_art, tmp_path / "hf2")
    b = load_file(tmp_path / "hf2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(1, V, (2, 9), generator=torch.Generator().manual_seed(0))
    for nf4_mode in ("keep", "dequantize"):
        plain = lct.load(llama_art, nf4=nf4_mode)
        model = lct.load(mx_art, maximus=True, nf4=nf4_mode)
        emb = model.get_input_embeddings()
        assert type(emb).__name__ == "MaximusEmbedding"
        assert sorted(emb.resident) == [0]  # budget 5 // 4 = 1: the hottest shard
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain(ids).logits)


def test_plain_lossless_shards(llama_src, tmp_path, counts):
    lct.convert(str(llama_src), tmp_path / "a.lct", policy=Policy(maximus_shards=3, nf4=()),
                token_freq=str(counts[1]))
    ref = load_file(llama_src / "model.safetensors")
    with lct.open(tmp_path / "a.lct") as art:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(art.read_tensor(name), ref[name])


@pytest.mark.parametrize("content,fragment", [
    (json.dumps([1] * (V + 1)), "385 counts"),
    (json.dumps({"x": 1}), "not a token id"),
    (json.dumps({"9999": 1}), "outside the vocabulary"),
    (json.dumps([1, -2]), "expected an integer >= 0"),
    (json.dumps([0, 0, 0]), "counts no token at all"),
])
def test_bad_counts_files(llama_src, tmp_path, content, fragment):
    f = tmp_path / "c.json"
    f.write_text(content)
    with pytest.raises(SourceError, match=fragment):
        lct.convert(str(llama_src), tmp_path / "a.lct", policy=Policy(maximus_shards=2),
                    token_freq=str(f))
    assert not (tmp_path / "a.lct").exists()


def test_json_counts_and_npy_refuses_pickle(llama_src, tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"7": 100, "3": 50}))
    lct.convert(str(llama_src), tmp_path / "a.lct", policy=Policy(maximus_shards=2),
                token_freq=str(f))
    with lct.open(tmp_path / "a.lct") as art:
        assert art.maximus_state()["maximus.row_to_id"][:2].tolist() == [7, 3]
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(SourceError, match="obj.npy"):
        lct.convert(str(llama_src), tmp_path / "b.lct", policy=Policy(maximus_shards=2),
                    token_freq=str(tmp_path / "obj.npy"))


def test_text_frequencies_need_a_tokenizer(llama_src, tmp_path):
    (tmp_path / "corpus.txt").write_text("hello world " * 10)
    with pytest.raises(SourceError, match="no tokenizer"):
        lct.convert(str(llama_src), tmp_path / "a.lct", policy=Policy(maximus_shards=2),
                    token_freq=str(tmp_path / "corpus.txt"))


def test_text_frequencies_with_the_model_tokenizer(tmp_path):
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "llama", vocab_size=512)
    tiny.save_tokenizer(src, vocab_size=512)
    (tmp_path / "corpus.txt").write_text("the quick brown fox " * 50)
    lct.convert(str(src), tmp_path / "a.lct", policy=Policy(maximus_shards=4),
                token_freq=str(tmp_path / "corpus.txt"))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok((tmp_path / "corpus.txt").read_text(), add_special_tokens=False).input_ids
    expected = torch.bincount(torch.tensor(ids), minlength=512)
    with lct.open(tmp_path / "a.lct") as art:
        state = art.maximus_state()
        assert torch.equal(state["maximus.token_freq"], expected)
        used = int((expected > 0).sum())
        assert set(state["maximus.row_to_id"][:used].tolist()) == set(ids)
        assert art.manifest.maximus["frequency_source"]["kind"] == "text"


def test_no_frequency_source_orders_by_id(llama_src, tmp_path):
    res = CliRunner().invoke(lct_cli(), ["convert", str(llama_src), "-o", str(tmp_path / "a.lct"),
                                         "--maximus-shards"])
    assert res.exit_code == 0, res.output
    assert "token-id order" in res.output and "32 shards" in res.output
    with lct.open(tmp_path / "a.lct") as art:
        assert torch.equal(art.maximus_state()["maximus.row_to_id"], torch.arange(V))
    res = CliRunner().invoke(lct_cli(), ["convert", str(llama_src), "-o", str(tmp_path / "b"),
                                         "--token-freq", str(tmp_path / "a.lct" / "lct.json")])
    assert res.exit_code != 0 and "--maximus-shards" in res.output


def test_too_many_shards(llama_src, tmp_path):
    with pytest.raises(PolicyError, match="maximus_shards 999"):
        lct.convert(str(llama_src), tmp_path / "a.lct", policy=Policy(maximus_shards=999))
    # 384 rows in 300 shards of 2 rows: the last 108 would be empty, which no reader accepts.
    with pytest.raises(PolicyError, match="leaves empty shards for 384 rows .* use 192 or fewer"):
        lct.convert(str(llama_src), tmp_path / "b.lct", policy=Policy(maximus_shards=300))
    assert not (tmp_path / "b.lct").exists()


def test_corrupt_or_mismatched_state_in_artifact(mx_art, tmp_path):
    import shutil
    bad = tmp_path / "bad.lct"
    shutil.copytree(mx_art, bad)
    state = bad / "maximus.safetensors"
    data = bytearray(state.read_bytes())
    data[-3] ^= 1
    state.write_bytes(bytes(data))
    with lct.open(bad) as art, pytest.raises(ChecksumError, match="maximus.safetensors"):
        art.read_tensor("model.embed_tokens.weight")
    manifest = json.loads((bad / "lct.json").read_text())
    manifest["maximus"]["tensors"] = ["model.norm.weight"]
    (bad / "lct.json").write_text(manifest_text(manifest))
    with pytest.raises(ManifestError, match="not a frequency-ordered"):
        lct.open(bad)


def lct_cli():
    from lct.cli.main import cli
    return cli


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_verify_catches_a_corrupt_maximus_state(mx_art, tmp_path, how):
    import shutil
    art = tmp_path / "a.lct"
    shutil.copytree(mx_art, art)
    with lct.open(art) as a:
        state = art / a.manifest.maximus["file"]
    data = bytearray(state.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) // 3]
    state.write_bytes(bytes(data))
    rep = lct.verify(art)
    assert not rep.ok and any(str(state) in f for f in rep.failures)
    assert lct.verify(mx_art).ok


@pytest.mark.parametrize("key,value,msg", [
    ("tensors", [["model.embed_tokens.weight"]], "not a frequency-ordered"),
    ("prefix", ["maximus."], "maximus.prefix"),
    ("prefix", "../x.", "maximus.prefix"),
    ("frequency_source", [], "frequency_source"),
])
def test_maximus_entry_of_wrong_types_is_a_manifest_error(mx_art, tmp_path, key, value, msg):
    """Found by the mutation sweep: a list where a name or the prefix belongs raised TypeError."""
    import shutil
    bad = tmp_path / "bad.lct"
    shutil.copytree(mx_art, bad)
    manifest = json.loads((bad / "lct.json").read_text())
    manifest["maximus"][key] = value
    (bad / "lct.json").write_text(manifest_text(manifest))
    with pytest.raises(ManifestError, match=msg):
        lct.open(bad)


def test_a_saved_maximus_state_beside_the_weights_is_not_converted_as_weights(llama_src,
                                                                              tmp_path):
    """README's recipe writes maximus.safetensors next to save_pretrained's files: convert took
    its tensors as weights (group 'misc', and export wrote them into model.safetensors)."""
    import shutil

    from lct.kernels import MaximusEmbedding, save_maximus_state
    from lct.kernels.maximus import MaximusPolicy
    src = tmp_path / "ckpt"
    shutil.copytree(llama_src, src)
    model = lct.load(lct.convert(str(llama_src), tmp_path / "a.lct", policy=Policy(nf4=())).path)
    emb = model.get_input_embeddings()
    model.set_input_embeddings(MaximusEmbedding(V, emb.embedding_dim,
                                                policy=MaximusPolicy(num_shards=4),
                                                weight=emb.weight.detach()))
    save_maximus_state(model, src)
    assert (src / "maximus.safetensors").is_file()
    rep = lct.convert(str(src), tmp_path / "b.lct", policy=Policy(nf4=()))
    assert rep.unmapped == [] and not any(n.startswith("maximus.") for n in rep.manifest.tensors)


def test_frequencies_without_shards_are_refused(llama_src, counts, tmp_path):
    """lct.convert(token_freq=...) without maximus_shards ignored the frequencies."""
    with pytest.raises(PolicyError, match="give maximus_shards too") as e:
        lct.convert(str(llama_src), tmp_path / "a.lct", token_freq=str(counts[1]))
    assert e.value.option == "token_freq"


def test_loaded_maximus_table_trains_and_bad_budgets_are_refused(mx_art):
    """lct.load(maximus=True) left a dense table frozen (requires_grad False) while every other
    weight could train; a budget of 0 crashed the CLI's report with a traceback; --layerwise
    ignored --maximus silently."""
    from lct.cli.main import cli
    model = lct.load(mx_art, maximus=True, nf4="dequantize")
    emb = model.get_input_embeddings()
    assert emb.weight.requires_grad
    model(torch.tensor([[1, 5, 9]])).logits.sum().backward()
    assert emb.weight.grad is not None
    run = CliRunner().invoke
    for args, want in ((["--maximus", "0"], "at least 1"),
                       (["--maximus", "2", "--layerwise"], "does not go with --layerwise")):
        res = run(cli, ["load", str(mx_art), "--ids", "1,2,3", *args], catch_exceptions=False)
        assert res.exit_code == 2 and want in res.output and "Traceback" not in res.output, \
            res.output


def test_plan_of_an_artifact_with_shards_prices_its_own_shards(mx_art):
    """The 'would save' line priced the default 8/32 whatever shards the artifact stores."""
    from lct.cli.main import cli
    from lct.plan.memory import plan
    p = plan(str(mx_art))
    assert p.maximus is None and p.maximus_priced == (1, 5)       # a quarter of 5, at least 1
    res = CliRunner().invoke(cli, ["plan", str(mx_art)], catch_exceptions=False)
    assert res.exit_code == 0 and "Maximus 1/5 (1 of 5 embedding shards" in res.output, \
        res.output


def test_load_json_reports_maximus_residency(mx_art):
    import json as _json

    from lct.cli.main import cli
    res = CliRunner().invoke(cli, ["load", str(mx_art), "--maximus", "2", "--ids", "1,2,3",
                                   "--max-new-tokens", "2", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    mx = _json.loads(res.output[res.output.index("{"):])["maximus"]
    assert mx["num_shards"] == 5 and 1 <= mx["resident_shards"] <= 2 and mx["lookups"] > 0
