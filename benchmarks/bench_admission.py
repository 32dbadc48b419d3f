"""decide() latency and decisions per second at 1,024 ranks on 128 nodes, in process;
a view refresh that settles 1,000 tickets, against a refresh of the same view that
settles none (the ratio says what settling costs)."""

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


def view_at_scale(  # type: ignore[no-untyped-def]
    world: int = 1024, gpn: int = 8, version: int = 1, tickets=None
):
    topo = Topology(world, gpn)
    reports = {
        r: RankReport(
            r,
            1,
            version,
            {
                None: BlockGauges(8192, (r * 37) % 6000, 100, 16, (r * 37) % 6000 + 50),
                4096: BlockGauges(8192, (r * 11) % 3000, 10, 16, (r * 11) % 3000 + 5),
            },
            {None: BlockDeltas()},
            dict.fromkeys(SequenceStatus, 0),
            tickets=(tickets or {}).get(r, {}),
        )
        for r in range(world)
    }
    views = {
        n: fold_node(topo, n, {r: reports[r] for r in topo.ranks_on(n)}, None)
        for n in range(topo.num_nodes)
    }
    return fold_cluster(topo, views, version=version)


def settle_benchmark(num_tickets: int = 1000, repeats: int = 15, world: int = 1024) -> None:
    """Refresh onto a view whose ranks show `num_tickets` of this controller's tickets."""
    first = view_at_scale(world, version=1)
    settle, plain = [], []
    for rep in range(repeats):
        ctl = AdmissionController(lambda: first, refresh_interval_s=3600.0)
        ctl.refresh(force=True)
        shown: dict[int, dict[str, int]] = {}
        for i in range(num_tickets):
            d = ctl.decide(AdmissionRequest(f"r{i}", prompt_tokens=64, max_new_tokens=64))
            assert d.outcome is Outcome.ADMIT and d.rank is not None and d.ticket is not None
            shown[d.rank] = {ctl.controller_id: d.ticket.number}
        seen = view_at_scale(world, version=2 + 2 * rep, tickets=shown)
        same = view_at_scale(world, version=3 + 2 * rep)
        t0 = time.perf_counter()
        ctl.load_view(seen)
        settle.append(time.perf_counter() - t0)
        assert not ctl.policy.reservations and ctl.policy.settled == num_tickets
        t0 = time.perf_counter()
        ctl.load_view(same)  # the same work, nothing left to settle
        plain.append(time.perf_counter() - t0)
    med = sorted(settle)[len(settle) // 2]
    base = sorted(plain)[len(plain) // 2]
    info(f"view refresh settling nothing ({world:,} ranks), median", base * 1e3, "ms")
    report(
        f"view refresh settling {num_tickets:,} tickets ({world:,} ranks), median",
        med * 1e3,
        "ms",
        1.0,
    )
    info("  ratio to the refresh that settles nothing", med / base, "x")


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
    settle_benchmark(world=1024)
    settle_benchmark(world=128)
