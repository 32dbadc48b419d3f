"""`kvfold ...`: demo, up, status, top, down, replay, compare.

kvfold demo                      embedded cluster (3 nodes x 4 GPUs, world 10), a workload
                                 through admission, a live table, a summary, CSV and PNG
kvfold up --address HOST:PORT    start kvfold on a running Ray cluster (detached); with
                                 --engine vllm|sglang|trtllm, its ranks read real engines
                                 (docs/engines.md)
kvfold status [--json]           one view, from any terminal
kvfold top                       the view, live
kvfold down                      stop kvfold's actors
kvfold replay TRACE              replay a Mooncake .jsonl or Azure .csv trace
kvfold compare TRACE             the same trace under every router, side by side
kvfold bench-serve TRACE         the trace as HTTP requests on real vLLM engines: round robin,
                                 Serve's router, kvfold's front door (docs/serving.md)

The workload commands (demo, replay, compare) are in kvfold.cli_traces, the flags and
process settings they all share in kvfold.cli_args.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvfold.cli_args import (
    add_cluster_args,
    apply_auth,
    cache_config,
    connect_args,
    engine_args,
    engine_endpoints,
    metrics_args,
    ray_env,
)
from kvfold.cli_serve import bench_serve_parser
from kvfold.cli_traces import compare_parser, demo_parser, replay_parser


def _client(args: argparse.Namespace) -> Any:
    ray_env(args.address)
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
    ray_env(args.address)
    from kvfold.aggregator.client import connect
    from kvfold.cluster import launch
    from kvfold.display import render_table
    from kvfold.errors import KVFoldError

    try:
        engines = engine_endpoints(args)
    except ValueError as e:
        print(f"kvfold up: {e}", file=sys.stderr)
        return 2
    world_size = len(engines) if engines else args.world_size
    try:
        connect(args.address, args.namespace)
        kv = launch(
            world_size,
            args.gpus_per_node,
            cache=cache_config(args),
            host_num_blocks=args.host_blocks,
            namespace=args.namespace,
            detached=True,
            placement_timeout_s=args.timeout,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            engines=engines,
            nodes_per_rack=args.nodes_per_rack,
        )
    except (KVFoldError, ValueError) as e:
        print(f"kvfold up: {e}", file=sys.stderr)
        return 2
    print(render_table(kv.view(), title=f"kvfold is up in namespace {args.namespace!r}"))
    url = kv.client.metrics_url()
    if url:
        print(f"Prometheus metrics at {url}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    ray_env(args.address)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfold", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    demo_parser(sub)
    replay_parser(sub)
    compare_parser(sub)
    bench_serve_parser(sub)
    u = sub.add_parser("up", help="start kvfold on a running Ray cluster (detached)")
    connect_args(u)
    add_cluster_args(u, blocks=1024, tpb=16, windows="full")
    metrics_args(u, port=None)
    engine_args(u)
    u.add_argument("--timeout", type=float, default=60.0, help="placement timeout (s)")
    u.add_argument(
        "--nodes-per-rack", type=int, default=0,
        help="nodes push through rack actors of this many nodes, each keeping its nodes' "
        "shard of the block index (0: straight; docs/scale.md)",
    )  # fmt: skip
    u.set_defaults(fn=cmd_up)
    s = sub.add_parser("status", help="print one cluster view")
    connect_args(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)
    t = sub.add_parser("top", help="the cluster view, live")
    connect_args(t)
    t.add_argument("--interval", type=float, default=0.5)
    t.add_argument("--iterations", type=int, default=None)
    t.set_defaults(fn=cmd_top)
    dn = sub.add_parser("down", help="stop kvfold's actors")
    connect_args(dn)
    dn.set_defaults(fn=cmd_down)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_auth(getattr(args, "auth_token_file", None))
    ray_env(getattr(args, "address", None))  # before anything imports Ray
    code: int = args.fn(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
