"""Plot decode tok/s against the share of experts cached, one line per backend, from the JSONL rows of
bench_decode_moe.py (failed rows are skipped; `resident` is drawn as a horizontal ceiling; repeated
servers of one configuration (--repeat) as their mean with a min-max bar).

    python -m benchmarks.plot_decode out.jsonl -o decode.png
    # with the side-by-side measurements of another engine as separate markers (llama.cpp on the results page)
    python -m benchmarks.plot_decode docs/results/h200-2026-11-29/decode24_lfu.jsonl \
        --reference docs/results/h200-2026-12-01/side_by_side.json --log-y -o sweep.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load_reference(path: Path) -> list[dict]:
    """The rows of a side-by-side file: every ``{"label", "cache_rate", "tok_s": [...]}`` list under its
    top-level sections (docs/results/h200-2026-12-01/side_by_side.json)."""
    data = json.loads(path.read_text())
    rows = [row for section in data.values() if isinstance(section, dict) for row in section.get("rows", [])]
    if not rows or not all({"label", "cache_rate", "tok_s"} <= row.keys() for row in rows):
        raise ValueError(f"{path}: no rows with label, cache_rate and tok_s")
    return rows


def plot_rows(rows: list[dict], path: Path, title: str | None = None, reference: list[dict] | None = None,
              log_y: bool = False) -> Path:
    """Write the plot of ``rows`` (dicts with backend, cache_rate, decode_tok_s, ok) to ``path``; ``reference``
    rows (label, cache_rate, tok_s list) are drawn as separate markers, all-on-GPU ones (rate 1) as lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

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
    fig, ax = plt.subplots(figsize=(10, 4.5) if reference else (7, 4.5))
    for backend, by_rate in sorted(lines.items()):
        xs = sorted(by_rate)
        means = [statistics.fmean(by_rate[x]) for x in xs]
        spread = [[m - min(by_rate[x]) for x, m in zip(xs, means)], [max(by_rate[x]) - m for x, m in zip(xs, means)]]
        ax.errorbar([100 * x for x in xs], means, yerr=spread, marker="o", capsize=3, label=backend)
    for backend, values in ceilings.items():
        tok_s = statistics.fmean(values)
        ax.axhline(tok_s, linestyle="--", color="gray", label=f"{backend} ({tok_s:.0f} tok/s)")
    for i, ref in enumerate(reference or []):
        mean = statistics.fmean(ref["tok_s"])
        label = f"{ref['label']} ({' / '.join(f'{v:g}' for v in ref['tok_s'])})"
        if ref["cache_rate"] >= 1.0:
            ax.axhline(mean, linestyle=":", color=f"C{5 + i % 5}", label=label)
        else:
            spread = [[mean - min(ref["tok_s"])], [max(ref["tok_s"]) - mean]]
            ax.errorbar([100 * ref["cache_rate"]], [mean], yerr=spread, marker="s" if "llama" in ref["label"] else "D",
                        linestyle="none", capsize=3, color=f"C{5 + i % 5}", label=label)
    if log_y:  # all-on-GPU lines sit 5-10x above the offloaded points: a log scale keeps both readable
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([10, 20, 30, 50, 100, 200, 300, 500, 1000]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("experts cached on the GPU (%)")
    ax.set_ylabel("decode tok/s (bs=1)")
    ax.set_title(title or rows[0].get("model", ""))
    ax.grid(True, alpha=0.3)
    if reference:  # many entries: beside the axes, not over the points
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
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
    p.add_argument("--reference", type=Path,
                   help="side-by-side JSON whose rows (label, cache_rate, tok_s) are drawn as markers (default: none)")
    p.add_argument("--log-y", action="store_true", help="logarithmic tok/s axis (default: linear)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
    reference = load_reference(args.reference) if args.reference else None
    print(plot_rows(rows, args.output, args.title, reference, args.log_y))
    return 0


if __name__ == "__main__":
    sys.exit(main())
