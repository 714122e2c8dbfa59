"""This tree against an earlier revision of LCT, on the user's path, in one run.

Each revision converts the Gemma-2B-shaped checkpoint of ``benchmarks/bench_format.py`` with
``lct convert`` (a fresh process, wall time), then loads its own artifact in fresh processes:
``lct.load(ART)`` to ready and ``generate`` to the first token, from process start. The
revisions run interleaved, ``--reps`` times each (all conversions, then all loads, who goes
first alternating), the page cache warm and 8 GiB of free memory primed before each load as
``bench_load.py`` does; the report gives medians, ranges and the ratio of this tree to the
base. The base is installed (``pip install --no-deps --target``) from a ``git worktree`` of
``--base`` and runs with the same interpreter and dependencies.

    python benchmarks/bench_revisions.py --out bench_out --base f8fa999 --reps 4

Writes ``revisions.json`` and ``revisions.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# The child: lct.load to ready, then generate to the first token, from process start
# (bench_load's clock: process age, a streamer that records each token's arrival).
LOAD = r'''
import lct
model = lct.load(sys.argv[1])
ready = _age()
import torch
ids = torch.tensor([[2, 651, 4320, 8426, 25341, 36271]])
clock = _Clock()
with torch.no_grad():
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                   do_sample=False, streamer=clock, pad_token_id=0)
print(json.dumps({"ready_s": ready, "first_token_s": clock.t[1], "where": lct.__file__}))
'''


def install_base(rev: str, work: Path) -> Path:
    """A non-editable install of revision ``rev`` (its C extension built) in ``work/site``."""
    tree, site = work / "tree", work / "site"
    if site.is_dir():
        return site
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                   check=True, capture_output=True)
    try:
        subprocess.run([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(tree)], check=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)
    return site


def env_for(site: Path | None) -> dict:
    import os
    # PYTHONSAFEPATH: the working directory (this tree's root holds lct/) is not on the path
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONSAFEPATH="1")
    env.pop("PYTHONPATH", None)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


def convert(site, src: Path, art: Path) -> float:
    shutil.rmtree(art, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([PY, "-c", "from lct.cli.main import main; main()",
                    "convert", str(src), "-o", str(art), "-q"], check=True, env=env_for(site),
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def load(site, art: Path) -> dict:
    from bench_load import PRELUDE
    out = subprocess.run([PY, "-c", PRELUDE + LOAD, str(art)], check=True, env=env_for(site),
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(path: Path) -> None:
    for p in sorted(path.iterdir()):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--base", required=True, help="the git revision to compare with")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_format import ensure_checkpoint
    from bench_load import prime_memory
    src, _ = ensure_checkpoint(args.out)
    site = install_base(args.base, args.out / f"base-{args.base}")
    contenders = {"base": site, "this": None}
    arts = {name: args.out / f"rev-{name}.lct" for name in contenders}
    rows = {name: {"convert_s": [], "ready_s": [], "first_token_s": []} for name in contenders}
    for name, s in contenders.items():      # the revision each one runs, before timing any
        where = subprocess.run([PY, "-c", "import lct; print(lct.__file__)"], env=env_for(s),
                               capture_output=True, text=True, check=True).stdout.strip()
        assert (s is None) == where.startswith(str(ROOT)), (name, where)
    # Conversions first (each revision writes its own artifact), then the loads, with the
    # written data flushed between: a load right after a conversion shares the disk with its
    # writeback. Within each phase who goes first alternates: on a VM that hands idle memory
    # back, the first process after a pause pays for it.
    for rep in range(args.reps):
        for name, s in list(contenders.items())[::1 if rep % 2 == 0 else -1]:
            rows[name]["convert_s"].append(convert(s, src, arts[name]))
            print(f"rep {rep} {name}: convert {rows[name]['convert_s'][-1]:.1f} s", flush=True)
    os.sync()
    for rep in range(args.reps):
        for name, s in list(contenders.items())[::1 if rep % 2 == 0 else -1]:
            warm(arts[name])
            prime_memory(8)         # the same recently used free memory for every load
            r = load(s, arts[name])
            r.pop("where")
            for k, v in r.items():
                rows[name][k].append(v)
            print(f"rep {rep} {name}: ready {r['ready_s']:.2f} s, first token "
                  f"{r['first_token_s']:.2f} s", flush=True)
    (args.out / "revisions.json").write_text(json.dumps(rows, indent=1))
    lines = [f"This tree against {args.base}: Gemma-2B shape, {args.reps} interleaved runs, "
             f"medians (range)", "", "| | base | this | this / base |", "|---|---|---|---|"]
    for key in ("convert_s", "ready_s", "first_token_s"):
        b, t = statistics.median(rows["base"][key]), statistics.median(rows["this"][key])
        lines.append(f"| {key} | {b:.2f} ({min(rows['base'][key]):.2f}–"
                     f"{max(rows['base'][key]):.2f}) | {t:.2f} ({min(rows['this'][key]):.2f}–"
                     f"{max(rows['this'][key]):.2f}) | {t / b:.3f} |")
    (args.out / "revisions.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
