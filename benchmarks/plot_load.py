"""Plot ``bench_load.py`` results: start-to-first-token (cold and warm) and peak RSS per contender.

    python benchmarks/plot_load.py bench_out/load_results.json docs/load_ttft.png
"""

from __future__ import annotations

import json
import statistics
import sys


def main(src: str, dst: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = json.load(open(src))
    names = [n for n in results if results[n]["warm"] and results[n]["warm"][0].get("ttft_s")]

    def med(n, kind, key):
        vals = [r[key] for r in results[n][kind] if r.get(key) is not None]
        return statistics.median(vals) if vals else 0.0

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    y = range(len(names))
    ax1.barh([i + 0.2 for i in y], [med(n, "cold", "ttft_s") for n in names], 0.4, label="cold")
    ax1.barh([i - 0.2 for i in y], [med(n, "warm", "ttft_s") for n in names], 0.4, label="warm")
    ax1.set_yticks(list(y), names)
    ax1.invert_yaxis()
    ax1.set_xlabel("process start → first generated token (s)")
    ax1.legend()
    ax2.barh(list(y), [med(n, "warm", "peak_rss") / 1e9 for n in names], 0.5, color="tab:green",
             label="peak")
    ax2.barh(list(y), [med(n, "warm", "rss_ready") / 1e9 for n in names], 0.25, color="tab:olive",
             label="when ready")
    ax2.set_yticks(list(y), [""] * len(names))
    ax2.invert_yaxis()
    ax2.set_xlabel("resident memory (GB)")
    ax2.legend()
    fig.suptitle("Gemma-2B-shaped checkpoint (bf16, 5.0 GB), 2-core CPU, medians")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
