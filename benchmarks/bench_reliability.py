"""The reliability sweeps of issue 12 at full size, with counts: structured manifest mutations
(hypothesis, fixed seed, each resealed) and bit flips / truncations of every file of a tiny
Gemma artifact with a tokenizer and Maximus shards, each through open + read-all, load and
verify. Outcomes: refused (a typed LCTError), harmless or unused (identical data and logits),
and the failures the tests forbid: silent wrong data, other exception types, hangs.

    python benchmarks/bench_reliability.py [--mutations 5000] [--positions 400]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _classify(fn) -> str:
    from lct.errors import LCTError
    try:
        return fn()
    except LCTError:
        return "refused"
    except AssertionError as e:
        return f"SILENT WRONG DATA ({str(e).splitlines()[0][:80]})"
    except TimeoutError:
        return "HANG"
    except Exception as e:  # noqa: BLE001 - counted, that is the point
        return f"OTHER EXCEPTION {type(e).__name__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutations", type=int, default=5000)
    ap.add_argument("--positions", type=int, default=400, help="flips and truncations per file")
    args = ap.parse_args()
    import test_file_damage as fd
    import test_mutations as tm
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import lct
    from lct.conversion.converter import Policy
    from lct.demo import tiny

    work = Path(tempfile.mkdtemp(prefix="lct-rel-"))
    src = tiny.save_tiny(work / "src", "gemma")
    tiny.save_tokenizer(src, vocab_size=256)
    art = work / "a.lct"
    lct.convert(str(src), art, policy=Policy(maximus_shards=4))
    tensors, logits = tm._read_all(art), tm._logits(art)
    text = (art / "lct.json").read_text()

    t0 = time.perf_counter()
    mut = collections.Counter()

    @settings(max_examples=args.mutations, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        mut[_classify(lambda: tm._check((art, text, tensors, logits), data))] += 1
    run()
    t_mut = time.perf_counter() - t0

    dmg = collections.Counter()
    t0 = time.perf_counter()
    rng = random.Random(7)
    copy = work / "b.lct"
    shutil.copytree(art, copy)
    for name in fd._files(art):
        original = (art / name).read_bytes()
        unused = fd._unused_ranges(art, name) if name.endswith(".lct") else []
        for kind in ("flip", "truncate"):
            for pos in sorted({rng.randrange(len(original)) for _ in range(args.positions)}):
                data = bytearray(original)
                if kind == "flip":
                    data[pos] ^= 1 << rng.randrange(8)
                else:
                    del data[pos:]
                (copy / name).write_bytes(bytes(data))
                out = _classify(lambda: fd._outcome(copy, tensors, logits, f"{kind} {name}"))
                if out == "unused" and not (kind == "flip"
                                            and any(a <= pos < b for a, b in unused)):
                    out = "VERIFY PASSED A DAMAGED CHECKED FILE"
                dmg[(name, kind, out)] += 1
                (copy / name).write_bytes(original)
    t_dmg = time.perf_counter() - t0

    print(f"manifest mutations: {sum(mut.values())} cases in {t_mut:.0f} s")
    for k, v in sorted(mut.items()):
        print(f"  {k}: {v}")
    print(f"file damage: {sum(dmg.values())} cases in {t_dmg:.0f} s")
    files = sorted({k[0] for k in dmg})
    print("| file | flips refused / unused / other | truncations refused / other |")
    print("|---|---|---|")
    for f in files:
        flips = {o: v for (n, k, o), v in dmg.items() if n == f and k == "flip"}
        truncs = {o: v for (n, k, o), v in dmg.items() if n == f and k == "truncate"}
        other_f = sum(v for o, v in flips.items() if o not in ("refused", "unused"))
        other_t = sum(v for o, v in truncs.items() if o != "refused")
        print(f"| {f} | {flips.get('refused', 0)} / {flips.get('unused', 0)} / {other_f} | "
              f"{truncs.get('refused', 0)} / {other_t} |")
    bad = [k for k in list(mut) + [k[2] for k in dmg] if k not in ("refused", "harmless",
                                                                    "unused")]
    print("failures:", sorted(set(bad)) or "none")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
