"""A new encoding is one class (issue 37, "one home for each encoding"): adding int8_b128 touched 16
library files. Here a toy lossy table encoding is defined and registered in this module alone,
through the registries' public hooks (``lct.format.encodings.register``,
``lct.kernels.register_kernels``), and with no library file edited for it, it converts (forced
by its ``Policy`` keyword and its ``lct convert`` option, and measured by the auto policy),
loads (kept in its kernels' modules, or dequantized where no kernels are registered),
verifies, plans (its keyword, its ``lct plan`` option, an artifact's policy) and appears in
``--help`` of ``lct convert`` and ``lct plan``; taken back, it is gone from all of them."""

import json

import pytest
import torch
from click.testing import CliRunner

import lct
from lct.cli.main import cli
from lct.conversion.converter import Policy
from lct.errors import OptionError, PlanError
from lct.format.encodings import (BlockEncoding, BlocksWeight, get_encoding, lossy_encodings,
                                  register, unregister)
from lct.kernels import register_kernels, unregister_kernels
from lct.kernels.blocks import BlocksEmbedding, BlocksLinear
from lct.plan.memory import plan

TOY = "toy8"
BLOCK, BLOCK_BYTES = 16, 4 + 16     # a float32 scale, then 16 int8 codes


class _ToyCodec:
    """int8 codes with one float32 scale (absmax / 127) per 16 values of a row, rounded half to
    even: a block is the scale's 4 bytes, then the codes."""

    @staticmethod
    def quantize(t, where=None):
        rows = t.shape[0]
        x = t.float().reshape(-1, BLOCK)
        d = x.abs().amax(1, keepdim=True) / 127
        q = torch.round(x / torch.where(d > 0, d, 1)).clamp(-127, 127).to(torch.int8)
        return torch.cat([d.contiguous().view(torch.uint8), q.view(torch.uint8)], 1) \
            .reshape(rows, -1)

    @staticmethod
    def dequantize(blocks, shape, dtype=torch.float32, out=None):
        b = blocks.reshape(-1, BLOCK_BYTES)
        d = b[:, :4].contiguous().view(torch.float32)
        x = (b[:, 4:].contiguous().view(torch.int8).float() * d).reshape(shape).to(dtype)
        return x if out is None else out.view(shape).copy_(x)


class ToyWeight(BlocksWeight):
    encoding = TOY


class Toy8(BlockEncoding):
    """The toy: rows of self-contained blocks, as llama.cpp's are."""

    name = TOY
    label = "Toy8"
    summary = "Toy8 (a float32 scale per 16 values)"
    described = "Toy8 (the registry test's)"
    block, block_bytes, d_bytes = BLOCK, BLOCK_BYTES, slice(0, 4)
    weight_class = ToyWeight

    def codec(self):
        return _ToyCodec

    def scales(self, weight):
        rows = weight.shape[0]
        return weight.blocks.reshape(rows, -1, BLOCK_BYTES)[:, :, :4].contiguous() \
            .view(torch.float32).squeeze(-1)


class ToyEmbedding(BlocksEmbedding):
    encoding = TOY


class ToyLinear(BlocksLinear):
    encoding = TOY


def register_toy(kernels: bool = True) -> None:
    """Register the toy encoding, and its kernels unless ``kernels`` is False (also what each
    rank of a tensor-parallel world runs first: tests/tp_worker.py's TP_WORKER_SETUP)."""
    register(Toy8)
    if kernels:
        register_kernels(TOY, embedding=ToyEmbedding.from_weight, linear=ToyLinear.from_weight)


def register_toy_without_kernels() -> None:
    register_toy(kernels=False)


@pytest.fixture
def toy():
    """The toy registered (encoding and kernels) for one test, taken back after it."""
    register_toy()
    try:
        yield get_encoding(TOY)
    finally:
        unregister_kernels(TOY)
        unregister(TOY)


def _help(command):
    res = CliRunner().invoke(cli, [command, "--help"])
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.float()


@pytest.mark.parametrize("arch", ["gemma", "llama"])
def test_a_toy_encoding_in_one_module_converts_loads_verifies_and_plans(toy, arch, request,
                                                                          tmp_path):
    src = request.getfixturevalue(f"{arch}_src")
    assert TOY in lossy_encodings() and Policy(toy8=["head"]).lossy == {TOY: ("head",)}
    assert Policy(toy8=("embed",)).toy8 == ("embed",) and Policy().toy8 is None

    # converts: forced by its lct convert option
    art = tmp_path / "toy.lct"
    res = CliRunner().invoke(cli, ["convert", str(src), "-o", str(art), "--toy8", "embed,head",
                                   "-q"])
    assert res.exit_code == 0, res.output
    m = json.loads((art / "lct.json").read_text())
    assert m["policy"]["mode"] == "manual" and m["policy"][TOY] == ["embed", "head"]
    tables = {t["name"]: t for t in m["tensors"] if t["role"] in ("embed", "head")}
    assert tables and {t["encoding"] for t in tables.values()} == {TOY}
    res = CliRunner().invoke(cli, ["info", str(art)])     # its policy line, as every encoding's
    assert res.exit_code == 0 and " toy8=embed,head " in res.output, res.output
    with lct.open(art) as a:       # the stored bytes are the source quantized by the toy codec
        name = next(n for n, t in tables.items() if t["role"] == "embed")
        stored = a.read_tensor(name, dequantize=False)
        assert isinstance(stored, ToyWeight)
    from safetensors.torch import load_file
    table = load_file(src / "model.safetensors")[name]
    assert torch.equal(stored.blocks.reshape(-1), _ToyCodec.quantize(table).reshape(-1))

    # verifies: checksums, finite scales, and the source quantized again gives the stored bytes
    rep = lct.verify(art, against=str(src))
    assert rep.ok, rep.failures
    lossy = [t for t in rep.tensors if t.encoding == TOY]
    assert lossy and all(t.ok for t in lossy)
    assert CliRunner().invoke(cli, ["verify", str(art), "--against", str(src)]).exit_code == 0

    # loads: kept in the toy's kernels, with the answers of the same tables dequantized
    kept = lct.load(art)
    assert type(kept.get_input_embeddings()) is ToyEmbedding
    assert type(kept.get_output_embeddings()) is ToyLinear
    deq = lct.load(art, nf4="dequantize")
    assert isinstance(deq.get_input_embeddings(), torch.nn.Embedding)
    ids = [1, 5, 9, 2, 7]
    torch.testing.assert_close(_logits(kept, ids), _logits(deq, ids), rtol=2e-2, atol=2e-2)
    # an encoding no kernels are registered for loads dequantized, into the model's own module
    unregister_kernels(TOY)
    plain = lct.load(art)
    assert isinstance(plain.get_input_embeddings(), torch.nn.Embedding)
    assert torch.equal(_logits(plain, ids), _logits(deq, ids))

    # plans: its keyword, its lct plan option and the artifact's policy say the same bytes
    rows, cols = table.shape
    want = rows * cols // BLOCK * BLOCK_BYTES
    asked = {p.name: p for p in plan(src, format="lct", toy8=("embed", "head"), device="cpu")
             .parts}
    from_art = {p.name: p for p in plan(art, device="cpu").parts}
    assert want <= asked["embedding"].weights < want + 64
    assert asked["embedding"].weights == from_art["embedding"].weights
    res = CliRunner().invoke(cli, ["plan", str(src), "--format", "lct", "--toy8", "embed,head",
                                   "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    parts = {p["name"]: p for p in json.loads(res.output)["parts"]}
    assert parts["embedding"]["weights"] == asked["embedding"].weights
    with pytest.raises(PlanError, match="toy8"):     # an artifact's are its own
        plan(art, toy8=("head",))


def test_the_auto_policy_measures_a_registered_encoding(toy, llama_src, tmp_path):
    rep = lct.convert(str(llama_src), tmp_path / "auto.lct", policy=Policy(calibration="none"))
    costs = rep.decision.to_dict()["costs"]
    assert costs and all(TOY in by_encoding for by_encoding in costs.values()), costs


def test_help_lists_every_registered_encoding_in_registry_order(toy):
    for command in ("convert", "plan"):
        text = _help(command)
        flags = [f"--{e} PARTS" for e in lossy_encodings()]
        at = [text.find(f) for f in flags]
        assert all(i >= 0 for i in at) and at == sorted(at), (command, flags, at)
        assert "Toy8" in text
    for command in ("verify", "export", "load"):    # their texts name the lossy encodings
        listed = ", ".join(lossy_encodings())
        assert listed.endswith(TOY) and listed in _help(command), command
    unregister_kernels(TOY)
    unregister(TOY)
    for command in ("convert", "plan"):
        assert "--toy8" not in _help(command)
        assert "--q6_k PARTS" in _help(command)
    for command in ("verify", "export", "load"):
        assert TOY not in _help(command) and ", ".join(lossy_encodings()) in _help(command)
    assert TOY not in lossy_encodings()
    with pytest.raises(TypeError, match="toy8"):
        Policy(toy8=("head",))
    register(Toy8)      # for the fixture to take back


def test_the_registry_refuses_a_taken_or_unusable_name_and_keeps_the_formats_own(toy):
    with pytest.raises(OptionError, match="already registered"):
        register(Toy8)
    bad = type("Bad", (Toy8,), {"name": "no-dash"})
    with pytest.raises(OptionError, match="lowercase identifier"):
        register(bad)
    with pytest.raises(OptionError, match="the format's own"):
        unregister("q8_0")


@pytest.fixture(scope="module")
def qwen_tp_src(tmp_path_factory):
    """A tiny Qwen2 whose heads divide over 2 ranks (rows of 64 values: whole toy blocks)."""
    from lct.demo import tiny
    return tiny.save_tiny(tmp_path_factory.mktemp("toy-tp") / "qwen2", "qwen2",
                          num_attention_heads=8, num_key_value_heads=4)


@pytest.mark.slow       # each launch starts a world of 2 ranks that import torch
@pytest.mark.parametrize("pieces", [None, 2])
def test_a_toy_encoding_loads_under_tensor_parallelism(toy, qwen_tp_src, tmp_path, pieces):
    """Each rank keeps its rows of the toy tables in the toy's kernels (sliced from the whole
    table, or its own tensor-parallel pieces), with the logits of one process; where the toy
    has no kernels the ranks load its tables dequantized, as one process does."""
    import os
    from pathlib import Path

    from test_tensor_parallel import launch
    art = tmp_path / "toy.lct"
    lct.convert(str(qwen_tp_src), art, policy=Policy(toy8=("embed", "head"), tp_pieces=pieces))
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4]])
    with torch.no_grad():
        single = lct.load(art, dtype=torch.float32)(ids).logits[0, :3, :5]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    setups = {"keep": "register_toy"} if pieces is None else \
        {"keep": "register_toy", "no kernels": "register_toy_without_kernels"}
    for what, setup in setups.items():
        results = launch(2, art, qwen_tp_src, tmp_path / setup,
                         env=dict(env, TP_WORKER_SETUP=f"{__name__}:{setup}"))
        for r in results:
            assert "error" not in r, r
            assert 0 < r["max_diff"] < 0.5, r       # the source's logits, up to the toy's error
            kept = (r["embed"], r["head"]) == ("ShardedEmbedding", "GatheredHead")
            assert kept == (what == "keep"), r
            if kept:
                assert torch.allclose(torch.tensor(r["logits"]), single, atol=1e-5), r
