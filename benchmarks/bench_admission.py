"""decide() latency and decisions per second at 1,024 ranks on 128 nodes, in process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import info, percentile, report

from kvfold.admission import AdmissionController, AdmissionRequest, Outcome, Policy
from kvfold.aggregator.fold import fold_cluster, fold_node
from kvfold.stats import BlockDeltas, BlockGauges, RankReport, SequenceStatus
from kvfold.topology import Topology


def view_at_scale(world: int = 1024, gpn: int = 8):  # type: ignore[no-untyped-def]
    topo = Topology(world, gpn)
    reports = {
        r: RankReport(
            r,
            1,
            1,
            {
                None: BlockGauges(8192, (r * 37) % 6000, 100, 16),
                4096: BlockGauges(8192, (r * 11) % 3000, 10, 16),
            },
            {None: BlockDeltas()},
            dict.fromkeys(SequenceStatus, 0),
        )
        for r in range(world)
    }
    views = {
        n: fold_node(topo, n, {r: reports[r] for r in topo.ranks_on(n)}, None)
        for n in range(topo.num_nodes)
    }
    return fold_cluster(topo, views, version=1)


def main() -> None:
    view = view_at_scale()
    for policy in (Policy.GUARANTEED_NO_EVICT, Policy.MAX_UTILIZATION):
        ctl = AdmissionController(
            lambda: view, policy=policy, watermark_blocks=16, refresh_interval_s=3600.0
        )
        ctl.refresh(force=True)
        lat = []
        for i in range(20_000):
            req = AdmissionRequest(
                f"r{i}", prompt_tokens=1000 + (i * 97) % 8000, max_new_tokens=256
            )
            t0 = time.perf_counter()
            d = ctl.decide(req)
            lat.append(time.perf_counter() - t0)
            if d.outcome is Outcome.ADMIT:
                ctl.release(req.request_id)  # keep the state steady (not timed)
        lat = lat[1000:]
        info(f"decide() {policy.value}, median", sorted(lat)[len(lat) // 2] * 1e6, "us")
        report(
            f"decide() {policy.value}, p99 (1,024 ranks, 128 nodes)",
            percentile(lat, 0.99) * 1e6,
            "us",
            50.0,
        )
        info(f"decisions per second, one thread ({policy.value})", len(lat) / sum(lat), "/s")


if __name__ == "__main__":
    main()
