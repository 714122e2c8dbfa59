"""Loading with a device map (issue 15): accelerate's forms, "disk" modules left in the
artifact (not read at load, fetched when they run), and pipeline stages that read only their
own layers' chunks."""

import pytest
import torch

import lct
from lct.conversion.converter import Policy
from lct.errors import LCTError
from lct.io.reader import Artifact
from lct.loader import LoadStats

IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    from lct.demo import tiny
    d = tmp_path_factory.mktemp("dmap")
    src = tiny.save_tiny(d / "src", "llama", num_hidden_layers=4)
    out = d / "a.lct"
    lct.convert(str(src), out, policy=Policy(nf4=()))
    return out


@pytest.fixture(scope="module")
def want(art):
    with torch.no_grad():
        return lct.load(art, dtype=torch.float32)(IDS).logits


def _reads(monkeypatch) -> list:
    """The groups whose chunks are read (recorded as they are)."""
    seen = []
    real = Artifact.read_stored

    def spy(self, chunk, **kw):
        seen.append(chunk.group)
        return real(self, chunk, **kw)
    monkeypatch.setattr(Artifact, "read_stored", spy)
    return seen


def _stage(first: int, last: int, layers: int = 4) -> dict:
    dmap = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
            "lm_head": "cpu"}
    dmap.update({f"model.layers.{i}": "cpu" if first <= i <= last else "disk"
                 for i in range(layers)})
    return dmap


def test_a_pipeline_stage_reads_only_its_layers_and_runs_the_others_from_the_artifact(
        art, want, monkeypatch):
    seen = _reads(monkeypatch)
    stats = LoadStats()
    model = lct.load(art, device_map=_stage(1, 2), dtype=torch.float32, stats=stats)
    at_load = set(seen)
    assert at_load == {"embed", "layers.1", "layers.2", "norm", "head"}, at_load
    m = lct.open(art).manifest
    assert stats.bytes_read == sum(c.stored_size for c in m.chunks if c.group in at_load)
    assert f"{len(at_load)} of {len(m.groups)} groups read at load" in " ".join(stats.notes)
    seen.clear()
    with torch.no_grad():
        got = model(IDS).logits
    assert torch.equal(got, want)
    assert {"layers.0", "layers.3"} <= set(seen)   # the disk layers came from the artifact


def test_auto_with_max_memory_offloads_to_disk_and_keeps_the_answers(art, want, monkeypatch):
    seen = _reads(monkeypatch)
    stats = LoadStats()
    model = lct.load(art, device_map="auto", max_memory={"cpu": 2_500_000},
                     dtype=torch.float32, stats=stats)
    placed = set(model.hf_device_map.values())
    assert placed == {"cpu", "disk"}, model.hf_device_map
    from lct.loader.device_map import device_of
    m = lct.open(art).manifest
    disk_groups = {t.group for t in m.tensors.values()
                   if device_of(t.name, model.hf_device_map) == "disk"}
    assert disk_groups and not disk_groups & set(seen), (disk_groups, seen)  # none read at load
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


@pytest.mark.parametrize("dmap", [{"": "cpu"}, "cpu", torch.device("cpu")])
def test_one_device_loads_everything_there(art, want, dmap):
    """The whole model on one device, in each of from_pretrained's spellings (a new user's
    "cpu" was refused as not one of the automatic maps)."""
    model = lct.load(art, device_map=dmap, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


def test_bad_maps_are_refused_clearly(art):
    with pytest.raises(LCTError, match="device_map 'everywhere'"):
        lct.load(art, device_map="everywhere")
    with pytest.raises(LCTError, match="places no module above parameter 'lm_head.weight'"):
        lct.load(art, device_map={"model": "cpu"})
    with pytest.raises(LCTError, match="does not go with"):
        lct.load(art, device_map="auto", tp_plan="auto")
    # a module the model does not have (it was accepted and copied into hf_device_map)
    with pytest.raises(LCTError, match="names 'model.layerz', which is not a module"):
        lct.load(art, device_map={"model.layerz": "cpu", "": "cpu"})
    with pytest.raises(LCTError, match=r"device_map\['lm_head'\]: device 'gpu' is not"):
        lct.load(art, device_map={"": "cpu", "lm_head": "gpu"})
    if not torch.cuda.is_available():
        with pytest.raises(LCTError, match="has no CUDA device"):
            lct.load(art, device_map={"": "cuda"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(device_map="auto", max_memory="8GiB"), "max_memory must be a dict"),
    (dict(device_map="auto", max_memory={"cpu": [1]}), r"max_memory\['cpu'\] = \[1\]"),
    (dict(device_map="auto", max_memory={"cpu": "lots"}), "needs a number with a unit"),
    (dict(device_map="auto", max_memory={"cpu": -5}), "must not be negative"),
    (dict(device_map="auto", max_memory={"gpu": "1GB"}), "device 'gpu' is not"),
    (dict(device_map="auto", max_memory={"disk": "1GB"}), "names no device"),
    (dict(max_memory={"cpu": "1GB"}), "pass device_map too"),
    (dict(device_map={"": "cpu"}, max_memory={"cpu": "1GB"}), "explicit map"),
    (dict(device_map="auto", device="cuda"), "both given"),
])
def test_bad_budgets_and_devices_are_refused_clearly(art, kwargs, match):
    """Each ends in an LCTError naming the option (raw TypeError, RuntimeError and
    accelerate's own errors before, or silently ignored)."""
    with pytest.raises(LCTError, match=match) as e:
        lct.load(art, **kwargs)
    assert e.value.option in ("max_memory", "device_map", "device")


def test_a_disk_entry_in_max_memory_is_the_artifact(art, want):
    """{"cpu": ..., "disk": ...}: disk is the artifact (no budget), the rest as accelerate."""
    model = lct.load(art, device_map="auto", max_memory={"cpu": 2_500_000, "disk": "1GB"},
                     dtype=torch.float32)
    assert "disk" in set(model.hf_device_map.values())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


def test_disk_modules_run_in_the_stored_dtype_with_a_lossy_head(tmp_path):
    """The default dtype (the stored bf16) with the default policy (a lossy table): a layer
    and the head left on disk run in bf16 like the rest, generate works, and the answers
    equal a plain load with the tables dequantized (before, the disk modules were float32 and
    the first bf16 module after them failed: 'expected m1 and m2 to have the same dtype')."""
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "llama", num_hidden_layers=3)
    a = tmp_path / "lossy.lct"
    lct.convert(str(src), a)
    assert lct.open(a).manifest.policy["nf4"] or lct.open(a).manifest.policy["int8"]
    dmap = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
            "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
            "lm_head": "disk"}
    model = lct.load(a, device_map=dmap)
    plain = lct.load(a, nf4="dequantize")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, plain(IDS).logits)
    got = model.generate(IDS, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, plain.generate(IDS, max_new_tokens=4, do_sample=False))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied Gemma (the head is the embedding's table) and its lossless artifact."""
    from lct.demo import tiny
    d = tmp_path_factory.mktemp("tied")
    src = tiny.save_tiny(d / "src", "gemma")
    lct.convert(str(src), d / "g.lct", policy=Policy(nf4=()))
    return src, d / "g.lct"


@pytest.mark.parametrize("head", ["cpu", "disk"])
def test_a_tied_embedding_on_disk_loads(tied, head):
    """The tied embedding left on disk failed with 'no tensor for lm_head.weight'. A head on
    disk too fetches the table when it runs, with from_pretrained's logits for the same map; a
    head on the CPU reads the table at load (from_pretrained refuses that map: 'weight is on
    the meta device'). Both answer as the whole model does."""
    from transformers import AutoModelForCausalLM
    src, art = tied
    with torch.no_grad():
        want = lct.load(art, dtype=torch.float32)(IDS).logits
    dmap = {"model.embed_tokens": "disk", "model.layers": "cpu", "model.norm": "cpu",
            "model.rotary_emb": "cpu", "lm_head": head}
    model = lct.load(art, device_map=dmap, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)
    if head == "disk":
        ref = AutoModelForCausalLM.from_pretrained(src, device_map=dmap, dtype=torch.float32,
                                                   offload_folder=str(art.parent / "off"))
        with torch.no_grad():
            assert torch.equal(ref(IDS).logits, want)


def test_auto_with_a_small_budget_on_a_tied_model(tied):
    """device_map='auto' with max_memory too small for the whole model: the tied table goes
    to disk with its head, the load gives from_pretrained's answers, and accelerate sees a
    tied skeleton (no 'weights are not tied' warning)."""
    import logging
    src, art = tied
    with torch.no_grad():
        want = lct.load(art, dtype=torch.float32)(IDS).logits
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("accelerate").addHandler(handler)
    try:
        model = lct.load(art, device_map="auto", max_memory={"cpu": 400_000},
                         dtype=torch.float32)
    finally:
        logging.getLogger("accelerate").removeHandler(handler)
    assert "disk" in set(model.hf_device_map.values()), model.hf_device_map
    assert not [r for r in records if "not tied" in r.getMessage()]
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


@pytest.mark.parametrize("how", ["disk", "auto"])
def test_a_map_larger_than_its_budget_generates_the_layerwise_models_tokens(art, how):
    """Issue 38.3: layers left on disk, by an explicit map or by device_map='auto' with a
    max_memory below the model's size (accelerate puts the overflow on disk), generate the
    layer-wise model's tokens, in the stored dtype as both run by default."""
    from lct.loader import LayerwiseModel
    size = sum(c.decoded_size for c in lct.open(art).manifest.chunks)
    with LayerwiseModel(art, cache=False) as lw:
        want = lw.generate(IDS, max_new_tokens=5, do_sample=False)
    if how == "disk":
        model = lct.load(art, device_map=_stage(0, -1))          # every layer on disk
    else:
        model = lct.load(art, device_map="auto", max_memory={"cpu": size // 2})
    assert "disk" in set(model.hf_device_map.values()), model.hf_device_map
    assert torch.equal(model.generate(IDS, max_new_tokens=5, do_sample=False), want)
