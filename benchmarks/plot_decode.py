"""Plot decode tok/s against the share of experts cached, one line per backend, from the JSONL rows of
bench_decode_moe.py (failed rows are skipped; `resident` is drawn as a horizontal ceiling; repeated
servers of one configuration (--repeat) as their mean with a min-max bar).

    python -m benchmarks.plot_decode out.jsonl -o decode.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def plot_rows(rows: list[dict], path: Path, title: str | None = None) -> Path:
    """Write the plot of ``rows`` (dicts with backend, cache_rate, decode_tok_s, ok) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    lines: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    ceilings: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if not r.get("ok"):
            continue
        if r["backend"] == "resident":  # everything on the GPU: the ceiling the others approach
            ceilings[r["backend"]].append(r["decode_tok_s"])
        elif r.get("cache_rate") is not None:  # rows sized by --moe-cache-auto/-size have no rate to plot at
            lines[r["backend"]][r["cache_rate"]].append(r["decode_tok_s"])
    if not lines and not ceilings:
        raise ValueError("no successful rows to plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend, by_rate in sorted(lines.items()):
        xs = sorted(by_rate)
        means = [statistics.fmean(by_rate[x]) for x in xs]
        spread = [[m - min(by_rate[x]) for x, m in zip(xs, means)], [max(by_rate[x]) - m for x, m in zip(xs, means)]]
        ax.errorbar([100 * x for x in xs], means, yerr=spread, marker="o", capsize=3, label=backend)
    for backend, values in ceilings.items():
        tok_s = statistics.fmean(values)
        ax.axhline(tok_s, linestyle="--", color="gray", label=f"{backend} ({tok_s:.0f} tok/s)")
    ax.set_xlabel("experts cached on the GPU (%)")
    ax.set_ylabel("decode tok/s (bs=1)")
    ax.set_title(title or rows[0].get("model", ""))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", type=Path, help="rows written by bench_decode_moe.py --json")
    p.add_argument("-o", "--output", type=Path, default=Path("decode.png"), help="PNG to write (default: %(default)s)")
    p.add_argument("--title", help="plot title (default: the model)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
    print(plot_rows(rows, args.output, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
