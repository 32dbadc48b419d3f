"""Read kvfold's cluster view from a second driver: attach by namespace, read the view,
drill into one node and one rank, wait for the next version, look at the block index.

    python examples/query_aggregator.py --address HOST:PORT --namespace NS

With no --address it brings up its own embedded cluster and kvfold first (so it runs
as is), then runs the reading part in a separate driver process, as you would.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from kvfold.ray_env import apply_local_defaults

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--address", default=None, help="a Ray cluster running kvfold")
p.add_argument("--namespace", default="kvfold-example")
p.add_argument("--node", type=int, default=0, help="the node to drill into")
p.add_argument("--rank", type=int, default=0, help="the rank to drill into")
args = p.parse_args()
apply_local_defaults(args.address)  # before Ray is imported: finds an embedded cluster's token


def read(address: str, namespace: str) -> None:
    """What a second driver does: nothing but attach and read."""
    from kvfold.aggregator.client import KVFoldClient

    client = KVFoldClient(address=address, namespace=namespace)
    view = client.view()
    print(f"view version {view.version}: {view.num_nodes} nodes, world size {view.world_size}")
    t = view.gpu_total
    print(f"cluster GPU blocks: {t.num_blocks_used} used, {t.num_blocks_room} room, "
          f"{t.num_blocks_total} total (fresh ranks; usage {100 * t.usage:.1f}%)")  # fmt: skip

    node = view.node(args.node)
    used, total = (node.host.num_blocks_used, node.host.num_blocks_total) if node.host else (0, 0)
    print(f"node {node.node} ({node.state.value}): ranks [{node.rank_start}, {node.rank_end}), "
          f"{node.num_ranks_fresh} fresh; host tier {used}/{total} blocks")  # fmt: skip

    found = client.rank(args.rank)
    if found is None:
        raise SystemExit(f"rank {args.rank} is not in the world")
    rank, node_state = found
    for window, g in (rank.gpu or {}).items():
        print(f"rank {rank.rank} ({rank.state.value}, node {node_state.value}) window "
              f"{'full' if window is None else window}: used {g.num_blocks_used}, committed "
              f"{g.num_blocks_committed}, total {g.num_blocks_total}")  # fmt: skip

    nxt = client.wait_for_version(view.version, timeout_s=10.0)
    if nxt is None:
        raise SystemExit("no newer view within 10 s: is kvfold reporting?")
    print(f"next version {nxt.version} (after {view.version})")

    counts = client.block_index_counts()
    print(f"block index: {counts['entries']} (key, source) entries from {counts['sources']} "
          f"sources, {len(counts['out_of_sync'])} out of sync")  # fmt: skip


if args.address is not None:
    read(args.address, args.namespace)
    raise SystemExit(0)

# No address: a cluster and a kvfold of our own, and the reading part in a new process.
from kvfold.cluster import launch, start_local_cluster  # noqa: E402
from kvfold.worker import KVCacheConfig  # noqa: E402

cluster = start_local_cluster(2, 2, namespace=args.namespace)
kv = launch(3, 2, cache=KVCacheConfig(num_blocks=128, device="auto"), host_num_blocks=64,
            namespace=args.namespace)  # fmt: skip
try:
    kv.wait_until_fresh()
    kv.rank(args.rank).add_sequence("warm", list(range(200)), report=True)
    me = [sys.executable, __file__, "--address", cluster.address, "--namespace", args.namespace]
    code = subprocess.run([*me, "--node", str(args.node), "--rank", str(args.rank)]).returncode
finally:
    kv.shutdown()
    cluster.shutdown()
print("done" if code == 0 else f"the reading driver failed ({code})")
raise SystemExit(code)
