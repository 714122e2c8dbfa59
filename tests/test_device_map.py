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

    def spy(self, chunk):
        seen.append(chunk.group)
        return real(self, chunk)
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


def test_one_device_loads_everything_there(art, want):
    model = lct.load(art, device_map={"": "cpu"}, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, want)


def test_bad_maps_are_refused_clearly(art):
    with pytest.raises(LCTError, match="device_map 'everywhere'"):
        lct.load(art, device_map="everywhere")
    with pytest.raises(LCTError, match="places no module above parameter 'lm_head.weight'"):
        lct.load(art, device_map={"model": "cpu"})
    with pytest.raises(LCTError, match="does not go with"):
        lct.load(art, device_map="auto", tp_plan="auto")
