"""`kvfold ...`: demo, up, status, top, down, replay.

kvfold demo                      embedded cluster (3 nodes x 4 GPUs, world 10), a workload
                                 through admission, a live table, a summary, CSV and PNG
kvfold up --address HOST:PORT    start kvfold on a running Ray cluster (detached)
kvfold status [--json]           one view, from any terminal
kvfold top                       the view, live
kvfold down                      stop kvfold's actors
kvfold replay TRACE              replay a Mooncake .jsonl or Azure .csv trace
kvfold compare TRACE             the same trace under every router, side by side
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvfold.naming import DEFAULT_NAMESPACE


def _ray_env(address: str | None = None) -> None:
    from kvfold.ray_env import apply_local_defaults

    apply_local_defaults(address)


def _cache_config(args: argparse.Namespace) -> Any:
    from kvfold.worker.config import KVCacheConfig

    windows: tuple[int | None, ...] = tuple(
        None if w in ("full", "none") else int(w) for w in args.windows.split(",")
    )
    return KVCacheConfig(
        tokens_per_block=args.tokens_per_block,
        num_blocks=args.num_blocks,
        windows=windows,
        num_layers=args.num_layers,
        num_kv_heads=2,
        head_dim=16,
        dtype="float16",
        device="auto",
    )


def _add_cluster_args(p: argparse.ArgumentParser, blocks: int, tpb: int, windows: str) -> None:
    p.add_argument("--nodes", type=int, default=3, help="simulated nodes (embedded cluster)")
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--world-size", type=int, default=10)
    p.add_argument("--tokens-per-block", type=int, default=tpb)
    p.add_argument("--num-blocks", type=int, default=blocks, help="GPU blocks per window per rank")
    p.add_argument("--windows", default=windows, help="comma list: full and/or window sizes")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument(
        "--host-blocks", type=int, default=1024, help="host-tier blocks per node (0: off)"
    )


def _connect_args(p: argparse.ArgumentParser, address_help: str = "Ray address HOST:PORT") -> None:
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help=address_help)
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    _auth_arg(p)


def _auth_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="file holding the Ray cluster's auth token (Ray token authentication)",
    )


def _apply_auth(path: str | None) -> None:
    """Token auth must be in the environment before Ray is imported (docs/security.md)."""
    if not path:
        return
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise SystemExit(f"kvfold: cannot read the auth token file {path!r}: {e.strerror}") from e
    if not token:
        raise SystemExit(f"kvfold: the auth token file {path!r} is empty")
    from kvfold.ray_env import use_token

    use_token(token)


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
            cache=_cache_config(args),
            host_num_blocks=args.host_blocks,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
        )
        view = kv.view()
        print(
            f"kvfold: up in {time.monotonic() - t0:.1f} s: {view.num_nodes} nodes expecting "
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
    from kvfold.cluster.replay import replay
    from kvfold.display import render_table
    from kvfold.live import LiveView

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
        router=args.router,
        overlap_weight=args.overlap_weight,
    )
    stem = f"replay-{Path(args.trace).stem}"
    if args.schedulers > 1:
        stem += f"-{args.schedulers}-schedulers" + ("" if args.leases else "-optimistic")
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
    from kvfold.cluster.compare import compare, format_table, write_table  # imports Ray

    try:

        def fresh() -> Any:
            return launch(
                args.world_size,
                args.gpus_per_node,
                cache=_cache_config(args),
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


def _client(args: argparse.Namespace) -> Any:
    _ray_env(args.address)
    from kvfold.aggregator.client import KVFoldClient

    return KVFoldClient(address=args.address, namespace=args.namespace)


def cmd_status(args: argparse.Namespace) -> int:
    from kvfold.display import render_table, view_to_dict
    from kvfold.errors import AggregatorUnavailable

    try:
        view = _client(args).view()
    except AggregatorUnavailable as e:
        print(f"kvfold status: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(view_to_dict(view), indent=2))
    else:
        print(render_table(view))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from kvfold.errors import AggregatorUnavailable
    from kvfold.live import LiveView

    live = LiveView(every_s=0.0, plain_table=True)
    try:
        client = _client(args)
        view = client.view()
        n = 0
        while args.iterations is None or n < args.iterations:
            live.show(view, f"v{view.version}  (Ctrl-C to quit)")
            n += 1
            # one wait: a newer view as soon as there is one, else the same after --interval
            view = client.wait_for_version(view.version, timeout_s=args.interval) or view
    except AggregatorUnavailable as e:
        print(f"kvfold top: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        live.close()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    _ray_env(args.address)
    from kvfold.aggregator.client import connect
    from kvfold.cluster import launch
    from kvfold.display import render_table
    from kvfold.errors import KVFoldError

    try:
        connect(args.address, args.namespace)
        kv = launch(
            args.world_size,
            args.gpus_per_node,
            cache=_cache_config(args),
            host_num_blocks=args.host_blocks,
            namespace=args.namespace,
            detached=True,
            placement_timeout_s=args.timeout,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
        )
    except KVFoldError as e:
        print(f"kvfold up: {e}", file=sys.stderr)
        return 2
    print(render_table(kv.view(), title=f"kvfold is up in namespace {args.namespace!r}"))
    url = kv.client.metrics_url()
    if url:
        print(f"Prometheus metrics at {url}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    _ray_env(args.address)
    from kvfold.aggregator.client import connect
    from kvfold.cluster import teardown
    from kvfold.errors import KVFoldError

    try:
        connect(args.address, args.namespace)
    except KVFoldError as e:
        print(f"kvfold down: {e}", file=sys.stderr)
        return 2
    stopped = teardown(args.namespace)
    print(f"kvfold down: stopped {len(stopped)}: {', '.join(stopped) or 'nothing was running'}")
    return 0


def _metrics_args(p: argparse.ArgumentParser, port: int | None) -> None:
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address for /metrics")
    p.add_argument(
        "--metrics-port", type=int, default=port, help="port for /metrics (0: any free port)"
    )


def _demo_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="the whole system on an embedded local cluster")
    _add_cluster_args(d, blocks=512, tpb=16, windows="full,512")
    _metrics_args(d, port=0)
    _auth_arg(d)
    d.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    d.add_argument("--requests", type=int, default=400)
    d.add_argument("--decode-rate", type=float, default=20.0, help="tokens/s per sequence")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="kvfold-out")
    d.set_defaults(fn=cmd_demo, address=None)


def _replay_parser(sub: Any) -> None:
    r = sub.add_parser("replay", help="replay a Mooncake .jsonl or Azure .csv trace")
    r.add_argument("trace")
    _connect_args(r, address_help="a Ray cluster running kvfold (default: an embedded one)")
    _add_cluster_args(r, blocks=4096, tpb=64, windows="full")
    _metrics_args(r, port=None)
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


def _compare_parser(sub: Any) -> None:
    c = sub.add_parser("compare", help="one trace under every router, side by side")
    c.add_argument("trace")
    _add_cluster_args(c, blocks=4096, tpb=64, windows="full")
    _auth_arg(c)
    c.add_argument("--time-scale", type=float, default=1.0, help="compress trace time by X")
    c.add_argument("--limit", type=int, default=None, help="first N requests only")
    c.add_argument("--decode-rate", type=float, default=40.0, help="tokens/s per sequence")
    c.add_argument("--routers", default=",".join(ROUTERS), help="comma list")
    _overlap_arg(c)
    c.add_argument("--out", default="kvfold-out")
    c.set_defaults(fn=cmd_compare, address=None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfold", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _replay_parser(sub)
    _compare_parser(sub)
    u = sub.add_parser("up", help="start kvfold on a running Ray cluster (detached)")
    _connect_args(u)
    _add_cluster_args(u, blocks=1024, tpb=16, windows="full")
    _metrics_args(u, port=None)
    u.add_argument("--timeout", type=float, default=60.0, help="placement timeout (s)")
    u.set_defaults(fn=cmd_up)
    s = sub.add_parser("status", help="print one cluster view")
    _connect_args(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)
    t = sub.add_parser("top", help="the cluster view, live")
    _connect_args(t)
    t.add_argument("--interval", type=float, default=0.5)
    t.add_argument("--iterations", type=int, default=None)
    t.set_defaults(fn=cmd_top)
    dn = sub.add_parser("down", help="stop kvfold's actors")
    _connect_args(dn)
    dn.set_defaults(fn=cmd_down)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _apply_auth(getattr(args, "auth_token_file", None))
    _ray_env(getattr(args, "address", None))  # before anything imports Ray
    code: int = args.fn(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
