"""Plot decode tok/s per backend under each routing (uniform, sticky, flat), with each row's bound, from the JSONL
rows of bench_decode_moe.py run once per routing preset (the model's ``routing=`` tells them apart).

    python -m benchmarks.plot_routing docs/results/h200-2026-12-04-routing/decode_{uniform,sticky,flat}.jsonl \
        -o routing.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from urllib.parse import parse_qs

BACKENDS = ("resident", "offload", "hybrid", "auto")


def routing_of(model: str) -> str:
    return parse_qs(model.partition("?")[2]).get("routing", ["uniform"])[-1]


def plot(rows: list[dict], path: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    routings = list(dict.fromkeys(routing_of(r["model"]) for r in rows))
    cell = {(routing_of(r["model"]), r["backend"]): r for r in rows if r.get("ok")}
    backends = [b for b in BACKENDS if any(key[1] == b for key in cell)]
    width = 0.8 / len(routings)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, routing in enumerate(routings):
        xs = [b + (i - (len(routings) - 1) / 2) * width for b in range(len(backends))]
        got = [cell.get((routing, b), {}) for b in backends]
        bars = ax.bar(xs, [g.get("decode_tok_s", 0) for g in got], width, label=routing)
        for x, g, bar in zip(xs, got, bars):
            if g.get("bound_tok_s"):  # the bandwidth bound of an offloading row: a tick above its bar
                ax.plot([x - width / 2, x + width / 2], [g["bound_tok_s"]] * 2, color=bar.get_facecolor(), lw=1.5,
                        ls=":")
            if g:
                ax.annotate(f"{g['decode_tok_s']:.0f}", (x, g["decode_tok_s"]), ha="center", va="bottom", fontsize=8)
    rates = {r["backend"]: r.get("cache_rate") for r in rows}
    ax.set_xticks(range(len(backends)), [b if rates.get(b) is None else f"{b}, {rates[b]:.0%} cached" for b in backends])
    ax.set_ylabel("decode tok/s, one stream (dotted: the row's bound)")
    models = {r["model"].partition("?")[0] for r in rows}
    ax.set_title(title or f"Decode by routing: {', '.join(sorted(models))}")
    ax.legend(title="routing")
    ax.set_ylim(0, max(r.get("decode_tok_s", 0) for r in rows) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", nargs="+", type=Path, help="bench_decode_moe rows, one file or more")
    p.add_argument("-o", "--out", type=Path, default=Path("routing.png"), help="the plot (default: %(default)s)")
    p.add_argument("--title", help="the plot's title (default: the models' names)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for f in args.jsonl for line in f.read_text().splitlines() if line.strip()]
    if not rows:
        p.error("no rows")
    print(plot(rows, args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
