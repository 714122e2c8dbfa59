#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: what the machine is, the CUDA tests, the
# loader/kernel tests beside them, and LM-head timings on the GPU.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; runs in the repository root
#   PYTHON=.venv/bin/python STEP_TIMEOUT=300 bash benchmarks/gpu_check.sh
#
# Needs a CUDA build of torch and bitsandbytes (pip install -e '.[test]' with a CUDA torch).
# Every step runs under `timeout` (STEP_TIMEOUT seconds, default 600; the timing step
# TIMING_TIMEOUT, default 300). Exit status: 0 when every step passed, 1 when one failed, 2 when
# there is no usable GPU (nothing is run then).
#
# benchmarks/bench_head.py and bench_load.py time the CPU only (no device option), so the GPU
# timings are the inline script below: NF4Linear (bitsandbytes' 4-bit matmul) and Int8Linear
# against a dense bf16 head of 256,000 x 2,048, 20 calls each after a warm-up, with
# torch.cuda.synchronize() around them.

set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python}"
STEP_TIMEOUT="${STEP_TIMEOUT:-600}"
TIMING_TIMEOUT="${TIMING_TIMEOUT:-300}"

die() {
    echo "gpu_check: $*" >&2
    exit 2
}

# --- Fail fast without a GPU -------------------------------------------------------------------
command -v "$PY" >/dev/null 2>&1 || die "no '$PY' on PATH (set PYTHON=/path/to/python)"
command -v timeout >/dev/null 2>&1 || die "no 'timeout' command (coreutils) on this machine"
if ! command -v nvidia-smi >/dev/null 2>&1; then
    die "no NVIDIA GPU here: nvidia-smi was not found. Run this on a machine with a CUDA GPU; \
the CPU tests are 'python -m pytest -q tests'."
fi
if ! timeout 60 nvidia-smi -L >/dev/null 2>&1; then
    die "nvidia-smi found no working GPU (driver not loaded, or no device visible)."
fi
if ! cuda_info="$(timeout 120 "$PY" - <<'EOF' 2>&1
import sys
import torch
if not torch.cuda.is_available():
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    sys.exit(f"torch {torch.__version__} ({build}) sees no CUDA device; install a CUDA build "
             f"of torch")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, {torch.cuda.device_count()} device(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
try:
    import bitsandbytes
    print(f"bitsandbytes {bitsandbytes.__version__}")
except Exception as e:  # the NF4 tests skip without it; say so here
    print(f"bitsandbytes: not importable ({e.__class__.__name__}: {e}); NF4 GPU tests will skip")
EOF
)"; then
    die "no usable GPU for torch: ${cuda_info##*$'\n'}"
fi

echo "== nvidia-smi"
timeout 60 nvidia-smi || true
echo
echo "== versions"
echo "$cuda_info"
echo

# --- Steps -------------------------------------------------------------------------------------
names=()
results=()
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...
    local name="$1" limit="$2"
    shift 2
    echo "== $name"
    local t0=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    local took=$((SECONDS - t0))
    if [ "$rc" -eq 0 ]; then
        results+=("ok (${took} s)")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        results+=("TIMED OUT after ${limit} s")
        failed=1
    else
        results+=("FAILED (exit ${rc}, ${took} s)")
        failed=1
    fi
    names+=("$name")
    echo
}

step "CUDA tests (tests/test_gpu.py)" "$STEP_TIMEOUT" \
    "$PY" -m pytest -q -rsxX -m cuda tests/test_gpu.py
step "loader and kernel tests (CPU paths beside the GPU)" "$STEP_TIMEOUT" \
    "$PY" -m pytest -q -rs tests/test_loader.py tests/test_kernels.py tests/test_nf4.py
# Tensor parallel over NCCL: 2 ranks on 2 GPUs (1 on a single GPU: the NCCL and CUDA path of
# the load all the same), a tiny Qwen2 with pieces, the same greedy tokens as one process
# (issue 15; the gloo path is tested on the CPU).
gpus="$(timeout 60 nvidia-smi -L | wc -l)"
nproc=$(( gpus >= 2 ? 2 : 1 ))
if [ "$gpus" -ge 1 ]; then
    step "tensor-parallel load on ${nproc} GPU(s) (NCCL)" "$STEP_TIMEOUT" \
        env PYTHONSAFEPATH=1 NPROC="$nproc" "$PY" - <<'EOF'
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
else
    echo "== tensor-parallel load over NCCL: skipped (no GPU)"
fi
# PYTHONSAFEPATH: the script comes on stdin, so the working directory would go first on sys.path,
# where the repository's kernels/ folder shadows the `kernels` package bitsandbytes may import.
step "GPU LM-head timings (256000 x 2048, 20 calls)" "$TIMING_TIMEOUT" \
    env PYTHONSAFEPATH=1 "$PY" - <<'EOF'
"""ms per call of an LM head on the GPU: dense bf16 vs NF4 (bitsandbytes) vs int8 per row."""
import time

import torch

from lct.kernels import Int8Linear, NF4Linear

V, H, REPS, DEV = 256_000, 2_048, 20, "cuda"
torch.manual_seed(0)
with torch.no_grad():
    dense = torch.nn.Linear(H, V, bias=False, device=DEV, dtype=torch.bfloat16)
    # Timing does not depend on the values: random codes and scales, made on the device.
    packed = torch.randint(0, 256, (V * H // 2,), dtype=torch.uint8, device=DEV)
    absmax = torch.rand(V * H // 64, device=DEV) * 0.05
    q = torch.randint(-127, 128, (V, H), dtype=torch.int8, device=DEV)
    scale = torch.rand(V, device=DEV) * 1e-3
heads = {"dense bf16": dense,
         "int8 per row": Int8Linear(q, scale, torch.bfloat16)}
try:
    import bitsandbytes  # noqa: F401
    heads["nf4 (bitsandbytes)"] = NF4Linear(packed, absmax, V, H, 64, torch.bfloat16)
except ImportError:
    print("bitsandbytes is not installed: no NF4 timing")


def per_call_ms(mod, x):
    with torch.no_grad():
        for _ in range(3):                      # warm-up: kernels, allocator, cuBLAS handles
            mod(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(REPS):
            mod(x)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / REPS * 1e3


print(f"{'head':<20} {'rows':>5} {'ms/call':>9} {'x dense':>8}")
for rows in (1, 64):
    x = torch.randn(rows, H, device=DEV, dtype=torch.bfloat16)
    base = None
    for name, mod in heads.items():
        ms = per_call_ms(mod, x)
        base = base or ms
        print(f"{name:<20} {rows:>5} {ms:>9.3f} {ms / base:>8.2f}")
print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
EOF

# --- Summary -----------------------------------------------------------------------------------
echo "== summary"
for i in "${!names[@]}"; do
    printf '  %-55s %s\n' "${names[$i]}" "${results[$i]}"
done
if [ "$failed" -ne 0 ]; then
    echo "gpu_check: some steps failed" >&2
    exit 1
fi
echo "gpu_check: all steps passed"
