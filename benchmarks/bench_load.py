"""Cold-start benchmark: time from process start to the first generated token, and peak RSS.

Each contender runs in its own process (imports and allocator state never leak), cold (page cache
dropped, needs root) and warm, interleaved, several times; medians are reported with ratios against
``from_pretrained`` measured in the same run. On the Gemma-2B-shaped checkpoint that
``benchmarks/bench_format.py`` generates (random bf16 weights, config in ../shared/docs/PEERS.md).

    python benchmarks/bench_load.py --out bench_out --reps 3

Contenders: transformers ``from_pretrained`` on the safetensors source, tensorizer, the Run:ai
model streamer (both on the same weights), LCT with prefetch 0/1/2/4 and ``nf4="keep"`` vs
``"dequantize"``, and LCT's layer-wise executor (peak RSS and tokens/s). A "floor" row is a
process that only imports torch and the model class: what every contender pays before any weight.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable

PRELUDE = r'''
import json, os, sys, time
def _age():
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return up - start / os.sysconf("SC_CLK_TCK")
def _kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
extra = {}
IDS_LIST = [[2, 65, 107, 57, 100, 17]]
# Each contender imports what its users would import, so that import time counts as it would.
'''

HF_IMPORTS = r'''
import torch
from transformers import AutoModelForCausalLM, AutoConfig
'''

EPILOGUE = r'''
IDS = torch.tensor(IDS_LIST)
ready = _age()
rss_ready = _kb("VmRSS")
with torch.no_grad():
    out = model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=1,
                         do_sample=False, pad_token_id=0)
first = _age()
print("RESULT " + json.dumps({"ready_s": ready, "ttft_s": first, "rss_ready": rss_ready,
                               "peak_rss": _kb("VmHWM"), "token": int(out[0, -1]), **extra}))
'''

CONTENDERS = {
    "from_pretrained": HF_IMPORTS + r'''
model = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16).eval()
''',
    "tensorizer": HF_IMPORTS + r'''
from tensorizer import TensorDeserializer
from tensorizer.utils import no_init_or_tensor
config = AutoConfig.from_pretrained(SRC)
model = no_init_or_tensor(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
d = TensorDeserializer(TENSORS, device="cpu", num_readers=2)
d.load_into_module(model)
d.close()
model.tie_weights()
model.eval()
''',
    "runai_streamer": HF_IMPORTS + r'''
from accelerate import init_empty_weights
from runai_model_streamer import SafetensorsStreamer
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


# The floor every contender shares: a process that imports torch and the model's transformers
# class, then stops. No loader that returns a transformers model can be ready sooner.
FLOOR = r'''
import torch
from transformers import GemmaForCausalLM
print("RESULT " + json.dumps({"ready_s": _age(), "ttft_s": _age(), "rss_ready": _kb("VmRSS"),
                               "peak_rss": _kb("VmHWM")}))
'''


def lct_code(prefetch: int, nf4: str) -> str:
    # An LCT user needs no torch import before lct.load (it imports torch beside the decode).
    return rf'''
import lct, lct.loader
st = lct.loader.LoadStats()
model = lct.load(ART, prefetch={prefetch}, nf4="{nf4}", stats=st)
import torch
extra = {{k: getattr(st, k) for k in ("manifest_s", "skeleton_s", "read_s", "decode_s", "wait_s",
                                      "install_s", "total_s", "bytes_read", "bytes_decoded",
                                      "max_in_flight")}}
'''


LAYERWISE = r'''
import torch, lct
from lct.loader import LayerwiseModel
IDS = torch.tensor(IDS_LIST)
lm = LayerwiseModel(ART, prefetch=2)
ready = _age()
rss_ready = _kb("VmRSS")
t0 = time.perf_counter()
with torch.no_grad():
    out = lm.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=4, do_sample=False,
                      pad_token_id=0)
dt = time.perf_counter() - t0
print("RESULT " + json.dumps({"ready_s": ready, "ttft_s": None, "rss_ready": rss_ready,
                               "peak_rss": _kb("VmHWM"), "tokens_per_s": 4 / dt,
                               "max_resident_layers": lm.max_resident_layers}))
'''


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run(code: str, env: dict) -> dict:
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"contender failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def prepare(out: Path) -> tuple:
    src = out / "gemma-2b-random"
    if not (src / "model.safetensors").exists():
        print("generating the Gemma-2B-shaped checkpoint (benchmarks/bench_format.py) ...")
        subprocess.run([PY, str(Path(__file__).parent / "bench_format.py"), "--_build", str(src)],
                       check=True)
    art = out / "gemma-2b-random.lct"
    if not (art / "lct.json").exists():
        print("converting to LCT ...")
        subprocess.run([PY, "-m", "lct.cli.main", "convert", str(src), "-o", str(art), "--force",
                        "--quiet"], check=True)
    tensors = out / "gemma-2b-random.tensors"
    if not tensors.exists():
        print("serializing for tensorizer ...")
        code = PRELUDE + HF_IMPORTS + rf'''
from tensorizer import TensorSerializer
model = AutoModelForCausalLM.from_pretrained({str(src)!r}, dtype=torch.bfloat16)
s = TensorSerializer({str(tensors) + ".tmp"!r})
s.write_module(model)
s.close()
os.replace({str(tensors) + ".tmp"!r}, {str(tensors)!r})
'''
        subprocess.run([PY, "-c", code], check=True)
    return src, art, tensors


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() \
        else path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="contender names to run")
    ap.add_argument("--no-cold", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(exist_ok=True)
    src, art, tensors = prepare(args.out)
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    header = f"SRC = {str(src)!r}\nART = {str(art)!r}\nTENSORS = {str(tensors)!r}\n"
    codes = {"floor: import torch + model class": header + PRELUDE + FLOOR}
    codes.update({name: header + PRELUDE + body + EPILOGUE for name, body in CONTENDERS.items()})
    for p in (0, 1, 2, 4):
        codes[f"lct prefetch={p}"] = header + PRELUDE + lct_code(p, "keep") + EPILOGUE
    codes["lct prefetch=2 nf4=dequantize"] = header + PRELUDE + lct_code(2, "dequantize") + EPILOGUE
    codes["lct layer-wise prefetch=2"] = header + PRELUDE + LAYERWISE
    if args.only:
        codes = {k: v for k, v in codes.items() if k in args.only}
    cold_ok = not args.no_cold and drop_caches()
    results: dict = {k: {"cold": [], "warm": []} for k in codes}
    for rep in range(args.reps):
        for name, code in codes.items():
            if cold_ok:
                drop_caches()
                results[name]["cold"].append(run(code, env))
            results[name]["warm"].append(run(code, env))
            last = results[name]["warm"][-1]
            print(f"rep {rep} {name}: warm ttft {last['ttft_s']} peak {last['peak_rss'] / 1e9:.2f} GB",
                  flush=True)
    report = render(results, src, art, tensors, cold_ok)
    print(report)
    (args.out / "load_results.json").write_text(json.dumps(results, indent=1))
    (args.out / "load_results.md").write_text(report)


def med(rows: list, key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def render(results: dict, src: Path, art: Path, tensors: Path, cold_ok: bool) -> str:
    base = results.get("from_pretrained")
    lines = [f"Sizes: safetensors {size_of(src / 'model.safetensors') / 1e9:.2f} GB, "
             f"LCT artifact {size_of(art) / 1e9:.2f} GB, tensorizer {size_of(tensors) / 1e9:.2f} GB. "
             f"Medians of {len(next(iter(results.values()))['warm'])} interleaved runs, each in a "
             f"fresh process; cold = page cache dropped before the run"
             + ("" if cold_ok else " (NOT measured: no root)") + ".", "",
             "| contender | cold: start→first token s | × from_pretrained | warm: start→first token s "
             "| × from_pretrained | ready s (warm) | RSS when ready GB | peak RSS GB | peak / ready |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        cold, warm = med(r["cold"], "ttft_s"), med(r["warm"], "ttft_s")
        bc = med(base["cold"], "ttft_s") if base else None
        bw = med(base["warm"], "ttft_s") if base else None
        peak, ready_rss = med(r["warm"], "peak_rss"), med(r["warm"], "rss_ready")
        f = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
        ratio = lambda a, b: "–" if a is None or not b else f"{a / b:.2f}"  # noqa: E731
        lines.append(f"| {name} | {f(cold)} | {ratio(cold, bc)} | {f(warm)} | {ratio(warm, bw)} | "
                     f"{f(med(r['warm'], 'ready_s'))} | {f(ready_rss / 1e9)} | {f(peak / 1e9)} | "
                     f"{ratio(peak, ready_rss)} |")
    lw = results.get("lct layer-wise prefetch=2")
    if lw and lw["warm"]:
        lines += ["", f"Layer-wise executor (prefetch 2, warm): peak RSS "
                      f"{med(lw['warm'], 'peak_rss') / 1e9:.2f} GB, "
                      f"{med(lw['warm'], 'tokens_per_s'):.2f} tokens/s, at most "
                      f"{max(x['max_resident_layers'] for x in lw['warm'])} layers resident."]
    rows = [(n, r) for n, r in results.items() if n.startswith("lct prefetch")]
    if rows:
        lines += ["", "LCT breakdown (warm medians; read/decode are summed worker time):", "",
                  "| contender | manifest s | skeleton s | read s | decode s | waiting s | install s "
                  "| load total s | decoded GB | decoded GB/s | max in flight |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for n, r in rows:
            w = r["warm"]
            total = med(w, "total_s")
            lines.append(f"| {n} | {med(w, 'manifest_s'):.3f} | {med(w, 'skeleton_s'):.2f} | "
                         f"{med(w, 'read_s'):.2f} | {med(w, 'decode_s'):.2f} | "
                         f"{med(w, 'wait_s'):.2f} | {med(w, 'install_s'):.2f} | {total:.2f} | "
                         f"{med(w, 'bytes_decoded') / 1e9:.2f} | "
                         f"{med(w, 'bytes_decoded') / 1e9 / total:.2f} | "
                         f"{max(x['max_in_flight'] for x in w)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total benchmark time {time.perf_counter() - t0:.0f} s")
