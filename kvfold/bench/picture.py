"""One picture of `kvfold bench-serve` runs: prompt tokens served from cache (the engines'
count) against the client's TTFT p90, one point per arm and load. A router that wins both
sits bottom right.

    python -m kvfold.bench.picture RUN/bench_serve.json [RUN2/bench_serve.json ...] -o F.png

Each run is one load (its label: the run's `--time-scale`, or `--label`s in order).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKERS = "os^Dv<>"


def frontier_png(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: str | Path) -> Path:
    """`runs`: (load label, rows of bench_serve.json) each. Writes and returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r["arm"] for _, rows in runs for r in rows})
    colors = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(arms)}
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for k, (_, rows) in enumerate(runs):
        for r in rows:
            if r.get("ttft_p90_ms") is None:
                continue
            ax.scatter(r["cached_tokens"], r["ttft_p90_ms"], s=60,
                       marker=MARKERS[k % len(MARKERS)], color=colors[r["arm"]])  # fmt: skip
            ax.annotate(r["arm"], (r["cached_tokens"], r["ttft_p90_ms"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")  # fmt: skip
    for k, (label, _) in enumerate(runs):
        ax.scatter([], [], marker=MARKERS[k % len(MARKERS)], color="#555", label=label)
    ax.set_xlabel("prompt tokens served from cache (engines' own count)  -> better")
    ax.set_ylabel("TTFT p90, ms (client, log scale)  <- better")
    ax.set_yscale("log")
    ax.set_title("bench-serve: each router, each load", fontsize=10)
    ax.legend(fontsize=8, title="load", title_fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="bench_serve.json of each load")
    p.add_argument("--label", action="append", default=[], help="each run's load, in order")
    p.add_argument("-o", "--out", default="bench_serve_frontier.png")
    args = p.parse_args(argv)
    runs = []
    for i, f in enumerate(args.runs):
        data = json.loads(Path(f).read_text())
        label = args.label[i] if i < len(args.label) else f"time scale {data['meta']['time_scale']}"
        runs.append((label, data["rows"]))
    print(f"wrote {frontier_png(runs, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
