"""Fleet scale: N nodes x 8 ranks at a 100 ms interval, with their block events, on one
cluster view, without N x 8 actors (kvfold.workload.fleet_load stands in for them).

Against the real ClusterAggregator actor, three ways of sending, measured in the same run:

  direct     the path before coalescing: per node and interval, one node report and one
             call per rank's batch of block events (every rank publishing to the aggregator)
  coalesced  one call per node and interval, carrying the report and its ranks'
             batches (ClusterAggregator.node_push, as node actors send them)
  racked     the same calls to rack actors of --per-rack nodes (RackAggregator), each
             keeping its nodes' shard of the block index and forwarding their reports
             twice per interval (launch(nodes_per_rack=...)); the reader follows every
             shard (kvfold.aggregator.client.IndexClient)

Load driver actors generate and send; a reader actor runs an AdmissionController with
precise routing that refreshes every 50 ms and decides continuously: for the first half of
the run with the refresh in its deciding thread (what the columns below measure), for the
second with it in a thread of the controller's own (decisions a second, decide()'s
p99.9, and what the thread costs: its index lag p99 and capacity refresh time). Printed
per N and way:
- the aggregator's CPU (fraction of a core), and the busiest rack's (racked);
- push answers (p50/p99 ms; racked: the rack's, events ingested), pushes late or refused;
- view age at the reader: now minus the send of the newest report folded into a whole
  view it takes every fourth refresh, just before the capacity it decides on (as new or
  newer);
- index lag: a probe block's send to its visibility in the reader's replica;
- sources out of sync at the end (events lost and not yet resynchronised);
- the reader's refresh: its capacity (kvfold.aggregator.capacity_delta), time and bytes,
  with the index; a whole view's (what a display reads); decisions per second.

    python benchmarks/bench_scale.py [--nodes 16,32,64,128] [--seconds 8] [--events 200]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _report import info, percentile, report

from kvfold.cluster import start_local_cluster  # imports no Ray: see main()

INTERVAL_S = 0.1
RANKS_PER_NODE = 8
PROFILE = bool(os.environ.get("KVFOLD_PROFILE_READER"))


class LoadDriver:
    """Sends what nodes [lo, hi) of the fleet send, every interval, one way or the other."""

    def __init__(
        self, lo: int, hi: int, num_nodes: int, events_per_rank_s: float, aggregator: Any,
        epoch: float, racks: list[Any], nodes_per_rack: int,
    ) -> None:  # fmt: skip
        from kvfold.workload.fleet_load import FleetSlice, LoadShape

        shape = LoadShape(ranks_per_node=RANKS_PER_NODE, events_per_rank_s=events_per_rank_s)
        self.slice = FleetSlice(range(lo, hi), num_nodes, shape, seed=lo, epoch_unix_s=epoch)
        self.agg = aggregator
        self.racks, self.nodes_per_rack = racks, nodes_per_rack

    def run(self, mode: str, seconds: float) -> dict[str, Any]:
        import ray

        pending: dict[Any, float] = {}
        answer_s: list[float] = []
        late = refused = ticks = calls = batches = 0
        verdicts: dict[str, int] = {}
        start = time.monotonic()
        due = start
        while time.monotonic() - start < seconds:
            due += INTERVAL_S
            for node, report_bytes, envelopes in self.slice.tick(INTERVAL_S, time.time()):
                sent = time.monotonic()
                batches += len(envelopes)
                if mode == "racked":
                    rack = self.racks[node // self.nodes_per_rack]
                    pending[rack.node_push.remote(report_bytes, envelopes)] = sent
                    calls += 1
                elif mode == "coalesced":
                    pending[self.agg.node_push.remote(report_bytes, envelopes)] = sent
                    calls += 1
                else:
                    pending[self.agg.node_report.remote(report_bytes)] = sent
                    for env in envelopes:
                        pending[self.agg.block_events.remote(env)] = sent
                    calls += 1 + len(envelopes)
            ticks += 1
            if time.monotonic() > due:
                late += 1  # this driver could not send an interval's load within it
                due = time.monotonic()
            while pending:  # answers as they come, until the next interval is due
                left = due - time.monotonic()
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
                if not ready:
                    break
                answer_s.append(time.monotonic() - pending.pop(ready[0]))
                for v in _verdicts(ray.get(ready[0])):
                    verdicts[v] = verdicts.get(v, 0) + 1
            left = due - time.monotonic()
            if left > 0:
                time.sleep(left)
        for ref in list(pending):  # what is still in flight after the run is counted
            try:
                for v in _verdicts(ray.get(ref, timeout=30)):
                    verdicts[v] = verdicts.get(v, 0) + 1
                answer_s.append(time.monotonic() - pending.pop(ref))
            except ray.exceptions.GetTimeoutError:
                refused += 1
        refused += sum(n for v, n in verdicts.items() if v == "refused")
        return {
            "ticks": ticks, "late": late, "calls": calls, "batches": batches, "answer_s": answer_s,
            "refused": refused, "verdicts": verdicts,
        }  # fmt: skip


def _verdicts(answer: Any) -> list[str]:
    if isinstance(answer, tuple):  # node_push: (report verdict, [batch verdicts])
        return [answer[0], *answer[1]]
    return [answer]


class Reader:
    """A controller following the aggregator (capacity as deltas, the index as ops),
    deciding continuously with precise routing."""

    def __init__(self, aggregator: Any, world_size: int, epoch: float, namespace: str) -> None:
        self.agg = aggregator
        self.world_size = world_size
        self.epoch = epoch
        self.namespace = namespace

    def run(self, seconds: float) -> dict[str, Any]:
        import ray

        from kvfold.admission import AdmissionController, AdmissionRequest
        from kvfold.aggregator.capacity_delta import CapacityReader
        from kvfold.aggregator.view_delta import ViewReader
        from kvfold.blockindex.client import IndexClient
        from kvfold.kvevents.events import BlockStored
        from kvfold.workload.fleet_load import SHARED_TAG, probe_sent_s, report_sent_s

        reader = ViewReader()
        nbytes: list[int] = []
        refresh_s: list[float] = []
        view_age_s: list[float] = []
        lag_s: list[float] = []
        view_s: list[float] = []
        in_background = [False]  # which phase the samples below belong to
        lag_bg_s: list[float] = []  # the index lag while the refresh is in its own thread
        view_bg_s: list[float] = []  # and the capacity refresh's time
        view_bytes: list[int] = []
        view_cpu_s: list[float] = []  # this thread's CPU in it: the wall less the waits
        full_s: list[float] = []
        full_bytes: list[int] = []
        index_bytes: list[int] = []

        def ask(method: str, at: Any, *args: Any) -> tuple[Any, int]:
            """Follow a reader (views or capacity) to the aggregator's current version."""
            total = 0
            while True:
                asked = at.position
                data = ray.get(getattr(self.agg, method).remote(asked, *args))
                total += len(data or b"")
                got = at.apply(data, asked)
                if got is not None:
                    return got, total

        class Source:  # what the controller decides on: the view's capacity, as deltas
            def __init__(self) -> None:
                self.reader = CapacityReader()  # one per controller id

            def capacity(self, controller_id: str) -> Any:
                t0, c0 = time.perf_counter(), time.thread_time()
                got, n = ask("capacity_since", self.reader, controller_id)
                if in_background[0]:  # the columns are the in-line phase's
                    view_bg_s.append(time.perf_counter() - t0)
                    return got
                view_s.append(time.perf_counter() - t0)
                view_cpu_s.append(time.thread_time() - c0)
                view_bytes.append(n)
                return got

            def view(self) -> Any:
                raise AssertionError("the controller reads capacity here")

        keepers = IndexClient(self.namespace)  # the aggregator, or each rack's shard

        def index_since(cursor: Any) -> Any:
            now, ops, whole = keepers.since(cursor)
            if not in_background[0]:  # the columns are the in-line phase's
                index_bytes.append(keepers.last_answer_bytes)
            if not whole:
                seen = time.time()
                for op in ops:
                    if op[0] != "apply":
                        continue
                    for e in op[2]:
                        if isinstance(e, BlockStored) and len(e.block_hashes) == 1:
                            sent = probe_sent_s(e.block_hashes[0])
                            if sent is not None:
                                (lag_bg_s if in_background[0] else lag_s).append(seen - sent)
            return now, ops, whole

        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        decisions = {False: 0, True: 0}  # per phase: refresh in the decider's thread, or not
        decide_s: dict[bool, list[float]] = {False: [], True: []}
        phase_s = {}
        i = ticks = 0  # decisions; refresh intervals (a display's read every fourth)
        # the first half refreshes in line (every 50 ms, timed, and counted in the decision
        # after it, as a decide() that refreshes itself waits); the second in a thread of
        # the controller's own, under the same load: decisions a second and decide()'s tail
        for background in (False, True):
            ctl = AdmissionController(
                Source(), index_source=index_since, router="precise_prefix",
                refresh_interval_s=0.05 if background else 1e9, refresh_in_background=background,
            )  # fmt: skip
            if background:
                in_background[0] = True
                ctl.wait_for_view(30.0)
            start = time.monotonic()
            next_refresh = start
            stalled = 0.0  # an in-line refresh: the next decision waited for it
            while time.monotonic() - start < seconds / 2:
                now = time.monotonic()
                if now >= next_refresh:
                    next_refresh = now + 0.05
                    ticks += 1
                    if ticks % 4 == 1:  # the whole view, for its age: a display's read
                        t0 = time.perf_counter()
                        view, n = ask("view_since", reader)
                        full_s.append(time.perf_counter() - t0)
                        full_bytes.append(n)
                        stamps = [
                            n.ranks[0].num_refused for n in view.nodes if n.ranks[0].incarnation
                        ]
                        if stamps and not background:  # from the send of the newest report in it
                            # (fleet_load); the capacity decided on next is as new or newer
                            view_age_s.append(time.time() - report_sent_s(max(stamps), self.epoch))
                    if not background:
                        t0 = time.perf_counter()
                        if PROFILE:
                            prof.enable()
                        ctl.refresh(force=True)
                        if PROFILE:
                            prof.disable()
                        refresh_s.append(time.perf_counter() - t0)
                        stalled = refresh_s[-1]
                        nbytes.append(view_bytes[-1] + index_bytes[-1] if index_bytes else 0)
                i += 1
                p = i % 64
                keys = tuple(SHARED_TAG | (p << 16) | b for b in range(8))
                req = AdmissionRequest(f"r{i}", 8 * 16 + 5, 64, prefix_keys=keys)  # type: ignore[arg-type]
                t0 = time.perf_counter()
                ctl.decide(req)
                decide_s[background].append(time.perf_counter() - t0 + stalled)
                stalled = 0.0
                ctl.release(req.request_id)
                decisions[background] += 1
            phase_s[background] = time.monotonic() - start
            ctl.close()
        out = io.StringIO()
        if PROFILE:
            pstats.Stats(prof, stream=out).sort_stats("cumtime").print_stats(25)
        return {
            "profile": out.getvalue()[:8000] if PROFILE else "",
            "decisions_per_s": decisions[False] / phase_s[False],
            "decisions_per_s_bg": decisions[True] / phase_s[True],
            "decide_p999_ms": 1e3 * percentile(decide_s[False], 0.999),
            "decide_p999_ms_bg": 1e3 * percentile(decide_s[True], 0.999),
            "refresh_s": refresh_s, "bytes": nbytes, "view_s": view_s,
            "view_bytes": view_bytes, "index_bytes": index_bytes, "view_age_s": view_age_s,
            "full_s": full_s, "full_bytes": full_bytes, "view_cpu_s": view_cpu_s,
            "lag_s": lag_s, "lag_bg_s": lag_bg_s, "view_bg_s": view_bg_s,
            "index_error": ctl.index_error, "view_error": ctl.view_error,
        }  # fmt: skip


def run_one(
    num_nodes: int, mode: str, seconds: float, events: float, drivers: int, per_rack: int
) -> dict:
    import ray

    from kvfold.aggregator.cluster_actor import ClusterAggregator
    from kvfold.aggregator.rack_actor import (
        RACK_CONCURRENCY_GROUPS,
        RACK_MAX_CONCURRENCY,
        RackAggregator,
    )
    from kvfold.naming import AGGREGATOR_NAME, rack_actor_name

    world = num_nodes * RANKS_PER_NODE
    ns = f"kvfold-scale-{mode}-{num_nodes}"
    agg_cls = ray.remote(concurrency_groups={"reports": 1, "events": 1})(ClusterAggregator)
    rank_to_node = [n for n in range(num_nodes) for _ in range(RANKS_PER_NODE)]
    agg = agg_cls.options(
        name=AGGREGATOR_NAME, num_cpus=0, namespace=ns, max_concurrency=32
    ).remote(
        rank_to_node,
        [None],
        namespace=ns,
        report_interval_s=INTERVAL_S,
        stale_after_s=3 * INTERVAL_S,
        dead_after_s=30 * INTERVAL_S,
        verify_sources=False,
        nodes_per_rack=per_rack if mode == "racked" else 0,  # racks keep the index then
    )
    nan = float("nan")
    racks = []
    if mode == "racked":  # named as launch names them: they find the aggregator by name
        rack_cls = ray.remote(concurrency_groups=RACK_CONCURRENCY_GROUPS)(RackAggregator)
        racks = [
            rack_cls.options(
                name=rack_actor_name(i), namespace=ns, num_cpus=0,
                max_concurrency=RACK_MAX_CONCURRENCY,
            ).remote(i, rank_to_node, namespace=ns, report_interval_s=INTERVAL_S)
            for i in range(-(-num_nodes // per_rack))
        ]  # fmt: skip
    epoch = time.time()
    bounds = [num_nodes * d // drivers for d in range(drivers + 1)]
    load = [
        ray.remote(LoadDriver)
        .options(num_cpus=0)
        .remote(lo, hi, num_nodes, events, agg, epoch, racks, per_rack)
        for lo, hi in itertools.pairwise(bounds)
    ]
    reader = ray.remote(Reader).options(num_cpus=0).remote(agg, world, epoch, ns)
    ray.get(agg.ping.remote())
    keepers = racks or [agg]  # who keeps the block index: the racks' shards, or the aggregator

    def applied() -> int:
        return sum(c["applied"] for c in ray.get([k.block_index_counts.remote() for k in keepers]))

    applied0 = applied()
    ray.get([r.ping.remote() for r in racks])
    cpu0, t0 = ray.get(agg.cpu_seconds.remote()), time.monotonic()
    rack0 = ray.get([r.cpu_seconds.remote() for r in racks])
    runs = [d.run.remote(mode, seconds) for d in load]
    read = reader.run.remote(seconds)
    time.sleep(seconds)  # the window: what the aggregator did while the load was offered
    cpu1, t1 = ray.get(agg.cpu_seconds.remote()), time.monotonic()
    rack1 = ray.get([r.cpu_seconds.remote() for r in racks])
    applied1 = applied()
    outs = ray.get(runs)  # the drivers wait for their last answers
    r = ray.get(read)
    oos = sum(
        len(c["out_of_sync"]) for c in ray.get([k.block_index_counts.remote() for k in keepers])
    )
    rack_cpu = [(b - a) / (t1 - t0) for a, b in zip(rack0, rack1, strict=True)]
    for a in [agg, reader, *load, *racks]:
        ray.kill(a)
    answers = [s for o in outs for s in o["answer_s"]]
    return {
        "nodes": num_nodes,
        "mode": mode,
        "agg_cpu": (cpu1 - cpu0) / (t1 - t0),
        "rack_cpu_max": max(rack_cpu, default=float("nan")),  # the busiest rack (index shard)
        "calls_per_s": sum(o["calls"] for o in outs) / seconds,
        # event batches offered by the drivers, and applied by the index in the window
        "offered_per_s": sum(o["batches"] for o in outs) / seconds,
        "applied_per_s": (applied1 - applied0) / (t1 - t0),
        "answer_p50_ms": 1e3 * statistics.median(answers) if answers else float("nan"),
        "answer_p99_ms": 1e3 * percentile(answers, 0.99) if answers else float("nan"),
        "late_ticks": sum(o["late"] for o in outs),
        "ticks": sum(o["ticks"] for o in outs),
        "refused": sum(o["refused"] for o in outs),
        "out_of_sync": oos,
        "view_age_p50_ms": 1e3 * statistics.median(r["view_age_s"] or [nan]),
        "view_age_p99_ms": 1e3 * percentile(r["view_age_s"] or [nan], 0.99),
        "lag_p50_ms": 1e3 * statistics.median(r["lag_s"]) if r["lag_s"] else float("nan"),
        "lag_p99_ms": 1e3 * percentile(r["lag_s"], 0.99) if r["lag_s"] else float("nan"),
        "refresh_p50_ms": 1e3 * statistics.median(r["refresh_s"]),
        "refresh_p99_ms": 1e3 * percentile(r["refresh_s"], 0.99),
        "bytes_p50": statistics.median(r["bytes"]),
        "view_p50_ms": 1e3 * statistics.median(r["view_s"]),
        "view_kib": statistics.median(r["view_bytes"]) / 1024,
        "view_cpu_p50_ms": 1e3 * statistics.median(r["view_cpu_s"]),
        "full_p50_ms": 1e3 * statistics.median(r["full_s"] or [nan]),
        "full_kib": statistics.median(r["full_bytes"] or [nan]) / 1024,
        "index_kib": statistics.median(r["index_bytes"]) / 1024,
        "decisions_per_s": r["decisions_per_s"],
        "decisions_per_s_bg": r["decisions_per_s_bg"],
        "lag_p99_ms_bg": 1e3 * percentile(r["lag_bg_s"] or [nan], 0.99),
        "view_p50_ms_bg": 1e3 * statistics.median(r["view_bg_s"] or [nan]),
        "decide_p999_ms": r["decide_p999_ms"],
        "decide_p999_ms_bg": r["decide_p999_ms_bg"],
        "errors": [e for e in (r["index_error"], r["view_error"]) if e],
        "profile": r["profile"],
    }


COLUMNS = (
    ("nodes", "{:>6}"), ("mode", "{:>10}"), ("agg_cpu", "{:>8.2f}"), ("rack_cpu_max", "{:>8.2f}"),
    ("calls_per_s", "{:>9.0f}"),
    ("offered_per_s", "{:>8.0f}"), ("applied_per_s", "{:>8.0f}"),
    ("answer_p50_ms", "{:>8.1f}"), ("answer_p99_ms", "{:>8.1f}"), ("late_ticks", "{:>5}"),
    ("refused", "{:>5}"), ("out_of_sync", "{:>5}"), ("view_age_p50_ms", "{:>8.0f}"),
    ("view_age_p99_ms", "{:>8.0f}"), ("lag_p50_ms", "{:>8.0f}"), ("lag_p99_ms", "{:>8.0f}"),
    ("refresh_p50_ms", "{:>8.2f}"), ("view_p50_ms", "{:>8.2f}"), ("view_cpu_p50_ms", "{:>8.2f}"),
    ("view_kib", "{:>8.1f}"),
    ("index_kib", "{:>8.1f}"), ("full_p50_ms", "{:>8.2f}"), ("full_kib", "{:>8.1f}"),
    ("decisions_per_s", "{:>8.0f}"), ("decisions_per_s_bg", "{:>8.0f}"),
    ("decide_p999_ms", "{:>8.2f}"), ("decide_p999_ms_bg", "{:>8.2f}"),
    ("lag_p99_ms_bg", "{:>8.0f}"), ("view_p50_ms_bg", "{:>8.2f}"),
)  # fmt: skip
HEADS = (
    "nodes", "way", "aggCPU", "rackCPU", "calls/s", "offer/s", "apply/s", "ans p50", "ans p99",
    "late", "refus", "oos",
    "age p50", "age p99", "lag p50", "lag p99", "refr p50", "cap p50", "cap CPU", "cap KiB",
    "idx KiB", "full p50", "full KiB", "dec/s", "dec/s bg", "dec p999", "p999 bg",
    "lag99 bg", "cap bg",
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="16,32,64", help="comma-separated N (8 ranks each)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--events", type=float, default=200.0, help="block events per rank per s")
    ap.add_argument("--drivers", type=int, default=1, help="load driver processes")
    ap.add_argument("--per-rack", type=int, default=32, help="nodes per rack actor (racked)")
    args = ap.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    cluster = start_local_cluster(1, 1, cpus_per_node=2)
    rows = []
    try:
        print(" ".join(f"{h:>8}" for h in HEADS))
        for n in sizes:
            for mode in ("direct", "coalesced", "racked"):
                row = run_one(n, mode, args.seconds, args.events, args.drivers, args.per_rack)
                rows.append(row)
                print(" ".join(fmt.format(row[k]) for k, fmt in COLUMNS), flush=True)
                if row["profile"]:
                    print(row["profile"])
                if row["errors"]:
                    print("   reader errors:", row["errors"])
    finally:
        cluster.shutdown()
    interval_ms = INTERVAL_S * 1e3
    for row in rows:
        n, way = row["nodes"], row["mode"]
        info(f"N={n}: aggregator CPU per node, {way} (ms/s)", 1e3 * row["agg_cpu"] / n, "ms")
        if way == "direct":
            continue
        report(f"N={n}: view age p99, {way}", row["view_age_p99_ms"], "ms", 2 * interval_ms)
        report(f"N={n}: index lag p99, {way}", row["lag_p99_ms"], "ms", 2 * interval_ms)
        report(f"N={n}: controller's capacity refresh p50, {way}", row["view_p50_ms"], "ms", 2.0)
        info(
            f"  of which this thread's CPU (the rest: the call's wait), {way}",
            row["view_cpu_p50_ms"],
            "ms",
        )
        report(f"N={n}: its bytes p50, {way}", row["view_kib"], "KiB", 64)
        info(f"N={n}: a whole view's refresh p50 (display), {way}", row["full_p50_ms"], "ms")
        info(f"N={n}: reader refresh p50 with the index, {way}", row["refresh_p50_ms"], "ms")
        info(f"N={n}: decisions a second, refresh in line, {way}", row["decisions_per_s"], "/s")
        info(
            f"  refresh in a thread of its own: ratio to in line, {way}",
            row["decisions_per_s_bg"] / row["decisions_per_s"],
            "x",
        )
        info(f"N={n}: decide() p99.9, refresh in line, {way}", row["decide_p999_ms"], "ms")
        info(
            f"  refresh in a thread of its own: ratio to in line, {way}",
            row["decide_p999_ms_bg"] / row["decide_p999_ms"],
            "x",
        )


if __name__ == "__main__":
    main()
