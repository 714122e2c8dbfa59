"""MaximusEmbedding: exact forward/backward vs nn.Embedding, residency under a hard budget,
reproducible decisions, NF4 shards, and save -> restore -> continue training."""

import copy

import pytest
import torch

from lct.errors import MaximusStateError
from lct.kernels import MaximusEmbedding
from lct.kernels.maximus import MaximusPolicy, load_maximus_state, save_maximus_state

V, H = 1000, 16


def zipf_ids(n, gen, s=1.1, vocab=V):
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    p = ranks ** -s
    return torch.multinomial(p / p.sum(), n, replacement=True, generator=gen)


def _counts(gen):
    return torch.bincount(zipf_ids(50_000, gen), minlength=V)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("bucket", [1, 3])
@pytest.mark.parametrize("dist", ["zipf", "uniform"])
def test_forward_backward_equal_nn_embedding(gen, sparse, bucket, dist):
    ref = torch.nn.Embedding(V, H, padding_idx=0)
    with torch.no_grad():
        ref.weight[0].normal_()  # a non-zero pad row: pads must still yield zeros
    perm_counts = _counts(gen)
    m = MaximusEmbedding(V, H, padding_idx=0, policy=MaximusPolicy(
        num_shards=8, budget_shards=2, bucket_size=bucket, sparse=sparse),
        weight=ref.weight.detach(), counts=perm_counts)
    for step in range(6):
        ids = zipf_ids(120, gen).view(4, 30) if dist == "zipf" else \
            torch.randint(0, V, (4, 30), generator=gen)
        ids[0, :5] = 0
        ids[1, :3] = ids[1, 5]  # repeats
        expected = ref(ids)
        expected[ids == 0] = 0  # padding-aware: pads yield zeros
        out = m(ids)
        assert torch.equal(out, expected)
        w = torch.randn(H, generator=gen)
        (ref(ids) * w).sum().backward()
        (out * w).sum().backward()
        if (step + 1) % bucket:
            assert m.weight.grad is None  # still in the bucket
            continue
        # A bucket was applied: it equals nn.Embedding's gradient summed over the same steps.
        assert m.weight.grad.is_sparse == sparse
        grad = m.weight.grad.to_dense() if sparse else m.weight.grad
        by_id = grad[m.id_to_row]
        assert torch.equal(by_id[1:], ref.weight.grad[1:])
        assert torch.equal(by_id[0], torch.zeros(H))  # pad: zero gradient
        ref.weight.grad = None
        m.weight.grad = None


def test_bucket_delays_gradients(gen):
    m = MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=4, bucket_size=3),
                         counts=_counts(gen))
    for i in range(3):
        m(torch.randint(0, V, (10,), generator=gen)).sum().backward()
        assert (m.weight.grad is None) == (i < 2)


def test_budget_never_exceeded_and_batch_shards_kept(gen):
    m = MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=16, budget_shards=4,
                                                    load_rate=0.3, evict_rate=0.05),
                         counts=_counts(gen))
    worst = 0
    for step in range(200):
        shift = (step // 50) * 250  # the hot set moves: loads and evictions must happen
        ids = (zipf_ids(64, gen) + shift) % V
        before = set(m.resident)
        with torch.no_grad():
            m(ids)
        worst = max(worst, len(m.resident))
        needed = set(m.shard_of_rows(m.id_to_row[ids]).tolist())
        assert not (before & needed) - set(m.resident), "a shard the batch needed was evicted"
    assert worst <= 4
    assert m.stats.shard_loads > 4 and m.stats.shard_evictions > 0
    assert m.stats.lookups == 200 * 64 == m.stats.hits + m.stats.misses


def test_residency_reproducible(gen):
    counts = _counts(gen)
    stream = [zipf_ids(50, gen) for _ in range(60)]
    runs = []
    for _ in range(2):
        m = MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=10, budget_shards=3),
                             counts=counts)
        trace = []
        with torch.no_grad():
            for ids in stream:
                m(ids)
                trace.append(tuple(sorted(m.resident)))
        runs.append((trace, m.stats.as_list()))
    assert runs[0] == runs[1]


def test_zipf_hot_shards_hit(gen):
    m = MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=8, budget_shards=2),
                         counts=_counts(gen))
    with torch.no_grad():
        for _ in range(50):
            m(zipf_ids(256, gen))
    assert m.stats.hit_rate > 0.7  # 25% of the shards hold most lookups


def test_nf4_shards_equal_gather_then_dequantize(gen):
    from lct.format import nf4
    w = (torch.randn(V, 64, generator=gen) * 0.02).to(torch.bfloat16)
    packed, absmax = nf4.quantize(w, 64)
    full = nf4.dequantize(packed, absmax, (V, 64), 64, torch.bfloat16)
    m = MaximusEmbedding(V, 64, policy=MaximusPolicy(num_shards=6, budget_shards=2),
                         nf4=(packed, absmax, 64), counts=_counts(gen), dtype=torch.bfloat16,
                         pad_ids=(5,))
    for _ in range(3):
        ids = zipf_ids(90, gen).view(3, 30)
        ids[0, 0] = 5
        expected = full[ids]
        expected[ids == 5] = 0
        assert torch.equal(m(ids), expected)


def test_nf4_state_with_another_order_moves_the_rows(gen):
    """Restoring a state whose frequency order differs re-orders an NF4 table too: the
    vocabulary (id -> row values) is never scrambled."""
    from lct.format import nf4
    w = (torch.randn(V, 64, generator=gen) * 0.02).to(torch.bfloat16)
    packed, absmax = nf4.quantize(w, 64)
    full = nf4.dequantize(packed, absmax, (V, 64), 64, torch.bfloat16)
    m = MaximusEmbedding(V, 64, policy=MaximusPolicy(num_shards=5), nf4=(packed, absmax, 64),
                         counts=_counts(gen), dtype=torch.bfloat16)
    other = MaximusEmbedding(V, 64, policy=MaximusPolicy(num_shards=5), nf4=(packed, absmax, 64),
                             counts=_counts(torch.Generator().manual_seed(7)),
                             dtype=torch.bfloat16)
    assert not torch.equal(m.row_to_id, other.row_to_id)
    m.load_state_tensors(other.state_tensors())
    assert torch.equal(m.row_to_id, other.row_to_id)
    assert torch.equal(m.id_ordered_weight(), full)
    ids = zipf_ids(60, gen).view(2, 30)
    assert torch.equal(m(ids), full[ids])


def test_state_dict_is_id_ordered(gen):
    ref = torch.nn.Embedding(V, H)
    m = MaximusEmbedding(V, H, weight=ref.weight.detach(), counts=_counts(gen))
    assert not torch.equal(m.weight.detach(), ref.weight.detach())  # stored by frequency
    sd = m.state_dict()
    assert list(sd) == ["weight"] and torch.equal(sd["weight"], ref.weight.detach())
    m2 = MaximusEmbedding(V, H, counts=_counts(torch.Generator().manual_seed(9)))
    m2.load_state_dict(sd)
    assert torch.equal(m2.id_ordered_weight(), ref.weight.detach())


def _tiny_model(seed=0):
    from lct.demo import tiny
    config = tiny.config_for("llama", vocab_size=V, tie_word_embeddings=False)
    return tiny.build_model(config, seed=seed, dtype=torch.float32).train()


def _install(model, counts, sparse=True, bucket=1):
    old = model.model.embed_tokens
    model.model.embed_tokens = MaximusEmbedding(
        V, old.embedding_dim, padding_idx=0, counts=counts, weight=old.weight.detach(),
        policy=MaximusPolicy(num_shards=8, budget_shards=2, sparse=sparse, bucket_size=bucket))
    return model


def _optimizers(model, kind):
    emb = model.model.embed_tokens.weight
    rest = [p for n, p in model.named_parameters() if p is not emb]
    first = torch.optim.SparseAdam([emb], lr=1e-3) if kind == "sparseadam" else \
        torch.optim.SGD([emb], lr=0.1)
    return [first, torch.optim.SGD(rest, lr=0.05)]


def _train(model, opts, batches):
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        model.model.embed_tokens.flush_gradients()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("kind", ["sgd", pytest.param("sparseadam", marks=pytest.mark.slow)])
def test_save_restore_continue_equals_uninterrupted(gen, tmp_path, kind):
    counts = _counts(gen)
    batches = [zipf_ids(32, gen).view(2, 16) for _ in range(8)]
    a = _install(_tiny_model(), counts)
    opts_a = _optimizers(a, kind)
    losses_a = _train(a, opts_a, batches)

    b = _install(_tiny_model(), counts)
    opts_b = _optimizers(b, kind)
    assert _train(b, opts_b, batches[:4]) == losses_a[:4]
    b.save_pretrained(tmp_path / "ckpt")
    save_maximus_state(b, tmp_path / "ckpt")
    opt_states = [copy.deepcopy(o.state_dict()) for o in opts_b]
    del b, opts_b

    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")  # a plain, unscrambled model
    c = _install(_tiny_model(seed=1), counts=torch.zeros(V, dtype=torch.int64))
    c.load_state_dict(plain.state_dict())
    load_maximus_state(c, tmp_path / "ckpt")
    opts_c = _optimizers(c, kind)
    for o, st in zip(opts_c, opt_states):
        o.load_state_dict(st)
    assert _train(c.train(), opts_c, batches[4:]) == losses_a[4:]  # step for step

    for (na, pa), (nc, pc) in zip(a.named_parameters(), c.named_parameters()):
        assert na == nc and torch.equal(pa, pc), na
    ea, ec = a.model.embed_tokens, c.model.embed_tokens
    assert sorted(ea.resident) == sorted(ec.resident)
    assert torch.equal(ea.shard_score, ec.shard_score)
    assert ea.stats.as_list() == ec.stats.as_list()


def test_bad_state_files(gen, tmp_path):
    m = MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=8), counts=_counts(gen))
    path = save_maximus_state(m, tmp_path / "s")
    other = MaximusEmbedding(V, H, policy=MaximusPolicy(num_shards=4))
    with pytest.raises(MaximusStateError, match="num_shards"):
        load_maximus_state(other, path)
    with pytest.raises(MaximusStateError, match="no Maximus state"):
        load_maximus_state(m, tmp_path / "none")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes()[:100])
    with pytest.raises(MaximusStateError, match="not a readable"):
        load_maximus_state(m, bad)
    from safetensors.torch import load_file, save_file
    t = load_file(path)
    t["maximus.row_to_id"][[0, 1]] = t["maximus.row_to_id"][[1, 1]]  # not a permutation
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    save_file(t, str(tmp_path / "perm.safetensors"), metadata=meta)
    before = m.id_ordered_weight().clone()
    with pytest.raises(MaximusStateError, match="permutation"):
        load_maximus_state(m, tmp_path / "perm.safetensors")
    t = load_file(path)
    t["maximus.pad_ids"] = torch.tensor([V + 3], dtype=t["maximus.pad_ids"].dtype)
    save_file(t, str(tmp_path / "pads.safetensors"), metadata=meta)
    with pytest.raises(MaximusStateError, match="pad_ids must be token ids"):
        load_maximus_state(m, tmp_path / "pads.safetensors")
    assert torch.equal(m.id_ordered_weight(), before)  # nothing changed


def test_policy_is_frozen_checked_and_round_trips_through_the_state_file(gen, tmp_path):
    import dataclasses
    import json

    from safetensors import safe_open

    from lct.errors import OptionError
    from lct.format import constants as C
    policy = MaximusPolicy()
    assert (policy.num_shards, policy.budget_shards) == (C.DEFAULT_MAXIMUS_SHARDS, None)
    assert {k: getattr(policy, k) for k in C.DEFAULT_MAXIMUS_POLICY} == C.DEFAULT_MAXIMUS_POLICY
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.bucket_size = 4
    for option, bad in (("num_shards", 0), ("budget_shards", -1), ("budget_bytes", -1),
                        ("bucket_size", 0), ("bucket_size", True), ("decay", 1.5),
                        ("load_rate", float("nan")), ("evict_rate", 0.5), ("sparse", "yes")):
        with pytest.raises(OptionError) as e:
            MaximusPolicy(**{option: bad})
        assert e.value.option == option, (option, bad)
    with pytest.raises(OptionError) as e:                    # replace() checks again
        dataclasses.replace(policy, evict_rate=0.9)
    assert e.value.option == "evict_rate"

    # The module keeps the policy in effect: N capped by the rows, the budget in shards.
    asked = MaximusPolicy(num_shards=8, budget_bytes=3 * 125 * H * 4, bucket_size=2,
                          load_rate=0.4, evict_rate=0.1, decay=0.8, sparse=False)
    m = MaximusEmbedding(V, H, policy=asked, counts=_counts(gen))
    assert m.policy == dataclasses.replace(asked, budget_bytes=None, budget_shards=3)
    assert (m.num_shards, m.budget_shards) == (8, 3)
    assert MaximusEmbedding(5, H, policy=MaximusPolicy(num_shards=8)).policy.num_shards == 5
    with pytest.raises(OptionError, match="budget_bytes"):
        asked.to_metadata()                                 # not in the file: resolve it first
    path = save_maximus_state(m, tmp_path / "s")
    with safe_open(str(path), "pt") as f:
        saved = json.loads(f.metadata()["modules"])[""]["policy"]
    assert list(saved) == ["num_embeddings", "embedding_dim", "num_shards", "budget_shards",
                           "bucket_size", "load_rate", "evict_rate", "decay", "sparse",
                           "padding_idx"]
    assert MaximusPolicy.from_metadata(saved) == m.policy
    assert m.policy.to_metadata() == {k: saved[k] for k in m.policy.to_metadata()}
    assert MaximusPolicy.from_metadata({"num_shards": 8}) == MaximusPolicy(num_shards=8)
    with pytest.raises(MaximusStateError, match="s.safetensors: policy decay"):
        MaximusPolicy.from_metadata(dict(saved, decay=-1), where="s.safetensors")


def test_the_old_keywords_keep_working_for_a_release_with_a_deprecation_warning():
    """Issue 37: MaximusEmbedding(max_shards=...) became policy=MaximusPolicy(num_shards=...);
    the old keywords still build the same module, warning, and mixing both or an unknown
    keyword is an OptionError naming it."""
    import warnings

    from lct.errors import OptionError
    from lct.format.maximus import MaximusPolicy
    from lct.kernels.maximus import MaximusEmbedding
    with pytest.warns(DeprecationWarning, match=r"policy=MaximusPolicy\(num_shards=4, "
                                                 r"bucket_size=2\)"):
        old = MaximusEmbedding(64, 8, max_shards=4, bucket_size=2)
    new = MaximusEmbedding(64, 8, policy=MaximusPolicy(num_shards=4, bucket_size=2))
    assert old.policy == new.policy and old.num_shards == 4 and old.policy.bucket_size == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MaximusEmbedding(64, 8, policy=MaximusPolicy(num_shards=4))     # no warning
    with pytest.raises(OptionError, match="not both"):
        MaximusEmbedding(64, 8, policy=MaximusPolicy(), max_shards=4)
    with pytest.raises(OptionError, match="takes no keyword 'max_shard'"):
        MaximusEmbedding(64, 8, max_shard=4)
