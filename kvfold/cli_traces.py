"""`kvfold demo`, `kvfold replay TRACE`, `kvfold compare TRACE`: workloads through
admission onto a kvfold, embedded or already up. Nothing on their path imports Ray before
the embedded cluster is configured (tests/unit/test_cli_imports.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvfold.cli_args import (
    add_cluster_args,
    auth_arg,
    cache_config,
    connect_args,
    metrics_args,
)
from kvfold.naming import DEFAULT_NAMESPACE


def _progress_hook(live: Any):  # type: ignore[no-untyped-def]
    def hook(view: Any, rec: Any, wall: float) -> None:
        t = view.gpu_total
        progress = (
            f"[{wall:6.1f}s] admitted {rec.admitted}/{rec.num_requests}, "
            f"completed {rec.completed}, "
            f"rejected {rec.rejected}, queued {rec.samples[-1].queued if rec.samples else 0}, "
            f"gpu {100 * t.usage:.1f}% used, host {view.host.num_blocks_used}/"
            f"{view.host.num_blocks_total}, over-commits {rec.overcommits}, "
            f"rank refusals {rec.rank_refusals}"
        )
        live.show(view, progress)

    return hook


def _write_outputs(rec: Any, out_dir: str, stem: str) -> tuple[Path, Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path, json_path = out / f"{stem}.csv", out / f"{stem}.png", out / f"{stem}.json"
    rec.write_csv(csv_path)
    rec.write_png(png_path, title=f"kvfold {stem}: node utilization")
    json_path.write_text(json.dumps(rec.summary(), indent=2, default=str))
    return csv_path, png_path, json_path


def _run_embedded(args: argparse.Namespace, workload: Any, stem: str, replay_cfg: Any) -> int:
    """Start an embedded cluster, launch kvfold on it, replay, and stop both."""
    from kvfold.cluster import launch, start_local_cluster

    print(
        f"kvfold: starting an embedded Ray cluster: {args.nodes} nodes x {args.gpus_per_node} "
        f"simulated GPUs ...",
        flush=True,
    )
    t0 = time.monotonic()
    cluster = start_local_cluster(args.nodes, args.gpus_per_node, namespace=DEFAULT_NAMESPACE)
    try:
        print(f"kvfold: launching world size {args.world_size} ...", flush=True)
        kv = launch(
            args.world_size,
            args.gpus_per_node,
            cache=cache_config(args),
            host_num_blocks=args.host_blocks,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
        )
        view = kv.view()
        phases = {"cluster": cluster.started_in_s, **kv.launch_phases}
        print(
            f"kvfold: up in {time.monotonic() - t0:.1f} s ("
            + ", ".join(f"{name} {s:.1f} s" for name, s in phases.items())
            + f"): {view.num_nodes} nodes expecting "
            f"{[n.num_ranks_expected for n in view.nodes]} ranks. From another terminal: "
            f"kvfold status --address {cluster.address} --namespace {DEFAULT_NAMESPACE}",
            flush=True,
        )
        try:
            return _replay_on(kv, args, workload, stem, replay_cfg)
        finally:
            kv.shutdown()
    finally:
        cluster.shutdown()


def _replay_on(kv: Any, args: argparse.Namespace, workload: Any, stem: str, cfg: Any) -> int:
    """Replay `workload` on a running kvfold; print the summary, write CSV/PNG/JSON."""
    from kvfold.display import render_table
    from kvfold.live import LiveView
    from kvfold.replay.trace_replay import replay

    url = kv.client.metrics_url()
    if url:
        print(f"kvfold: Prometheus metrics at {url}", flush=True)
    print(f"kvfold: replaying {len(workload)} requests ...", flush=True)
    live = LiveView()
    try:
        rec = replay(kv, workload, cfg, on_sample=_progress_hook(live))
    finally:
        live.close()
    print(render_table(kv.view(), title="\nfinal view"))
    print("\nsummary\n" + rec.format_summary())
    csv_path, png_path, json_path = _write_outputs(rec, args.out, stem)
    print(f"\nwrote {csv_path}, {png_path} and {json_path}")
    return 0 if rec.overcommits == 0 else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from kvfold.workload.requests import shared_prefix_workload
    from kvfold.workload.scheduler import ReplayConfig

    workload = shared_prefix_workload(
        num_requests=args.requests, duration_s=args.duration, seed=args.seed
    )
    cfg = ReplayConfig(time_scale=1.0, decode_tokens_per_s=args.decode_rate)
    return _run_embedded(args, workload, "demo", cfg)


def cmd_replay(args: argparse.Namespace) -> int:
    from kvfold.admission import Policy
    from kvfold.workload.scheduler import ReplayConfig
    from kvfold.workload.traces import load_trace

    try:
        workload = load_trace(args.trace, limit=args.limit)
    except ValueError as e:
        print(f"kvfold replay: {e}", file=sys.stderr)
        return 2
    if args.schedulers < 1:
        print(f"kvfold replay: --schedulers must be >= 1, got {args.schedulers}", file=sys.stderr)
        return 2
    cfg = ReplayConfig(
        time_scale=args.time_scale,
        decode_tokens_per_s=args.decode_rate,
        policy=Policy[args.policy.upper()],
        schedulers=args.schedulers,
        leases=args.leases,
        claims=args.claims,
        router=args.router,
        overlap_weight=args.overlap_weight,
    )
    stem = f"replay-{Path(args.trace).stem}"
    if args.schedulers > 1:
        stem += f"-{args.schedulers}-schedulers" + ("" if args.leases else "-optimistic")
        stem += "" if args.claims or not args.leases else "-no-claims"
    if args.address is None:
        return _run_embedded(args, workload, stem, cfg)
    from kvfold.aggregator.client import connect
    from kvfold.cluster.handle import KVFold
    from kvfold.errors import KVFoldError

    print(
        "kvfold replay: replaying on the kvfold running at that address (its own shape and "
        "caches; the cluster and metrics flags are for the embedded cluster)",
        flush=True,
    )
    try:  # a kvfold already up on a real cluster (`kvfold up`): replay there, leave it up
        connect(args.address, args.namespace)
        return _replay_on(KVFold.attach(args.namespace), args, workload, stem, cfg)
    except KVFoldError as e:
        print(f"kvfold replay: {e}", file=sys.stderr)
        return 2


def cmd_compare(args: argparse.Namespace) -> int:
    from kvfold.admission.routing import as_router
    from kvfold.cluster import launch, start_local_cluster
    from kvfold.workload.references import reference_hit_rates
    from kvfold.workload.scheduler import ReplayConfig
    from kvfold.workload.traces import load_trace

    try:
        workload = load_trace(args.trace, limit=args.limit)
        routers = [as_router(r.strip()) for r in args.routers.split(",")]
    except ValueError as e:
        print(f"kvfold compare: {e}", file=sys.stderr)
        return 2
    cfg = ReplayConfig(
        time_scale=args.time_scale,
        decode_tokens_per_s=args.decode_rate,
        overlap_weight=args.overlap_weight,
    )
    gpu_blocks = args.world_size * args.num_blocks
    refs = reference_hit_rates(workload, args.tokens_per_block, gpu_blocks)
    print(
        f"kvfold compare: {len(workload)} requests of {args.trace}, routers "
        f"{[r.value for r in routers]}, on an embedded cluster: {args.nodes} nodes x "
        f"{args.gpus_per_node} simulated GPUs, world {args.world_size}",
        flush=True,
    )
    cluster = start_local_cluster(args.nodes, args.gpus_per_node, namespace=DEFAULT_NAMESPACE)
    from kvfold.replay.compare import compare, format_table, write_table  # imports Ray

    try:

        def fresh() -> Any:
            return launch(
                args.world_size,
                args.gpus_per_node,
                cache=cache_config(args),
                host_num_blocks=args.host_blocks,
            )

        def done(router: str, rec: Any) -> None:
            print(f"\n== {router}\n{rec.format_summary()}", flush=True)

        rows = compare(fresh, workload, cfg, routers, on_done=done)
    finally:
        cluster.shutdown()
    print("\n" + format_table(rows, refs))
    title = (
        f"{Path(args.trace).name}, {len(workload)} requests at {args.time_scale:g}x; "
        f"world {args.world_size}, {args.num_blocks} blocks of {args.tokens_per_block} tokens"
    )
    paths = write_table(rows, refs, Path(args.out), f"compare-{Path(args.trace).stem}", title)
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return 0 if all(r["overcommits"] == 0 for r in rows) else 1


def demo_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="the whole system on an embedded local cluster")
    add_cluster_args(d, blocks=512, tpb=16, windows="full,512")
    metrics_args(d, port=0)
    auth_arg(d)
    d.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    d.add_argument("--requests", type=int, default=400)
    d.add_argument("--decode-rate", type=float, default=20.0, help="tokens/s per sequence")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="kvfold-out")
    d.set_defaults(fn=cmd_demo, address=None)


def replay_parser(sub: Any) -> None:
    r = sub.add_parser("replay", help="replay a Mooncake .jsonl or Azure .csv trace")
    r.add_argument("trace")
    connect_args(r, address_help="a Ray cluster running kvfold (default: an embedded one)")
    add_cluster_args(r, blocks=4096, tpb=64, windows="full")
    metrics_args(r, port=None)
    r.add_argument("--time-scale", type=float, default=1.0, help="compress trace time by X")
    r.add_argument(
        "--policy",
        default="guaranteed_no_evict",
        choices=["guaranteed_no_evict", "max_utilization"],
    )
    r.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="N schedulers in N processes share the ranks; requests dealt round-robin",
    )
    r.add_argument(
        "--no-leases",
        dest="leases",
        action="store_false",
        help="schedulers promise from a rank's whole room (optimistic; the rank refuses "
        "collisions) instead of from their lease of it (docs/admission.md)",
    )
    r.add_argument(
        "--no-claims",
        dest="claims",
        action="store_false",
        help="a request larger than every lease takes a rank's whole room where its "
        "scheduler has nothing unseen (the rank refuses collisions) instead of waiting "
        "for a claim on it at the aggregator (docs/admission.md)",
    )
    r.add_argument("--limit", type=int, default=None, help="first N requests only")
    r.add_argument("--decode-rate", type=float, default=40.0, help="tokens/s per sequence")
    r.add_argument("--out", default="kvfold-out")
    r.add_argument(
        "--router",
        default="precise_prefix",
        choices=ROUTERS,
        help="how an admitted request's rank is chosen (docs/routing.md)",
    )
    _overlap_arg(r)
    r.set_defaults(fn=cmd_replay)


ROUTERS = ["round_robin", "least_loaded", "approx_prefix", "precise_prefix"]


def _overlap_arg(p: argparse.ArgumentParser) -> None:
    from kvfold.admission.routing import RoutingWeights  # Ray-free

    p.add_argument(
        "--overlap-weight",
        type=float,
        default=RoutingWeights().overlap_weight,
        help="precise_prefix: a prompt block to compute weighs this many resident blocks",
    )


def compare_parser(sub: Any) -> None:
    c = sub.add_parser("compare", help="one trace under every router, side by side")
    c.add_argument("trace")
    add_cluster_args(c, blocks=4096, tpb=64, windows="full")
    auth_arg(c)
    c.add_argument("--time-scale", type=float, default=1.0, help="compress trace time by X")
    c.add_argument("--limit", type=int, default=None, help="first N requests only")
    c.add_argument("--decode-rate", type=float, default=40.0, help="tokens/s per sequence")
    c.add_argument("--routers", default=",".join(ROUTERS), help="comma list")
    _overlap_arg(c)
    c.add_argument("--out", default="kvfold-out")
    c.set_defaults(fn=cmd_compare, address=None)
