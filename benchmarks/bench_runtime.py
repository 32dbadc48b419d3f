"""The Ray runtime at the demo's shape (3 nodes x 4 GPUs, world 10):
launch time; view() round trip beside a no-op call to a trivial actor (same run);
decide() on the running system with its refresh in line or in a thread of its own;
change-to-visible latency from a rank's change to a ClusterView that holds it."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import info, percentile, report

from kvfold.cluster import launch, start_local_cluster  # imports no Ray: see main()
from kvfold.worker import KVCacheConfig


class Trivial:
    def noop(self) -> None:
        return None


def round_trips(call, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def decide_beside_refreshes(client, seconds: float = 4.0) -> None:  # type: ignore[no-untyped-def]
    """decide() on the running system (capacity deltas and the block index from the
    aggregator, precise_prefix, a refresh every 50 ms): the refresh made by the decision
    that finds it due (the anchor, same run), against one in a thread of its own. Each
    request is released at once (nothing is placed: the state stays steady), so the sent
    prompts' overlay is empty; bench_block_index measures decide() with it."""
    from kvfold.admission import AdmissionController, AdmissionRequest
    from kvfold.worker.hashing import block_keys

    prompts = [tuple(block_keys(list(range(p * 1000, p * 1000 + 128)), 16)) for p in range(16)]
    tails = {}
    for background in (False, True):
        ctl = AdmissionController(
            client, router="precise_prefix", refresh_interval_s=0.05,
            refresh_in_background=background,
        )  # fmt: skip
        assert ctl.wait_for_view(30.0), ctl.view_error
        lat: list[float] = []
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            i = len(lat)
            req = AdmissionRequest(f"d{i}", 128 + 1, 16, prefix_keys=prompts[i % 16])
            t0 = time.perf_counter()
            ctl.decide(req)
            lat.append(time.perf_counter() - t0)
            ctl.release(req.request_id)
        wall = time.monotonic() - start
        ctl.close()
        way = "refresh in a thread of its own" if background else "refresh in the decision"
        admitted = sum(n for (outcome, _), n in ctl.decisions.items() if outcome == "admit")
        assert admitted >= 0.99 * len(lat), f"{way}: only {admitted} of {len(lat)} admitted"
        info(f"decide() on the running system, {way}: decisions/s", len(lat) / wall, "/s")
        info("  median", statistics.median(lat) * 1e6, "us")
        info("  p99", percentile(lat, 0.99) * 1e6, "us")
        tails[background] = percentile(lat, 0.999)
        info("  p99.9", tails[background] * 1e6, "us")
        info("  slowest", max(lat) * 1e6, "us")
    report("decide() p99.9, refresh in a thread of its own", tails[True] * 1e3, "ms", 1.0)
    info("  ratio to the refresh in the decision (same run)", tails[True] / tails[False], "x")


def main() -> None:
    t0 = time.perf_counter()
    cluster = start_local_cluster(3, 4)  # configures the process (token auth), then Ray
    t_cluster = time.perf_counter() - t0
    import ray

    try:
        t1 = time.perf_counter()
        kv = launch(
            10, 4, cache=KVCacheConfig(tokens_per_block=16, num_blocks=512), host_num_blocks=512
        )
        t_launch = time.perf_counter() - t1
        info("start the embedded cluster (3 nodes)", t_cluster, "s")
        info("launch world 10 until every rank is fresh", t_launch, "s")
        for phase, secs in kv.launch_phases.items():
            info(f"  of which {phase}", secs, "s")
        report("up in: the cluster started and every rank fresh", t_cluster + t_launch, "s", 15.0)
        interval = kv.settings.report_interval_s

        trivial = ray.remote(Trivial).options(num_cpus=0).remote()
        ray.get(trivial.noop.remote())
        client = kv.client
        for _ in range(200):  # warm both paths
            ray.get(trivial.noop.remote())
            client.view()
        noop = round_trips(lambda: ray.get(trivial.noop.remote()), 2000)
        views = round_trips(client.view, 2000)
        m_noop, m_view = statistics.median(noop), statistics.median(views)
        info("no-op actor call, median", m_noop * 1e3, "ms")
        info("no-op actor call, p99", percentile(noop, 0.99) * 1e3, "ms")
        info("view() round trip, p99", percentile(views, 0.99) * 1e3, "ms")
        report(
            "view() round trip, median (target 1.5x the no-op call)",
            m_view * 1e3,
            "ms",
            1.5 * m_noop * 1e3,
        )

        decide_beside_refreshes(client)

        for label, eager in (
            ("default interval, no push", False),
            ("push right after change", True),
        ):
            lat = []
            rank = kv.rank(5)
            for i in range(40):
                v0 = kv.view().version
                tokens = list(range(i * 100_000, i * 100_000 + 16 * (1 + i % 4)))
                t = time.perf_counter()
                rank.add_sequence(f"lat{i}", tokens, report=eager)
                want = 1 + i % 4
                while True:
                    v = client.wait_for_version(v0, timeout_s=2.0) or client.view()
                    v0 = v.version
                    s = v.rank_summary(5)
                    if s and s[0].gpu and s[0].gpu[None].num_blocks_used == want:
                        break
                lat.append(time.perf_counter() - t)
                rank.free_sequence(f"lat{i}", report=True)
                time.sleep(0.05)
            info(f"change to visible ({label}), median", statistics.median(lat) * 1e3, "ms")
            report(
                f"change to visible ({label}), p99",
                percentile(lat, 0.99) * 1e3,
                "ms",
                2 * interval * 1e3,
            )
        kv.shutdown()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
