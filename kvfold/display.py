"""How a ClusterView is shown to people: a JSON-ready dict and a fixed-width table. Pure."""

from __future__ import annotations

import math
from typing import Any

from kvfold.stats import (
    DELTA_FIELDS,
    HOST_FIELDS,
    BlockDeltas,
    BlockGauges,
    HostStats,
    SequenceStatus,
    window_label,
)
from kvfold.view import ClusterView, NodeUtilization, SourceState


def _gauges(g: BlockGauges) -> dict[str, Any]:
    return {
        "num_blocks_total": g.num_blocks_total,
        "num_blocks_used": g.num_blocks_used,
        "num_blocks_cached": g.num_blocks_cached,
        "num_blocks_free": g.num_blocks_free,
        "num_blocks_committed": g.num_blocks_committed,
        "num_blocks_room": g.num_blocks_room,
        "usage": round(g.usage, 6),
    }


def _host(h: HostStats | None) -> dict[str, Any] | None:
    if h is None:
        return None
    out: dict[str, Any] = {f: getattr(h, f) for f in HOST_FIELDS}
    out["num_blocks_free"] = h.num_blocks_free
    return out


def _deltas(d: BlockDeltas) -> dict[str, Any]:
    out: dict[str, Any] = {f: getattr(d, f) for f in DELTA_FIELDS}
    out["hit_rate"] = round(d.hit_rate, 6)
    out["hit_rate_with_host"] = round(d.hit_rate_with_host, 6)
    return out


def _statuses(counts: Any) -> dict[str, int]:
    return {s.name: int(counts.get(s, 0)) for s in SequenceStatus}


def node_to_dict(n: NodeUtilization, state: SourceState) -> dict[str, Any]:
    return {
        "node": n.node,
        "state": state.value,
        "rank_start": n.rank_start,
        "rank_end": n.rank_end,
        "num_ranks_expected": n.num_ranks_expected,
        "num_ranks_fresh": n.num_ranks_fresh,
        "stale_ranks": list(n.stale_ranks),
        "dead_ranks": list(n.dead_ranks),
        "missing_ranks": list(n.missing_ranks),
        "gpu": {window_label(w): _gauges(g) for w, g in n.gpu.items()},
        "gpu_total": _gauges(n.gpu_total),
        "free_percent": round(n.free_percent, 3),
        "host": _host(n.host),
        "sequences": _statuses(n.num_sequences_by_status),
        "num_valid_sequences": n.num_valid_sequences,
        "counters": _deltas(n.counters.total),
        "unknown": {name: list(ranks) for name, ranks in n.unknown.items()},
        "ranks": [
            {
                "rank": r.rank,
                "state": r.state.value,
                "num_blocks_free": r.num_blocks_free,
                "num_valid_sequences": r.num_valid_sequences,
                "age_s": r.age_s if math.isfinite(r.age_s) else None,  # None: never heard from
                "num_refused": r.num_refused,
                "tickets": dict(r.tickets),
                "unknown": sorted(r.unknown),
            }
            for r in n.ranks
        ],
    }


def view_to_dict(view: ClusterView) -> dict[str, Any]:
    nodes = [node_to_dict(n, n.state) for n in view.nodes]
    return {
        "version": view.version,
        "built_at_unix_s": view.built_at_unix_s,
        "world_size": view.world_size,
        "num_nodes": view.num_nodes,
        "stale_nodes": list(view.stale_nodes),
        "dead_nodes": list(view.dead_nodes),
        "stale_ranks": list(view.stale_ranks),
        "dead_ranks": list(view.dead_ranks),
        "missing_ranks": list(view.missing_ranks),
        "totals": {
            "gpu": _gauges(view.gpu_total),
            "gpu_by_window": {window_label(w): _gauges(g) for w, g in view.gpu.items()},
            "host": _host(view.host),
            "sequences": _statuses(view.num_sequences_by_status),
            "num_valid_sequences": view.num_valid_sequences,
            "counters": _deltas(view.counters.total),
        },
        # fields some fresh ranks do not publish (engines): the totals above leave them out
        "unknown": {name: list(ranks) for name, ranks in view.unknown.items()},
        "nodes": nodes,
    }


def _bar(fraction: float, width: int = 10) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "#" * filled + "." * (width - filled)


def table_cells(view: ClusterView) -> tuple[list[str], list[list[str]], str]:
    """(column titles, one row of cells per node, the cluster's summary line): what every
    rendering of the node table shows (plain text here, rich in kvfold.live)."""
    windows = sorted(
        {w for n in view.nodes for w in n.gpu},
        key=lambda w: (w is not None, w or 0),
    )
    head = ["node", "state", "ranks", "fresh", *(f"gpu {window_label(w)}" for w in windows)]
    head += ["host used/total", "seqs", "hit%"]
    rows = []
    for n in view.nodes:
        if n.state is SourceState.MISSING:
            rows.append([str(n.node), n.state.value, "-", "", *([""] * len(windows)), "", "", ""])
            continue
        row = [str(n.node), n.state.value, f"{n.rank_start}-{n.rank_end - 1}"]
        row.append(f"{n.num_ranks_fresh}/{n.num_ranks_expected}")
        for w in windows:
            g = n.gpu.get(w, BlockGauges())
            row.append(f"{_bar(g.usage)} {g.num_blocks_used:>4}/{g.num_blocks_total:<4}")
        h = n.host
        row.append(f"{h.num_blocks_used}/{h.num_blocks_total}" if h else "off")
        row += [str(n.num_valid_sequences), f"{100 * n.counters.total.hit_rate_with_host:.1f}%"]
        rows.append(row)
    t, c = view.gpu_total, view.counters.total
    refused = sum(r.num_refused for n in view.nodes for r in n.ranks)
    summary = (
        f"cluster v{view.version}: gpu {t.num_blocks_used}/{t.num_blocks_total} used "
        f"({100 * t.usage:.1f}%), {t.num_blocks_committed} committed, "
        f"{refused} placements refused, "
        f"host {view.host.num_blocks_used}/{view.host.num_blocks_total}, "
        f"{view.num_valid_sequences} running, hit rate {100 * c.hit_rate:.1f}% "
        f"(+host {100 * c.hit_rate_with_host:.1f}%), stale ranks {list(view.stale_ranks)}, "
        f"dead ranks {list(view.dead_ranks)}"
    )
    unknown = view.unknown
    if unknown:
        summary += "; unknown: " + ", ".join(f"{k} (ranks {list(v)})" for k, v in unknown.items())
    return head, rows, summary


def render_table(view: ClusterView, title: str = "") -> str:
    """A fixed-width table of node utilization: GPU per window, host tier, sequences,
    rank freshness (for logs, `kvfold status`, and terminals that are not live)."""
    head, rows, summary = table_cells(view)
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)
    ]
    lines = [title] if title else []
    lines.append(" ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    lines += [" ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(summary)
    return "\n".join(lines)
