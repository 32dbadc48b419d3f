"""`kvfold compare TRACE`: one trace, one cluster shape, every router, side by side.

Each router gets a kvfold launched afresh on the same embedded cluster (empty caches,
empty host tiers) and the same replay (kvfold.replay.trace_replay); the table puts what
each achieved beside what the cluster held when the requests arrived and beside two
references that need no cluster (kvfold.workload.references).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvfold.admission.routing import Router
from kvfold.cluster.handle import KVFold
from kvfold.replay.trace_replay import replay
from kvfold.workload.recorder import ReplayRecorder
from kvfold.workload.requests import TraceRequest
from kvfold.workload.scheduler import ReplayConfig

COLUMNS = (
    "router",
    "hit_rate_achieved",
    "hit_rate_achieved_gpu",
    "hit_rate_available",
    "achieved_over_available",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "work_tokens_per_trace_s",
    "queue_delay_p50_s",
    "queue_delay_p99_s",
    "overcommits",
    "rank_refusals",
    "completed",
    "wall_s",
)


def compare(
    launch_kv: Callable[[], KVFold],
    workload: Sequence[TraceRequest],
    config: ReplayConfig,
    routers: Sequence[Router] = tuple(Router),
    on_done: Callable[[str, ReplayRecorder], None] | None = None,
) -> list[dict[str, Any]]:
    """Replay `workload` once per router, each on a kvfold from `launch_kv()` (shut down
    after); return one summary per router."""
    rows = []
    for router in routers:
        kv = launch_kv()
        try:
            rec = replay(kv, workload, replace(config, router=router.value))
        finally:
            kv.shutdown()
        if on_done is not None:
            on_done(router.value, rec)
        rows.append({"router": router.value, **rec.summary()})
    return rows


def write_table(
    rows: list[dict[str, Any]], refs: dict[str, float], out: Path, stem: str, title: str = ""
) -> tuple[Path, Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path, png_path = (out / f"{stem}.{ext}" for ext in ("csv", "json", "png"))
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([*COLUMNS, "ref_infinite", "ref_lru"])
        for row in rows:
            w.writerow([row.get(c, "") for c in COLUMNS] + [refs["infinite"], refs["lru"]])
    json_path.write_text(json.dumps({"references": refs, "runs": rows}, indent=2, default=str))
    _plot(rows, refs, png_path, title or stem)
    return csv_path, json_path, png_path


def format_table(rows: list[dict[str, Any]], refs: dict[str, float]) -> str:
    head = (
        f"{'router':<16}{'hit%':>7}{'gpu%':>7}{'avail%':>8}{'ach/av':>8}"
        f"{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'tok/s':>10}{'queue p99':>11}"
        f"{'overc.':>8}{'refus.':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['router']:<16}{100 * r['hit_rate_achieved']:>7.1f}"
            f"{100 * r['hit_rate_achieved_gpu']:>7.1f}{100 * r['hit_rate_available']:>8.1f}"
            f"{r['achieved_over_available']:>8.2f}{r['ttft_p50_s']:>10.2f}"
            f"{r['ttft_p90_s']:>9.2f}{r['ttft_p99_s']:>9.2f}"
            f"{r['work_tokens_per_trace_s']:>10.0f}{r['queue_delay_p99_s']:>11.1f}"
            f"{r['overcommits']:>8}{r['rank_refusals']:>8}"
        )
    lines.append(
        f"references: infinite cache {100 * refs['infinite']:.1f}%, one LRU of the "
        f"cluster's GPU capacity {100 * refs['lru']:.1f}% (of prompt blocks)"
    )
    by = {r["router"]: r for r in rows}
    p, a = by.get("precise_prefix"), by.get("approx_prefix")
    if p and a and a["ttft_p90_s"] > 0:
        hit_ratio = p["hit_rate_achieved"] / max(1e-9, a["hit_rate_achieved"])
        lines.append(
            f"precise_prefix / approx_prefix: TTFT p90 {p['ttft_p90_s'] / a['ttft_p90_s']:.2f} "
            f"(goal <= 0.5), hit rate {hit_ratio:.2f}; "
            f"precise achieved/available {p['achieved_over_available']:.2f} (goal >= 0.8)"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], refs: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["router"] for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.38
    ax1.bar(
        [i - w / 2 for i in x],
        [100 * r["hit_rate_achieved"] for r in rows],
        w,
        label="achieved (GPU + host)",
    )
    ax1.bar(
        [i + w / 2 for i in x],
        [100 * r["hit_rate_available"] for r in rows],
        w,
        label="available at arrival",
    )
    ax1.axhline(100 * refs["infinite"], ls="--", c="k", lw=1, label="infinite cache")
    ax1.axhline(100 * refs["lru"], ls=":", c="k", lw=1, label="one LRU of cluster capacity")
    ax1.set_ylabel("prompt blocks reused %")
    ax1.set_xticks(list(x), names, rotation=15)
    ax1.legend(fontsize=8)
    for k, q in enumerate(("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")):
        ax2.bar([i + (k - 1) * 0.27 for i in x], [r[q] for r in rows], 0.27, label=q[5:8])
    ax2.set_ylabel("time to first token (trace s)")
    ax2.set_yscale("symlog", linthresh=0.1)
    ax2.set_xticks(list(x), names, rotation=15)
    ax2.legend(fontsize=8)
    fig.suptitle(f"kvfold compare: {title}", fontsize=10)  # what was replayed, on what
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
