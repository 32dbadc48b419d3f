"""Host tier bandwidth: offload and onboard of 64 blocks of 256 KiB between a rank's place
and its node's host actor, beside the same bytes as one plain numpy array through
ray.put/ray.get between the same two actors, in the same run (benchmarks/_probes.py).
Target: kvfold >= 0.7x the plain transfer."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import info, report

from kvfold.ray_env import apply_local_defaults

apply_local_defaults()

from kvfold.cluster import start_local_cluster
from kvfold.worker import KVCacheConfig

# 4 layers x 2 (K, V) x 16 tokens x 8 heads x 128 dims x 2 bytes = 262,144 bytes a block
CACHE = KVCacheConfig(
    tokens_per_block=16,
    num_blocks=128,
    num_layers=4,
    num_kv_heads=8,
    head_dim=128,
    dtype="float16",
    device="auto",
)


def main() -> None:
    assert CACHE.bytes_per_block(None) == 256 * 1024
    cluster = start_local_cluster(num_nodes=1, gpus_per_node=1, object_store_bytes=512 * 2**20)
    try:
        import _probes
        import ray
        from _probes import ProbeNode, TransferProbe

        ray.cloudpickle.register_pickle_by_value(_probes)  # the actors' workers lack benchmarks/
        layout = CACHE.block_layout()
        node = (
            ray.remote(concurrency_groups={"reports": 1, "data": 4})(ProbeNode)
            .options(num_cpus=0)
            .remote(
                0,
                [0],
                list(CACHE.windows),
                namespace="bench",
                report_interval_s=1.0,
                stale_after_s=3.0,
                dead_after_s=30.0,
                host_num_blocks=128,
                layout=layout,
            )
        )
        probe = ray.remote(TransferProbe).options(num_cpus=0).remote(node, layout)
        t = ray.get(probe.measure.remote(64, 12))
        mib = 64 * 256 * 1024 / 2**20
        rate = {k: mib / statistics.median(v[2:]) for k, v in t.items()}  # 2 warm-up repeats
        info("offload, 64 x 256 KiB (kvfold)", rate["offload"], "MiB/s")
        info("plain ray.put + ray.get, same bytes, rank -> node", rate["plain_put"], "MiB/s")
        report(
            "offload / plain ratio",
            rate["offload"] / rate["plain_put"],
            "x",
            0.7,
            lower_is_better=False,
        )
        info("onboard, 64 x 256 KiB (kvfold)", rate["onboard"], "MiB/s")
        info("plain ray.get of a returned array, node -> rank", rate["plain_get"], "MiB/s")
        report(
            "onboard / plain ratio",
            rate["onboard"] / rate["plain_get"],
            "x",
            0.7,
            lower_is_better=False,
        )
        ray.get(node.stop.remote())
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
