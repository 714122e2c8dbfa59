"""Models larger than memory (issue 38, items 3-5): a Llama-2-13B-shaped checkpoint (26.0 GB of
bf16) and a Mixtral-shaped one (hidden 4096, intermediate 14336, 8 experts, 2 per token, 9
layers: 26.6 GB), each built here shard by shard without ever holding the model (random bf16
weights, normal(0, 0.02), norms 1; the small trained tokenizer of ``lct.demo.tiny``, so that
convert calibrates), then, each in a fresh process, its peak RSS read from the kernel (the
process's ``VmHWM`` as it exits):

* AirLLM (``pip install airllm``) generating N tokens, layer by layer from the safetensors
  (run before the convert: it splits the checkpoint into per-layer files first; each shard here
  holds one module, so its split links them instead of copying, and the folder is deleted
  after; where AirLLM cannot run, the table says why);
* ``lct convert SRC -o ART`` (calibrated: a tokenizer is in the folder);
* ``lct verify ART --against SRC``;
* ``lct.load(ART, device_map="auto", max_memory={"cpu": --budget})`` generating N tokens: the
  layers past the budget stay on disk (accelerate's overflow), read when they run;
* ``LayerwiseModel(ART)`` generating N tokens.

The decoded cache is off in every LCT process (``cache=False``, ``LCT_CACHE=0``): it would
write another copy of the model. The table gives each phase's peak RSS, time, time per
generated token (after the first), whether the tokens equal the layer-wise model's, and for the
Mixtral shape the expert bytes read per generated token against all experts' (stored bytes;
``LayerwiseModel.expert_stats``, ``model.lct_expert_bytes``). Everything built is deleted unless
``--keep``. Disk: a shape needs its checkpoint and its artifact at once (about 1.65x the
checkpoint); ``--min-free`` (default 13 GB) is what must stay free: a shape that would leave less
is skipped and said so (checked before the build, before each shard and before the convert,
since other jobs write on the same disk), and ``--layers`` builds fewer layers of a shape where
the disk is short.

    python benchmarks/bench_size.py --out /work/bench_out/size --tokens 2 --wait-file /tmp/lct-quiet
    python benchmarks/bench_size.py --shapes mixtral --tokens 3
    python benchmarks/bench_size.py --layers llama2-13b=34,mixtral=7   # a disk short of 43 GB
    python benchmarks/bench_size.py --tiny                # the whole pipeline in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
GB = 1e9
# Llama-2-13B (config.json of meta-llama/Llama-2-13b-hf) and a Mixtral shape of 9 layers.
LLAMA2_13B = dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                  num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  architectures=["LlamaForCausalLM"])
MIXTRAL = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=9, num_attention_heads=32, num_key_value_heads=8,
               num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
               rope_theta=1e6, tie_word_embeddings=False, architectures=["MixtralForCausalLM"])
SHAPES = {"llama2-13b": LLAMA2_13B, "mixtral": MIXTRAL}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2)
PROMPT = "The quick brown fox jumps over the lazy dog because"
ARTIFACT_RATIO = 0.7        # artifact / checkpoint of random bf16 weights, rounded up (0.64)

# --------------------------------------------------------------------------------------------
# Building a checkpoint shard by shard


def checkpoint_tensors(config) -> dict:
    """``{checkpoint name: (shape, dtype)}`` of the model ``config`` builds, as
    ``save_pretrained`` names them (transformers' conversions reverted), from the model built
    on the meta device: no memory."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    sd = revert_weight_conversion(model, dict(model.state_dict()))
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}


def module_of(name: str) -> str:
    """The module a checkpoint tensor belongs to for sharding: a decoder layer, or the top
    module (embed_tokens, norm, lm_head)."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return ".".join(parts[:3])
    return ".".join(parts[:-1])


class DiskShort(Exception):
    """Writing on would leave less disk free than ``--min-free``."""


def room(path: Path, nbytes: float, min_free: float) -> None:
    """Raise ``DiskShort`` unless ``nbytes`` more leave ``min_free`` bytes free under ``path``
    (checked before each shard and before the convert: other jobs write on this disk too)."""
    free = shutil.disk_usage(path).free
    if free - nbytes < min_free:
        raise DiskShort(f"{nbytes / GB:.1f} GB more would leave {(free - nbytes) / GB:.1f} GB "
                        f"free, under the {min_free / GB:g} GB to keep (--min-free)")


def build(shape: dict, out: Path, seed: int = 0, min_free: float = 0.0) -> int:
    """Write a random checkpoint of ``shape`` into ``out``: config.json, one safetensors shard
    per module (a layer, the embedding, the norm, the head: AirLLM's split then links them),
    model.safetensors.index.json and the small trained tokenizer. One module in memory at a
    time; ``DiskShort`` before a shard that would leave less than ``min_free`` bytes free.
    Returns the checkpoint's bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from lct.demo import tiny
    kw = dict(shape)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    config.dtype = torch.bfloat16
    tensors = checkpoint_tensors(config)
    modules: dict = {}
    for name in tensors:
        modules.setdefault(module_of(name), []).append(name)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, (module, names) in enumerate(modules.items(), 1):
        shard = f"model-{i:05d}-of-{len(modules):05d}.safetensors"
        room(tmp, sum(2 * math.prod(tensors[n][0]) for n in names), min_free)
        part = {}
        for n in names:
            shp, dtype = tensors[n]
            t = torch.empty(shp, dtype=dtype)
            t.fill_(1.0) if "norm" in n else t.normal_(0.0, 0.02, generator=gen)
            part[n] = t
            weight_map[n] = shard
            total += t.numel() * t.element_size()
        save_file(part, str(tmp / shard), metadata={"format": "pt"})
        del part
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(tmp)
    tiny.save_tokenizer(tmp, vocab_size=512)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return total


def shape_bytes(shape: dict) -> int:
    """The checkpoint's bytes, from the meta model."""
    from transformers import AutoConfig
    kw = dict(shape)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    return sum(2 * math.prod(s) for s, _ in checkpoint_tensors(config).values())



# --------------------------------------------------------------------------------------------
# The phases, each a fresh process

CHILD = r'''
import json, os, sys, time
import torch
args = json.loads(sys.argv[1])
class Clock:
    """A transformers streamer: when the prompt and each new token arrive."""
    def __init__(self):
        self.t = []
    def put(self, value):
        self.t.append(time.perf_counter())
    def end(self):
        pass
ids = torch.tensor([args["ids"]])
out = {}
t0 = time.perf_counter()
'''

GEN = r'''
out["ready_s"] = time.perf_counter() - t0
clock = Clock()
t1 = time.perf_counter()
with torch.no_grad():
    tokens = model.generate(ids, max_new_tokens=args["tokens"], do_sample=False, streamer=clock,
                            min_new_tokens=args["tokens"])
gaps = [b - a for a, b in zip(clock.t[1:], clock.t[2:])]
out.update(tokens=tokens[0, ids.shape[1]:].tolist(), generate_s=time.perf_counter() - t1,
           first_token_s=clock.t[1] - t1 if len(clock.t) > 1 else None,
           per_token_s=sum(gaps) / len(gaps) if gaps else None)
print("RESULT " + json.dumps(out))
'''

LAYERWISE = CHILD + r'''
from lct.loader import LayerwiseModel
model = LayerwiseModel(args["art"], cache=False)
''' + GEN.replace('print("RESULT', 'out["experts"] = model.expert_stats\nprint("RESULT')

DEVICE_MAP = CHILD + r'''
import lct
model = lct.load(args["art"], device_map="auto", max_memory={"cpu": args["budget"]}, cache=False)
where = list(model.hf_device_map.values())
out["on_disk"] = f"{where.count('disk')} of {len(where)} modules on disk"
e = model.lct_expert_bytes
marks = []
model.register_forward_pre_hook(lambda m, a: marks.append((e.read, e.all)))
''' + GEN.replace('print("RESULT', 'marks.append((e.read, e.all))\n'
                  'out["experts"] = {"read": e.read, "all": e.all, "reads": e.reads, '
                  '"whole_reads": e.whole, "forwards": [[b[0] - a[0], b[1] - a[1]] '
                  'for a, b in zip(marks, marks[1:])]}\nprint("RESULT')

AIRLLM = CHILD + r'''
try:
    from airllm import AutoModel
except ImportError as e:
    print("SKIP airllm is not installed (pip install airllm): " + str(e)); sys.exit(0)
model = AutoModel.from_pretrained(args["src"], device="cpu", dtype=torch.bfloat16,
                                  prefetching=False)
''' + GEN


def wait_quiet(path: str | None) -> None:
    """Wait while ``path`` exists (another job is timing on this machine)."""
    if not path:
        return
    said = False
    while os.path.exists(path):
        if not said:
            print(f"  waiting while {path} exists ...", flush=True)
            said = True
        time.sleep(20)


# Runs a phase (``-m MODULE ARGS`` or ``-c CODE ARGS``) and prints its own peak RSS at exit:
# the ``VmHWM`` of the process's memory, which starts afresh at exec. (``wait4``'s
# ``ru_maxrss`` does not: Linux carries the parent's high-water mark across the fork and the
# exec, so every phase read at least this benchmark's own peak, 3.2 GB after a Mixtral build.)
PHASE = r"""
import atexit, runpy, sys
def _hwm():
    with open("/proc/self/status") as f:
        kb = [int(x.split()[1]) for x in f if x.startswith("VmHWM:")][0]
    print("HWM " + str(kb * 1024), flush=True)
atexit.register(_hwm)
how, what = sys.argv[1], sys.argv[2]
sys.argv = [what] + sys.argv[3:]
if how == "-m":
    runpy.run_module(what, run_name="__main__", alter_sys=True)
else:
    sys.argv[0] = "-c"
    exec(compile(what, "<phase>", "exec"), {"__name__": "__main__"})
"""


def run(argv: list, env: dict, wait_file: str | None) -> dict:
    """Run ``argv`` (``[PY, "-m" | "-c", ...]``) in a fresh process: its exit status, wall
    time, peak RSS (its ``VmHWM`` at exit, ``PHASE``; ``wait4``'s ``ru_maxrss``, an upper
    bound, where it died before saying), the ``RESULT`` JSON line it printed, or ``SKIP`` / the
    error's last line."""
    wait_quiet(wait_file)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([argv[0], "-c", PHASE, *argv[1:]], env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    row = {"rc": proc.returncode, "s": time.perf_counter() - t0,
           "peak_rss": usage.ru_maxrss * 1024, "peak_from": "ru_maxrss (an upper bound)"}
    for line in text.splitlines():
        if line.startswith("RESULT "):
            row.update(json.loads(line[7:]))
        elif line.startswith("SKIP "):
            row["skip"] = line[5:]
        elif line.startswith("HWM "):
            row["peak_rss"], row["peak_from"] = int(line[4:]), "VmHWM"
    if proc.returncode != 0:
        lines = [x for x in text.strip().splitlines() if x.strip() and not x.startswith("HWM ")]
        row["error"] = lines[-1][:300] if lines else f"exit {proc.returncode}"
    return row


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def bench_shape(name: str, shape: dict, out: Path, args, env: dict) -> dict:
    """Build, run every phase and delete one shape: ``{phase: row}``."""
    src, art = out / f"{name}-random", out / f"{name}-random.lct"
    rows: dict = {}
    need = shape_bytes(shape) * (1 + ARTIFACT_RATIO)
    free = free_bytes(out)
    if free - need < args.min_free * GB:
        rows["build"] = {"skip": f"needs about {need / GB:.1f} GB of disk (checkpoint and "
                                 f"artifact), {free / GB:.1f} GB free, {args.min_free:g} GB to "
                                 f"keep free: pass --layers or --min-free"}
        return rows
    try:
        wait_quiet(args.wait_file)
        print(f"{name}: building {shape_bytes(shape) / GB:.1f} GB ...", flush=True)
        t0 = time.perf_counter()
        size = build(shape, src, min_free=args.min_free * GB)
        rows["build"] = {"s": time.perf_counter() - t0, "bytes": size}
        from transformers import AutoTokenizer
        ids = AutoTokenizer.from_pretrained(src)(PROMPT)["input_ids"]
        child = {"src": str(src), "art": str(art), "ids": ids, "tokens": args.tokens,
                 "budget": args.budget}
        if not args.tiny or args.airllm:
            print(f"{name}: AirLLM ...", flush=True)
            rows["airllm"] = run([PY, "-c", AIRLLM, json.dumps(child)], env, args.wait_file)
            shutil.rmtree(src / "splitted_model", ignore_errors=True)
        room(out, size * ARTIFACT_RATIO, args.min_free * GB)
        print(f"{name}: convert ...", flush=True)
        rows["convert"] = run([PY, "-m", "lct.cli.main", "convert", str(src), "-o", str(art),
                               "--force", "--quiet"], env, args.wait_file)
        if rows["convert"]["rc"] != 0:
            return rows
        rows["convert"]["bytes"] = sum(f.stat().st_size for f in art.rglob("*") if f.is_file())
        print(f"{name}: verify --against ...", flush=True)
        rows["verify"] = run([PY, "-m", "lct.cli.main", "verify", str(art), "--against",
                              str(src), "--quiet"], env, args.wait_file)
        print(f"{name}: device map ...", flush=True)
        rows["device_map"] = run([PY, "-c", DEVICE_MAP, json.dumps(child)], env, args.wait_file)
        print(f"{name}: layer-wise ...", flush=True)
        rows["layerwise"] = run([PY, "-c", LAYERWISE, json.dumps(child)], env, args.wait_file)
    except DiskShort as e:
        rows["disk"] = {"skip": f"stopped: {e}"}
    finally:
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(art, ignore_errors=True)
            shutil.rmtree(src.with_name(src.name + ".tmp"), ignore_errors=True)
    return rows


# --------------------------------------------------------------------------------------------
# The report


def _gb(n) -> str:
    return f"{n / GB:.2f} GB" if n else "-"


def render(results: dict) -> str:
    """The Markdown table of every shape's phases."""
    lines = ["| shape | phase | peak RSS | time | time per token | tokens = layer-wise | "
             "expert bytes per token (read / all) | note |", "|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        want = rows.get("layerwise", {}).get("tokens")
        for phase in ("build", "airllm", "convert", "verify", "device_map", "layerwise",
                      "disk"):
            r = rows.get(phase)
            if r is None:
                continue
            note = r.get("skip") or r.get("error") or r.get("on_disk") or ""
            if phase == "build" and "bytes" in r:
                note = f"{r['bytes'] / GB:.1f} GB checkpoint"
            if phase == "convert" and "bytes" in r:
                note = f"{r['bytes'] / GB:.1f} GB artifact"
            same = "-"
            if r.get("tokens") is not None and want is not None:
                same = "yes" if r["tokens"] == want else f"no ({r['tokens']} vs {want})"
            experts = "-"
            e = r.get("experts")
            if e and e.get("all") and len(e.get("forwards", ())) > 1:
                per = e["forwards"][1:]             # one generated token each
                read = sum(f[0] for f in per) / len(per)
                all_ = sum(f[1] for f in per) / len(per)
                experts = f"{_gb(read)} / {_gb(all_)} ({read / all_:.0%})"
            per_token = f"{r['per_token_s']:.2f} s" if r.get("per_token_s") else "-"
            t = f"{r['s']:.1f} s" if "s" in r else "-"
            lines.append(f"| {name} | {phase} | {_gb(r.get('peak_rss'))} | {t} | {per_token} | "
                         f"{same} | {experts} | {note} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/work/bench_out/size"))
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--layers", default="", help="fewer layers of a shape: NAME=N[,NAME=N]")
    p.add_argument("--tokens", type=int, default=3, help="tokens each model generates")
    p.add_argument("--budget", default="4GiB", help="the device map's max_memory for the CPU")
    p.add_argument("--min-free", type=float, default=None,
                   help="GB of disk to keep free (default 13; 0 with --tiny)")
    p.add_argument("--wait-file", default=None,
                   help="wait while this file exists before each phase (a quiet machine)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the pipeline in seconds")
    p.add_argument("--airllm", action="store_true", help="with --tiny, run AirLLM too")
    p.add_argument("--keep", action="store_true", help="keep what was built")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = p.parse_args()
    shapes = {n: dict(SHAPES[n]) for n in args.shapes}
    for item in filter(None, args.layers.split(",")):
        n, _, k = item.partition("=")
        shapes[n]["num_hidden_layers"] = int(k)
    if args.tiny:
        for s in shapes.values():
            s.update(TINY)
        args.budget = 150_000
    if args.min_free is None:
        args.min_free = 0.0 if args.tiny else 13.0
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LCT_CACHE="0", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    results = {}
    try:
        for name, shape in shapes.items():
            results[name] = bench_shape(name, shape, args.out, args, env)
            if args.json:       # each shape's rows as soon as they are in
                args.json.write_text(json.dumps({"shapes": shapes, "results": results},
                                                indent=1))
    finally:
        if not args.keep:
            try:
                args.out.rmdir()
            except OSError:
                pass
    table = render(results)
    print(table)
    payload = {"shapes": shapes, "tokens": args.tokens, "budget": args.budget,
               "results": results}
    print(json.dumps(payload))
    if args.json:
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
