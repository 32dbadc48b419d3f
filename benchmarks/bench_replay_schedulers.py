"""One scheduler against four in four processes, on the same trace and the same cluster.

Replays a Mooncake trace (the first --limit requests of --trace; by default the 500 of
tests/fixtures/traces, Mooncake's whole synthetic_trace.jsonl for the full run) on an
embedded cluster (3 nodes x 4 simulated GPUs, world size 10, 4,096 blocks of 64 tokens
per rank, as `kvfold replay` has them) with 1 scheduler, then
with 4 holding leases and claims beyond them, 4 with leases taking a whole room beyond
them (`--no-claims`), then 4 optimistic ones (no leases: the rank's refusal is the only
guard). Targets: over-commits 0; with 4 schedulers, rank refusals <= 1% of
placements, and the work done per trace second within 10% of the single scheduler's
(the baseline, measured in the same run).

    python benchmarks/bench_replay_schedulers.py [--trace F] [--limit N] [--time-scale X]
        [--num-blocks N]

The replay's trace clock follows the wall clock, so a machine busy with other work
changes the arrivals it sees: run it on a quiet machine, and compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import info, report

from kvfold.cluster import launch, start_local_cluster  # before Ray: the cluster stays closed
from kvfold.workload.scheduler import ReplayConfig

# the shipped cut (500 requests); pass --trace for Mooncake's whole synthetic_trace.jsonl
TRACE = (
    Path(__file__).resolve().parents[1] / "tests/fixtures/traces/mooncake_synthetic_first500.jsonl"
)
# (schedulers, leases, claims): the anchor first, then 4 with claims beyond their leases,
# 4 taking a whole room beyond them (the rule before claims), 4 optimistic
RUNS = ((1, True, True), (4, True, True), (4, True, False), (4, False, False))
ROWS = (
    ("schedulers", "{:d}"),
    ("leases", "{}"),
    ("claims", "{}"),
    ("admitted", "{:d}"),
    ("overcommits", "{:d}"),
    ("rank_refusals", "{:d}"),
    ("queue_delay_p50_s", "{:.1f}"),
    ("queue_delay_p99_s", "{:.1f}"),
    ("mean_gpu_usage", "{:.3f}"),
    ("work_tokens_per_trace_s", "{:.0f}"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=4000)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--num-blocks", type=int, default=4096, help="GPU blocks (64 tokens) per rank")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake .jsonl trace")
    args = ap.parse_args()
    from kvfold.worker import KVCacheConfig
    from kvfold.workload.traces import load_mooncake

    workload = load_mooncake(args.trace, limit=args.limit)
    cluster = start_local_cluster(3, 4)
    from kvfold.replay.trace_replay import replay  # imports Ray: after the cluster is configured

    rows = []
    try:
        cache = KVCacheConfig(
            tokens_per_block=64,
            num_blocks=args.num_blocks,
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            dtype="float16",
            device="auto",
        )
        kv = launch(10, 4, cache=cache, host_num_blocks=1024)
        try:
            for n, leases, claims in RUNS:
                cfg = ReplayConfig(
                    time_scale=args.time_scale,
                    decode_tokens_per_s=40.0,
                    schedulers=n,
                    leases=leases,
                    claims=claims,
                )
                s = replay(kv, workload, cfg).summary()
                s["leases"], s["claims"] = leases, claims and leases and n > 1
                rows.append(s)
                print(" ".join(f"{k} {fmt.format(s[k])}" for k, fmt in ROWS), flush=True)
        finally:
            kv.shutdown()
    finally:
        cluster.shutdown()
    one, leased, unclaimed, optimistic = rows
    for s in rows:
        how = f"leases {s['leases']}, claims {s['claims']}"
        report(
            f"over-commits, {s['schedulers']} scheduler(s), {how}",
            s["overcommits"],
            "",
            0,
        )
    placements = leased["admitted"] + leased["rank_refusals"]
    report(
        "rank refusals / placements, 4 schedulers with leases",
        100 * leased["rank_refusals"] / max(1, placements),
        "%",
        1.0,
    )
    info(
        "rank refusals / placements, 4 schedulers with leases, no claims",
        100
        * unclaimed["rank_refusals"]
        / max(1, unclaimed["admitted"] + unclaimed["rank_refusals"]),
        "%",
    )
    info(
        "rank refusals / placements, 4 optimistic schedulers",
        100
        * optimistic["rank_refusals"]
        / max(1, optimistic["admitted"] + optimistic["rank_refusals"]),
        "%",
    )
    base = one["work_tokens_per_trace_s"] or 1.0
    report(
        "work per trace s, 4 schedulers with leases / 1 scheduler",
        leased["work_tokens_per_trace_s"] / base,
        "x",
        0.9,
        lower_is_better=False,
    )
    info(
        "work per trace s, 4 schedulers with leases, no claims / 1 scheduler",
        unclaimed["work_tokens_per_trace_s"] / base,
        "x",
    )
    info(
        "work per trace s, 4 optimistic schedulers / 1 scheduler",
        optimistic["work_tokens_per_trace_s"] / base,
        "x",
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
