"""vLLM's ``--load-format lct`` (loader/vllm.py), run in vLLM's own environment (.ci/vllm): greedy
tokens of vLLM serving an artifact equal vLLM's default loader on the same weights as
safetensors, and a damaged chunk stops the engine with LCT's error.

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
PROMPTS = ["Hello world, the quick", "LCT converts a checkpoint", "the lazy dog"]

GENERATE = """
import json, sys
def main():
    from vllm import LLM, SamplingParams
    model, fmt, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=model, load_format=fmt, dtype="bfloat16", enforce_eager=True,
              max_model_len=256, distributed_executor_backend="uni", seed=0,
              model_loader_extra_config=extra)
    out = llm.generate(json.loads(sys.argv[4]), SamplingParams(temperature=0, max_tokens=16),
                       use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in out]))
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


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """``{name: folder}``: tiny Llama and Gemma (tied) sources, their lossless artifacts, the
    Llama's default artifact (lossy embedding/head) and its ``lct export``."""
    d = tmp_path_factory.mktemp("vllm-models")
    py = _main_python()
    build = ("import sys\nfrom lct.demo import tiny\n"
             "for arch, out in (('llama', sys.argv[1]), ('gemma', sys.argv[2])):\n"
             "    tiny.save_tiny(out, arch)\n    tiny.save_tokenizer(out, vocab_size=256)\n")
    steps = [[py, "-c", build, str(d / "llama"), str(d / "gemma")],
             [py, "-m", "lct", "convert", str(d / "llama"), "-o", str(d / "llama.lct"),
              "--nf4", "none", "-q"],
             [py, "-m", "lct", "convert", str(d / "gemma"), "-o", str(d / "gemma.lct"),
              "--nf4", "none", "-q"],
             [py, "-m", "lct", "convert", str(d / "llama"), "-o", str(d / "lossy.lct"), "-q"],
             [py, "-m", "lct", "export", str(d / "lossy.lct"), str(d / "lossy-export"), "-q"]]
    for args in steps:
        res = _run(args, timeout=600)
        assert res.returncode == 0, f"{args[2:]}:\n{res.stdout}\n{res.stderr}"
    return {p.name: p for p in d.iterdir()}


@pytest.fixture(scope="session")
def engine_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("vllm-cache")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(cache / "vllm"),
               TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TMPDIR=str(cache))
    env.pop("VLLM_PLUGINS", None)       # an allow-list would hide the entry point
    return env


def generate(env, model, load_format="auto", extra=None, multiprocess=False):
    """vLLM's greedy generation of ``PROMPTS`` in a fresh process (the engine in it, or with
    ``multiprocess`` in the engine core process vLLM spawns)."""
    env = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0")
    return _run([sys.executable, "-c", GENERATE, str(model), load_format,
                 json.dumps(extra or {}), json.dumps(PROMPTS)],
                env=env, timeout=ENGINE_TIMEOUT)


def tokens(res) -> list:
    assert res.returncode == 0, res.stderr[-4000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("TOKENS ")]
    assert line, res.stdout[-2000:]
    return json.loads(line[-1][len("TOKENS "):])


@pytest.fixture(scope="session")
def reference(models, engine_env):
    """``reference(name)``: the default loader's tokens on folder ``name``, computed once."""
    seen = {}

    def get(name):
        if name not in seen:
            seen[name] = tokens(generate(engine_env, models[name]))
        return seen[name]
    return get


@pytest.mark.parametrize("artifact,source", [
    ("llama.lct", "llama"),                 # lossless: the source itself
    ("gemma.lct", "gemma"),                 # tied embedding/head: the tied name is not fed
    ("lossy.lct", "lossy-export"),          # NF4/int8 tables: the values lct export writes
])
def test_lct_load_format_gives_the_default_loaders_tokens(models, engine_env, reference,
                                                          artifact, source):
    got = generate(engine_env, models[artifact], "lct", {"prefetch": 1})
    log = got.stdout + got.stderr                       # vLLM logs to stdout
    assert "Loading weights took" in log and "(LCT: " in log, log[-4000:]
    assert tokens(got) == reference(source)


def test_the_spawned_engine_core_registers_the_loader_itself(models, engine_env, reference):
    """vLLM's default: the engine core is another process, which finds the loader through the
    ``vllm.general_plugins`` entry point, not through the parent's registration."""
    got = generate(engine_env, models["llama.lct"], "lct", multiprocess=True)
    assert tokens(got) == reference("llama")


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
                                    "verify": True}
    assert loader_options({"prefetch": 0, "workers": 1, "verify": False})["prefetch"] == 0
    for bad, words in [({"prefech": 3}, "unknown option(s) 'prefech'"),
                       ({"prefetch": -1}, "prefetch must be an integer >= 0"),
                       ({"workers": 0}, "workers must be an integer >= 1"),
                       ({"verify": "yes"}, "verify must be true or false")]:
        with pytest.raises(OptionError) as e:
            loader_options(bad)
        assert words in str(e.value) and "\n" not in str(e.value)


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
