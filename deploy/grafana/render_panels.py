"""Draw the Grafana dashboard's panels from a real Prometheus, without a Grafana server: every panel's
PromQL (deploy/grafana/dashboards/tandem.json, variables replaced as Grafana does with "All" selected) is
asked of Prometheus' range API and plotted with matplotlib, one small chart per panel, in the
dashboard's order. This is how the README's picture of the dashboard is made.

    python deploy/grafana/render_panels.py --prometheus http://127.0.0.1:9090 --minutes 10 -o dashboard.png
    python deploy/grafana/render_panels.py ... --rows Serving,Experts   # only those rows' panels
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "tandem.json"


def panels_by_row(dashboard: dict) -> list[tuple[str, dict]]:
    """(row title, panel) for every panel that draws data, in the dashboard's order."""
    row, out = "", []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        else:
            out.append((row, panel))
    return out


def promql(expr: str, rate_interval: str) -> str:
    """A target's expression as Grafana sends it: $model_name = All (.*), $__rate_interval given."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model_name", ".*")


def legend(fmt: str | None, labels: dict) -> str:
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def query_range(client: httpx.Client, url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    resp = client.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step})
    body = resp.json()
    if resp.status_code != 200 or body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body.get('error', resp.text[:200])}")
    return body["data"]["result"]


def render(url: str, out: Path, minutes: float, rows: list[str] | None = None, rate_interval: str = "1m",
           columns: int = 4, title: str | None = None) -> dict[str, int]:
    """Write the panels to ``out``; returns each panel's number of series with data (0 = empty)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    chosen = [(r, p) for r, p in panels_by_row(dashboard) if not rows or any(r.startswith(x) for x in rows)]
    if not chosen:
        raise ValueError(f"no panels in rows {rows}")
    end = time.time()
    start, step = end - 60 * minutes, max(1.0, 60 * minutes / 240)
    grid_rows = math.ceil(len(chosen) / columns)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(4.2 * columns, 2.6 * grid_rows), squeeze=False)
    counts = {}
    with httpx.Client(timeout=30) as client:
        for ax, (row, panel) in zip(axes.flat, chosen):
            drawn = 0
            for target in panel.get("targets", []):
                for series in query_range(client, url, promql(target["expr"], rate_interval), start, end, step):
                    ts = [(float(t) - end) / 60 for t, _ in series["values"]]
                    vs = [float(v) for _, v in series["values"]]
                    if any(math.isfinite(v) for v in vs):
                        ax.plot(ts, vs, linewidth=1.2, label=legend(target.get("legendFormat"), series["metric"])[:40])
                        drawn += 1
            counts[panel["title"]] = drawn
            ax.set_title(f"{panel['title']}", fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(True, alpha=0.3)
            if drawn:
                ax.legend(fontsize=6, loc="upper left")
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        for ax in axes.flat[len(chosen):]:
            ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("minutes ago", fontsize=7)
    fig.suptitle(title or f"Tandem dashboard, from Prometheus at {url}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python deploy/grafana/render_panels.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=10, help="the window drawn, ending now (default: %(default)s)")
    p.add_argument("--rate-interval", default="1m", help="what $__rate_interval becomes (default: %(default)s)")
    p.add_argument("--rows", help="comma-separated dashboard rows to draw, by title prefix (default: every row)")
    p.add_argument("--columns", type=int, default=4, help="charts per line (default: %(default)s)")
    p.add_argument("--title", help="the picture's title (default: names the Prometheus)")
    p.add_argument("-o", "--output", type=Path, default=Path("dashboard.png"), help="PNG to write (default: %(default)s)")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",")] if args.rows else None
    try:
        counts = render(args.prometheus, args.output, args.minutes, rows, args.rate_interval, args.columns, args.title)
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        print(f"render_panels: {exc}", file=sys.stderr)
        return 1
    empty = [title for title, n in counts.items() if not n]
    print(f"{args.output}: {len(counts)} panels, {len(counts) - len(empty)} with data"
          + (f"; empty: {', '.join(empty)}" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
