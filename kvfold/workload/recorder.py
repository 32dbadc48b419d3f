"""ReplayRecorder: what a replay measured, as counts, samples, a CSV and a PNG. Pure; no Ray."""

from __future__ import annotations

import csv
import statistics
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from kvfold.view import ClusterView, SourceState


@dataclass(frozen=True, slots=True)
class NodeSample:
    node: int
    state: str
    gpu_usage: float  # 0.0-1.0 over fresh ranks; NaN when the node is not fresh (unknown)
    gpu_used: int
    gpu_total: int
    host_used: int
    host_total: int
    fresh_ranks: int
    running: int


@dataclass(frozen=True, slots=True)
class Sample:
    wall_s: float
    trace_s: float
    version: int
    queued: int
    in_flight: int
    nodes: tuple[NodeSample, ...]


def sample_view(
    view: ClusterView, wall_s: float, trace_s: float, queued: int, in_flight: int
) -> Sample:
    nodes = []
    for n in view.nodes:
        i, s = n.node, n.state
        fresh = s is SourceState.FRESH
        g = n.gpu_total
        h = n.host
        nodes.append(
            NodeSample(
                node=i,
                state=s.value,
                gpu_usage=g.usage if fresh else float("nan"),
                gpu_used=g.num_blocks_used,
                gpu_total=g.num_blocks_total,
                host_used=h.num_blocks_used if h else 0,
                host_total=h.num_blocks_total if h else 0,
                fresh_ranks=n.num_ranks_fresh,
                running=n.num_valid_sequences,
            )
        )
    return Sample(wall_s, trace_s, view.version, queued, in_flight, tuple(nodes))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class ReplayRecorder:
    num_requests: int = 0
    admitted: int = 0
    rejected: int = 0
    completed: int = 0
    ever_queued: int = 0
    queue_decisions: int = 0
    schedulers: int = 1
    rank_refusals: int = 0  # placements a rank refused: they would have over-committed it
    overcommits: int = 0  # GUARANTEED_NO_EVICT sequences that could not grow: must be 0
    decode_stalls: int = 0  # a running sequence could not grow in a step
    preemptions: int = 0  # sequences whose blocks were released, to be recomputed
    restarted: int = 0  # lost their KV (their rank failed or restarted): decided again
    failed: int = 0  # admitted once, then could run nowhere any more
    failures: Counter[str] = field(default_factory=Counter)  # why, per failed request
    faults: Counter[str] = field(default_factory=Counter)  # what the driver met, by kind
    unfinished: dict[str, Any] = field(default_factory=dict)  # left when a wall limit hit
    admitted_tokens: int = 0  # prompt + max new tokens of every completed request
    last_completion_trace_s: float = 0.0
    queue_delays_s: list[float] = field(default_factory=list)  # trace seconds
    ttft_s: dict[str, float] = field(default_factory=dict)  # per request, trace seconds
    prompt_blocks: int = 0  # full prompt blocks of every request that arrived
    available_blocks: int = 0  # ... that one rank (GPU, then host) held at arrival
    achieved_blocks: int = 0  # ... reused on the GPU or onboarded, when placed
    achieved_gpu_blocks: int = 0  # ... reused on the GPU
    decisions: Counter[str] = field(default_factory=Counter)
    samples: list[Sample] = field(default_factory=list)
    sample_every_s: float = 0.0  # trace seconds between samples, when the driver keeps up
    step_interval_s: float = 0.0  # the driver's wall-clock budget for one step
    step_wall_s: list[float] = field(default_factory=list)  # what each step took
    wall_s: float = 0.0
    final: dict[str, Any] = field(default_factory=dict)

    def finish(self, view: ClusterView, wall_s: float) -> None:
        c = view.counters.total
        host = view.host
        self.wall_s = wall_s
        self.final = {
            "gpu_hit_rate": c.hit_rate,
            "hit_rate_with_host": c.hit_rate_with_host,
            "reused_blocks": c.reused_blocks,
            "missed_blocks": c.missed_blocks,
            "onboarded_blocks": c.onboarded_blocks,
            "offloaded_blocks": c.offloaded_blocks,
            "evicted_blocks": c.evicted_blocks,
            "host_dropped_blocks": host.dropped_blocks,
            "view_version": view.version,
        }

    def summary(self) -> dict[str, Any]:
        d = self.queue_delays_s
        peak = [
            max((n.gpu_usage for n in s.nodes if n.gpu_usage == n.gpu_usage), default=0.0)
            for s in self.samples
        ]
        used = [
            sum(n.gpu_used for n in s.nodes if n.state == "fresh")
            / max(1, sum(n.gpu_total for n in s.nodes if n.state == "fresh"))
            for s in self.samples
        ]
        span = self.last_completion_trace_s
        ttft = list(self.ttft_s.values())
        steps = self.step_wall_s
        over = [t for t in steps if t > self.step_interval_s]
        gaps = self.gaps()
        return {
            "schedulers": self.schedulers,
            "requests": self.num_requests,
            "admitted": self.admitted,
            "rejected": self.rejected,
            "completed": self.completed,
            "ever_queued": self.ever_queued,
            "queue_decisions": self.queue_decisions,
            "queue_delay_p50_s": _pct(d, 0.5),
            "queue_delay_p99_s": _pct(d, 0.99),
            "queue_delay_mean_s": statistics.fmean(d) if d else 0.0,
            "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p90_s": _pct(ttft, 0.9),
            "ttft_p99_s": _pct(ttft, 0.99),
            "prompt_blocks": self.prompt_blocks,
            "hit_rate_achieved": self.achieved_blocks / max(1, self.prompt_blocks),
            "hit_rate_achieved_gpu": self.achieved_gpu_blocks / max(1, self.prompt_blocks),
            "hit_rate_available": self.available_blocks / max(1, self.prompt_blocks),
            "achieved_over_available": self.achieved_blocks / max(1, self.available_blocks),
            "overcommits": self.overcommits,
            "rank_refusals": self.rank_refusals,
            "rank_refusal_rate": self.rank_refusals / max(1, self.admitted + self.rank_refusals),
            "decode_stalls": self.decode_stalls,
            "preemptions": self.preemptions,
            "restarted": self.restarted,
            "failed": self.failed,
            "failures": dict(self.failures),
            "faults": dict(self.faults),
            "unfinished": dict(self.unfinished),
            "peak_node_gpu_usage": max(peak, default=0.0),
            "mean_gpu_usage": statistics.fmean(used) if used else 0.0,
            "admitted_tokens": self.admitted_tokens,
            "last_completion_trace_s": span,
            "work_tokens_per_trace_s": self.admitted_tokens / span if span else 0.0,
            "decisions": dict(self.decisions),
            "driver_steps": len(steps),
            "driver_step_p50_s": _pct(steps, 0.5),
            "driver_step_max_s": max(steps, default=0.0),
            "driver_overruns": len(over),
            "sample_every_trace_s": self.sample_every_s,
            "picture_gaps": len(gaps),
            "picture_gap_max_trace_s": max((b - a for a, b in gaps), default=0.0),
            "wall_s": self.wall_s,
            **self.final,
        }

    def format_summary(self) -> str:
        s = self.summary()
        return "\n".join(
            [
                f"requests {s['requests']}: admitted {s['admitted']}, rejected {s['rejected']}, "
                f"completed {s['completed']}, failed {s['failed']}, "
                f"queued at least once {s['ever_queued']}",
                f"queueing delay (trace s): p50 {s['queue_delay_p50_s']:.2f}, "
                f"p99 {s['queue_delay_p99_s']:.2f}, mean {s['queue_delay_mean_s']:.2f}",
                f"time to first token (trace s, simulated engine): p50 {s['ttft_p50_s']:.2f}, "
                f"p90 {s['ttft_p90_s']:.2f}, p99 {s['ttft_p99_s']:.2f}",
                f"prompt blocks reused or onboarded {100 * s['hit_rate_achieved']:.1f}% "
                f"(GPU {100 * s['hit_rate_achieved_gpu']:.1f}%) of {s['prompt_blocks']}; "
                f"held somewhere at arrival {100 * s['hit_rate_available']:.1f}% "
                f"(achieved/available {s['achieved_over_available']:.2f})",
                f"GPU prefix hit rate {100 * s.get('gpu_hit_rate', 0):.1f}%, with host tier "
                f"{100 * s.get('hit_rate_with_host', 0):.1f}% (reused {s.get('reused_blocks', 0)}, "
                f"onboarded {s.get('onboarded_blocks', 0)}, missed {s.get('missed_blocks', 0)} "
                "blocks)",
                f"host tier: offloaded {s.get('offloaded_blocks', 0)}, dropped unread "
                f"{s.get('host_dropped_blocks', 0)} blocks",
                f"schedulers {s['schedulers']}: over-commits {s['overcommits']} (must be 0), "
                f"rank refusals {s['rank_refusals']} "
                f"({100 * s['rank_refusal_rate']:.2f}% of placements), "
                f"decode stalls {s['decode_stalls']}, preemptions {s['preemptions']}",
                f"faults met {s['faults'] or 'none'}; restarted {s['restarted']} requests"
                + (f", failures {s['failures']}" if s["failures"] else ""),
                f"GPU usage mean {100 * s['mean_gpu_usage']:.1f}%, peak node "
                f"{100 * s['peak_node_gpu_usage']:.1f}%; work {s['work_tokens_per_trace_s']:.0f} "
                f"tokens per trace s; wall {s['wall_s']:.1f} s",
                f"driver: {s['driver_steps']} steps, median {1000 * s['driver_step_p50_s']:.0f} ms "
                f"(budget {1000 * self.step_interval_s:.0f} ms); overran its step "
                f"{s['driver_overruns']} times, longest {s['driver_step_max_s']:.2f} s; "
                f"{s['picture_gaps']} gaps in the picture, longest "
                f"{s['picture_gap_max_trace_s']:.1f} trace s",
            ]
        )

    def plot_rows(self) -> tuple[list[float], list[Sample | None]]:
        """The samples to draw, in trace time, with None after each one a gap follows:
        a NaN point there breaks the line, so an unsampled stretch is never drawn."""
        gap_after = {a for a, _ in self.gaps()}
        rows: list[Sample | None] = []
        t: list[float] = []
        for sample in self.samples:
            rows.append(sample)
            t.append(sample.trace_s)
            if sample.trace_s in gap_after:
                rows.append(None)
                t.append(sample.trace_s)
        return t, rows

    def gaps(self) -> list[tuple[float, float]]:
        """Stretches of trace time the driver could not sample: consecutive samples more
        than twice the sample interval apart (drawn as gaps, never as lines)."""
        limit = 2 * self.sample_every_s
        t = [s.trace_s for s in self.samples]
        return [(a, b) for a, b in pairwise(t) if limit and b - a > limit]

    def write_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(
                [
                    "wall_s",
                    "trace_s",
                    "version",
                    "queued",
                    "in_flight",
                    "node",
                    "state",
                    "gpu_usage",
                    "gpu_used",
                    "gpu_total",
                    "host_used",
                    "host_total",
                    "fresh_ranks",
                    "running",
                ]
            )
            for s in self.samples:
                for n in s.nodes:
                    row = [f"{s.wall_s:.3f}", f"{s.trace_s:.3f}", s.version, s.queued, s.in_flight]
                    row += [n.node, n.state, f"{n.gpu_usage:.4f}", n.gpu_used, n.gpu_total]
                    row += [n.host_used, n.host_total, n.fresh_ranks, n.running]
                    w.writerow(row)

    def write_png(self, path: str | Path, title: str = "kvfold: node utilization") -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        nodes = sorted({n.node for s in self.samples for n in s.nodes})
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        t, rows = self.plot_rows()
        nan = float("nan")
        for node in nodes:
            mine = [
                next((n for n in row.nodes if n.node == node), None) if row else None
                for row in rows
            ]
            gpu = [100 * n.gpu_usage if n else nan for n in mine]  # gaps: not fresh, unsampled
            host = [100 * n.host_used / n.host_total if n and n.host_total else nan for n in mine]
            # dots: the samples themselves (one alone between two gaps has no line)
            ax1.plot(t, gpu, marker=".", markersize=3, label=f"node {node}")
            ax2.plot(t, host, marker=".", markersize=3, label=f"node {node}")
        ax1.set_ylabel("GPU KV used %\n(gaps: not fresh, or not sampled)")
        ax2.set_ylabel("host KV used %")
        ax2.set_xlabel("trace time (s)")
        ax1.set_ylim(0, 105)
        ax2.set_ylim(0, 105)
        ax1.legend(loc="upper right", fontsize=8)
        s = self.summary()
        ax1.set_title(
            f"{title}\nadmitted {s['admitted']}/{s['requests']}, over-commits {s['overcommits']}, "
            f"hit rate {100 * s.get('gpu_hit_rate', 0):.1f}% (+host "
            f"{100 * s.get('hit_rate_with_host', 0):.1f}%); driver overran "
            f"{s['driver_overruns']} of {s['driver_steps']} steps, {s['picture_gaps']} gaps",
            fontsize=10,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
