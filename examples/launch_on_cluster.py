"""Launch kvfold on a Ray cluster, wait until every rank is fresh, print the view, stop.

    python examples/launch_on_cluster.py                       # an embedded 2-node cluster
    python examples/launch_on_cluster.py --address HOST:PORT   # a Ray cluster you run

On an embedded cluster kvfold's actors start and stop with this script. On a real
cluster `--keep` leaves them up (detached), for `kvfold status` and the other examples.
"""

from __future__ import annotations

import argparse

from kvfold.ray_env import apply_local_defaults

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--address", default=None, help="a running Ray cluster (default: embedded)")
p.add_argument("--namespace", default="kvfold-example")
p.add_argument("--nodes", type=int, default=2, help="embedded cluster: simulated nodes")
p.add_argument("--gpus-per-node", type=int, default=2)
p.add_argument("--world-size", type=int, default=3, help="ranks (the last node may be partial)")
p.add_argument("--keep", action="store_true", help="leave kvfold up (real cluster only)")
args = p.parse_args()
apply_local_defaults(args.address)  # before Ray is imported (docs/security.md)

from kvfold.aggregator.client import connect  # noqa: E402  (after the Ray settings)
from kvfold.cluster import launch, start_local_cluster  # noqa: E402
from kvfold.display import render_table  # noqa: E402
from kvfold.worker import KVCacheConfig  # noqa: E402

cluster = None
if args.address is None:
    cluster = start_local_cluster(args.nodes, args.gpus_per_node, namespace=args.namespace)
    print(f"embedded Ray cluster at {cluster.address}: {args.nodes} nodes")
else:
    connect(args.address, args.namespace)

# Every rank gets a paged KV cache (a full-attention pool and a 512-token sliding window),
# and every node a host tier of 256 blocks its ranks offload to and onboard from.
cache = KVCacheConfig(tokens_per_block=16, num_blocks=256, windows=(None, 512), device="auto")
kv = launch(
    args.world_size,
    args.gpus_per_node,
    cache=cache,
    host_num_blocks=256,
    namespace=args.namespace,
    detached=args.keep,
)
try:
    view = kv.wait_until_fresh()
    print(f"kvfold is up: version {view.version}, ranks per node "
          f"{[n.num_ranks_expected for n in view.nodes]}")  # fmt: skip

    # One request on the last rank, so the view shows something held: wait for the
    # first version that has folded it in (a report interval or so).
    kv.rank(args.world_size - 1).add_sequence("hello", list(range(300)), report=True)
    while view.gpu_total.num_blocks_used == 0:
        view = kv.wait_for_version(view.version, timeout_s=10.0) or view
    print(render_table(view, title="the cluster view"))
    t = view.gpu_total
    print(f"GPU blocks used {t.num_blocks_used} of {t.num_blocks_total} (fresh ranks only)")
    print(f"attach from another driver: namespace {args.namespace!r}")
finally:
    if not args.keep:
        kv.shutdown()
    if cluster is not None:
        cluster.shutdown()
print("done")
