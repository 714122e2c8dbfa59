#!/usr/bin/env bash
# One bounded run on a machine with an NVIDIA GPU: what the machine is, the CUDA tests, the
# user's path onto the GPU (a fresh process to the first token, from_pretrained against lct.load,
# cold and warm, on the Gemma-2B shape built here), decoded GB/s by decode threads, the LM heads
# on the GPU against dense bf16, and a tensor-parallel load over NCCL.
#
#   bash benchmarks/gpu_check.sh                     # from anywhere; runs in the repository root
#   OUT=gpu_out DEADLINE=500 PYTHON=python3 bash benchmarks/gpu_check.sh
#
# Needs a CUDA build of torch, bitsandbytes for the NF4 parts, and LCT installed
# (pip install -e '.[test]'). Everything it writes is under $OUT (default ./gpu_out):
#   gpu_check.log   the whole output          gpu_check.json  every step and figure
#   gpu_check.md    the tables, for docs/BENCHMARKS.md
# DEADLINE (seconds, default 900) bounds the whole run: each step gets at most its own cap and
# what is left, the load benchmark starts no new repetition past its share, and a step that
# does not fit is reported as skipped. Exit status: 0 when every step passed, 1 when one failed
# or was skipped, 2 when there is no usable GPU (nothing is run then).
# CHECKS (default "tests tp decode load heads") picks the steps, in that order.
# DEVICE=cpu MODEL=tiny runs the same steps on the CPU with a tiny model: a check of this script
# on a machine without a GPU (the CUDA tests skip there; its figures mean nothing).

set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
PY="${PYTHON:-python}"
OUT="$(mkdir -p "${OUT:-gpu_out}" && cd "${OUT:-gpu_out}" && pwd)"
DEADLINE="${DEADLINE:-900}"
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-gemma-2b}"
CHECKS="${CHECKS:-tests tp decode load heads}"
want() { [[ " $CHECKS " == *" $1 "* ]]; }
WORK="${WORK:-/tmp/lct_gpu_check}"     # the generated checkpoint, its artifact, the decoded copy
LOG="$OUT/gpu_check.log"
STEPS="$WORK/steps.jsonl"
mkdir -p "$WORK"
: > "$STEPS"
export ROOT WORK DEVICE MODEL
exec > >(tee -a "$LOG") 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

die() {
    echo "gpu_check: $*" >&2
    exit 2
}

left() { echo $((DEADLINE - SECONDS)); }

# --- Fail fast without a GPU -------------------------------------------------------------------
command -v "$PY" >/dev/null 2>&1 || die "no '$PY' on PATH (set PYTHON=/path/to/python)"
[ "$DEVICE" = cpu ] || command -v nvidia-smi >/dev/null 2>&1 || die "no NVIDIA GPU here: nvidia-smi was not found. \
Run this on a machine with a CUDA GPU; the CPU tests are 'python -m pytest -q tests'."
[ "$DEVICE" = cpu ] || timeout 60 nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi found no working GPU"
if ! cuda_info="$(cd /tmp && timeout 120 "$PY" - <<'EOF' 2>&1
import os, sys
import torch
if os.environ["DEVICE"] != "cpu" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device; install a CUDA build of torch")
import transformers
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers "
      f"{transformers.__version__}, {torch.cuda.device_count()} device(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
      + f"; {len(os.sched_getaffinity(0))} CPU cores")
try:
    import bitsandbytes
    print(f"bitsandbytes {bitsandbytes.__version__}")
except Exception as e:  # the NF4 tests skip without it; say so here
    print(f"bitsandbytes: not importable ({e.__class__.__name__}: {e}); NF4 GPU tests will skip")
import lct
from lct.kernels import native
print(f"lct {lct.__version__}, native kernels {native.available()}")
EOF
)"; then
    die "no usable GPU for torch: ${cuda_info##*$'\n'}"
fi
echo "== machine"
[ "$DEVICE" = cpu ] || timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "$cuda_info"
grep -m1 "model name" /proc/cpuinfo || true
free -g | head -2 || true
echo

# --- Steps -------------------------------------------------------------------------------------
failed=0

step() {  # step NAME CAP_S COMMAND...: runs under min(CAP_S, time left); records the outcome
    local name="$1" cap="$2"
    shift 2
    local limit rc=0 t0=$SECONDS status
    limit=$(( cap < $(left) ? cap : $(left) ))
    echo "== $name (at most ${limit} s)"
    if [ "$limit" -lt 10 ]; then
        status="skipped: no time left"
        failed=1
    else
        timeout --kill-after=10 "$limit" "$@" || rc=$?
        if [ "$rc" -eq 0 ]; then status="ok"
        elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="timed out after ${limit} s"; failed=1
        else status="failed (exit ${rc})"; failed=1
        fi
    fi
    printf '{"step": "%s", "status": "%s", "seconds": %d}\n' "$name" "$status" \
        $((SECONDS - t0)) >> "$STEPS"
    echo "-- $name: $status ($((SECONDS - t0)) s)"
    echo
}

# The Gemma-2B-shaped checkpoint and its artifact (default convert), built in the background
# while the CUDA tests run: the CPU work of one beside the GPU work of the other.
(
    cd /tmp && "$PY" - "$WORK" <<'EOF'
import subprocess, sys, time
from pathlib import Path
sys.path.insert(0, __import__("os").environ["ROOT"] + "/benchmarks")
import bench_load
t = time.perf_counter()
model = __import__("os").environ["MODEL"]
prepare = bench_load.prepare_tiny if model == "tiny" else bench_load.prepare_gemma
src, art, _ = prepare(Path(sys.argv[1]))
print(f"built and converted {src.name} in {time.perf_counter() - t:.0f} s")
EOF
) > "$WORK/prepare.log" 2>&1 &
prepare=$!

if want tests; then
    step "CUDA tests" 170 "$PY" -m pytest -q -rsxX -p no:cacheprovider -m cuda \
        --junitxml="$OUT/cuda_tests.xml" tests/test_gpu.py tests/test_q6_k.py
fi

# Tensor parallel over NCCL: 2 ranks on 2 GPUs (1 on a single GPU: the NCCL and CUDA path of
# the load all the same), a tiny Qwen2 with pieces, the same greedy tokens as one process
# (issue 15; the gloo path is tested on the CPU).
gpus="$( [ "$DEVICE" = cpu ] || timeout 60 nvidia-smi -L | wc -l)"
gpus="${gpus:-0}"
export NPROC=$(( gpus >= 2 ? 2 : 1 ))
tp_check() {
    cd /tmp && "$PY" - <<'EOF'
import os
import json, subprocess, sys, tempfile
from pathlib import Path
import torch
import lct
from lct.conversion.converter import Policy
from lct.demo import tiny
d = Path(tempfile.mkdtemp())
src = tiny.save_tiny(d / "src", "qwen2", num_attention_heads=8, num_key_value_heads=4)
art = d / "a.lct"
lct.convert(str(src), art, policy=Policy(nf4=(), tp_pieces=2))
nproc = os.environ["NPROC"]
out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", nproc,
                      "-m", "lct", "load", str(art), "--tp", "--device", "cuda", "--ids", "1,5,9",
                      "--max-new-tokens", "4", "--json"], capture_output=True, text=True,
                     timeout=600)
print(out.stdout, out.stderr[-2000:])
ranks = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
want = lct.load(art).generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, do_sample=False)
assert out.returncode == 0 and len(ranks) == int(nproc), out.returncode
assert all(r["text"] == " ".join(map(str, want[0, 3:].tolist())) for r in ranks), ranks
print(f"tensor-parallel on {nproc} GPU(s): same tokens as one process on the CPU")
EOF
}
export -f tp_check
export PY
if [ "$DEVICE" != cpu ] && want tp; then
    step "tensor-parallel load on ${NPROC} GPU(s) (NCCL)" 60 bash -c tp_check
fi


echo "== waiting for the Gemma-2B-shaped checkpoint and its artifact"
while kill -0 "$prepare" 2>/dev/null && [ "$(left)" -gt 60 ]; do sleep 2; done
if kill -0 "$prepare" 2>/dev/null; then
    kill "$prepare"; echo "gpu_check: the build did not finish in time"
fi
wait "$prepare"; prc=$?
cat "$WORK/prepare.log" | tail -20
ART="$WORK/$([ "$MODEL" = tiny ] && echo tiny-llama || echo gemma-2b-random).lct"
if [ "$prc" -ne 0 ] || [ ! -f "$ART/lct.json" ]; then
    printf '{"step": "build and convert", "status": "failed (exit %d)", "seconds": 0}\n' "$prc" \
        >> "$STEPS"
    failed=1
fi

if [ -f "$ART/lct.json" ]; then
    want decode && step "decoded GB/s by decode threads (bench_decode.py)" 90 \
        "$PY" benchmarks/bench_decode.py "$ART" --threads 1,2,4,8,16 --passes 2 --max-gb 1.5 \
        --json "$OUT/decode.json"
    # Three interleaved repetitions where they fit: what is left, less the steps after it.
    budget=$(( $(left) - $(want heads && echo 110 || echo 60) ))
    budget=$(( budget > 30 ? budget : 30 ))
    want load && step "first token on $DEVICE (bench_load.py --device $DEVICE)" $(( budget + 60 )) \
        "$PY" benchmarks/bench_load.py --out "$WORK" --models "$MODEL" --no-long --reps 3 \
        --device "$DEVICE" --max-seconds "$budget" \
        --contenders "floor|from_pretrained|lct.load + generate|lct.load cache=False + generate"
    cp "$WORK/load_results_none.json" "$OUT/load_gpu.json" 2>/dev/null || true
fi

if [ "$DEVICE" = cpu ]; then head_size=(--vocab 4096 --hidden 256); else head_size=(); fi
want heads && step "LM heads on $DEVICE (bench_head.py --device $DEVICE)" 70 \
    "$PY" benchmarks/bench_head.py --device "$DEVICE" --rows 1,4,16,64 --repeats 20 \
    "${head_size[@]}" --json "$OUT/heads.json"

# --- Summary: one JSON and one Markdown file -------------------------------------------------
echo "== summary"
CUDA_INFO="$cuda_info" "$PY" - "$OUT" "$STEPS" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, steps = Path(sys.argv[1]), [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
info = "; ".join(l for l in os.environ["CUDA_INFO"].splitlines()
                if l.startswith(("torch", "bitsandbytes", "lct")))   # not libraries' warnings
res = {"machine": info, "steps": steps}
md = ["## GPU check", "", "Machine: " + info, "",
      "| step | outcome | s |", "|---|---|---|"]
md += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in steps]
junit = out / "cuda_tests.xml"
if junit.exists():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    res["cuda_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                             "skipped")}
    res["cuda_tests"]["not_passed"] = [
        f"{c.get('classname')}::{c.get('name')}: {c[0].tag} {(c[0].get('message') or '')[:300]}"
        for c in suite.iter("testcase") if len(c)]
    md += ["", f"CUDA tests: {res['cuda_tests']}"]
for name, key in (("decode.json", "decode"), ("heads.json", "heads")):
    p = out / name
    if p.exists():
        res[key] = json.loads(p.read_text())
        md += ["", res[key]["table"]]
p = out / "load_gpu.json"
if p.exists():
    res["load"] = json.loads(p.read_text())
    report = Path(os.environ.get("WORK", "/tmp/lct_gpu_check")) / "load_results_none.md"
    if report.exists():
        md += ["", report.read_text()]
(out / "gpu_check.json").write_text(json.dumps(res, indent=1))
(out / "gpu_check.md").write_text("\n".join(md) + "\n")
for s in steps:
    print(f"  {s['step']:<60} {s['status']} ({s['seconds']} s)")
EOF
if [ "$failed" -ne 0 ]; then
    echo "gpu_check: some steps failed or were skipped" >&2
    exit 1
fi
echo "gpu_check: all steps passed"
