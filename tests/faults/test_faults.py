"""Faults injected into a live deployment: 3 simulated nodes x 2 GPUs, world 6.

Order matters (one cluster, growing damage): hostile input, a rank dies, a node
actor dies, the aggregator dies, a node vanishes.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time

import msgpack
import pytest
import ray

from kvfold.admission import AdmissionController, AdmissionRequest, Outcome
from kvfold.codec import encode_node_report, encode_rank_report
from kvfold.errors import AggregatorUnavailable, RankUnavailable
from kvfold.stats import BlockDeltas, BlockGauges, RankReport, SequenceStatus
from kvfold.view import SourceState
from kvfold.worker import KVCacheConfig
from tests.faults.conftest import record
from tests.integration.conftest import running, wait_until

CACHE = KVCacheConfig(
    tokens_per_block=4,
    num_blocks=64,
    num_layers=1,
    num_kv_heads=1,
    head_dim=8,
    dtype="float32",
    device="auto",
)
FRESH, STALE, DEAD = SourceState.FRESH, SourceState.STALE, SourceState.DEAD


@pytest.fixture(scope="module")
def deployment():  # type: ignore[no-untyped-def]
    # dead after 1.5 s of silence (15 intervals): a node actor's ~2.5 s restart passes through dead
    with running(
        3, 2, 6, cache=CACHE, host_num_blocks=32, dead_after_s=1.5, metrics_port=0
    ) as both:
        yield both


@pytest.fixture(scope="module")
def cluster(deployment):  # type: ignore[no-untyped-def]
    return deployment[0]


@pytest.fixture(scope="module")
def kv(deployment):  # type: ignore[no-untyped-def]
    return deployment[1]


def stable(view):  # type: ignore[no-untyped-def]
    """What must not change when bad input is refused (versions and ages may)."""
    return (
        view.gpu,
        view.host,
        view.counters,
        view.node_states,
        [[(r.rank, r.state, r.incarnation, r.gpu) for r in n.ranks] for n in view.nodes],
    )


def answers(handle) -> bool:  # type: ignore[no-untyped-def]
    try:
        ray.get(handle.ping.remote(), timeout=5)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def rank_report(rank: int, incarnation: int, seq: int, used: int = 0, total: int = 64) -> bytes:
    return encode_rank_report(
        RankReport(
            rank=rank,
            incarnation=incarnation,
            seq=seq,
            gpu={None: BlockGauges(total, used, 0, 4)},
            deltas={None: BlockDeltas(alloc_total_blocks=5, alloc_new_blocks=5)},
            num_sequences_by_status=dict.fromkeys(SequenceStatus, 0),
        )
    )


def test_hostile_input_is_refused_counted_and_changes_nothing(kv) -> None:  # type: ignore[no-untyped-def]
    kv.wait_until_fresh()
    node0 = kv.node(0)
    before = stable(kv.view())
    info = kv.rank(0).info()
    inc, seq = info["incarnation"], 10**9
    rnd = random.Random(7)
    attacks = {
        "random bytes": bytes(rnd.randrange(256) for _ in range(200)),
        "oversized": b"\x00" * (70 * 1024),
        "wrong node": rank_report(2, 1, 1),
        "impostor of rank 0": rank_report(0, inc + 1, seq, used=60),
        "used > total": rank_report(1, 5, 1, used=70, total=64),
        "not a map": msgpack.packb([1, 2, 3]),
        "unknown version": msgpack.packb({"v": 99, "t": "rank"}),
    }
    verdicts = {name: ray.get(node0.report.remote(data)) for name, data in attacks.items()}
    assert verdicts == {
        "random bytes": verdicts["random bytes"],  # bad_msgpack or bad_schema, by the bytes
        "oversized": "too_large",
        "wrong node": "rank_not_on_node",
        "impostor of rank 0": "identity_mismatch",
        "used > total": "used_exceeds_total",
        "not a map": "bad_schema",
        "unknown version": "bad_schema",
    }
    assert verdicts["random bytes"] in ("bad_msgpack", "bad_schema")
    # replayed and reordered: copies of reports rank 0 already sent, one recent, one old
    real = kv.rank(0)
    wait_until(lambda: real.info()["seq"] > 40)
    real.report_now()
    counts0 = ray.get(node0.counts.remote())
    recent = real.info()["seq"]
    assert ray.get(node0.report.remote(rank_report(0, inc, recent))) == "duplicate"
    assert ray.get(node0.report.remote(rank_report(0, inc, 1))) == "out_of_order"
    # the aggregator refuses garbage and forgeries alike
    agg = kv.aggregator
    assert ray.get(agg.node_report.remote(b"\x00\x01")) in ("bad_msgpack", "bad_schema")
    forged = ray.get(node0.view.remote())
    assert (
        ray.get(agg.node_report.remote(encode_node_report(forged, 12345, 1))) == "identity_mismatch"
    )
    counts = ray.get(node0.counts.remote())
    for reason in ("out_of_order", "duplicate"):
        assert counts["refused"][reason] == counts0["refused"].get(reason, 0) + 1
    assert sum(counts["refused"].values()) >= 9
    assert ray.get(node0.ping.remote()) and ray.get(agg.ping.remote())  # both still up
    # two newer views folded since the refusals: nothing of them got in
    v1 = kv.view()
    v2 = wait_until(lambda: kv.wait_for_version(v1.version, timeout_s=1.0), timeout_s=60)
    wait_until(lambda: kv.wait_for_version(v2.version, timeout_s=1.0), timeout_s=60)  # type: ignore[union-attr]
    assert stable(kv.view()) == before
    m = kv.client.counts()["refused"]
    assert m.get("identity_mismatch", 0) == 1


def test_a_rank_dies_then_another_restarts(kv) -> None:  # type: ignore[no-untyped-def]
    victim = 1
    t0 = time.monotonic()
    ray.kill(kv.rank_handles[victim], no_restart=True)
    wait_until(
        lambda: kv.view().rank_states()[victim] is DEAD, timeout_s=kv.settings.dead_after_s + 5
    )
    t_dead = time.monotonic() - t0
    view = kv.view()
    node = view.nodes[0]
    assert node.rank_free_blocks == {0: 64}  # rank 1 excluded from the node's totals
    assert node.gpu_total.num_blocks_total == 64
    ctl = AdmissionController(kv.client)
    picks = set()
    for i in range(40):
        d = ctl.decide(AdmissionRequest(f"rd{i}", prompt_tokens=8, max_new_tokens=0))
        assert d.outcome is Outcome.ADMIT
        picks.add(d.rank)
        ctl.release(f"rd{i}")
    assert victim not in picks
    # a crash with restarts allowed: a new incarnation, empty, counted once
    r0 = kv.rank(0)
    assert r0.add_sequence("keep", list(range(40)), report=True)  # 10 blocks
    wait_until(lambda: kv.view().nodes[0].gpu_total.num_blocks_used == 10)
    before = kv.view().counters.total
    old = r0.info()["incarnation"]
    t0 = time.monotonic()
    ray.kill(kv.rank_handles[0], no_restart=False)

    def back():  # type: ignore[no-untyped-def]
        s = kv.view().rank_summary(0)
        return s and s[0].state is FRESH and s[0].incarnation != old

    wait_until(back, timeout_s=60)
    t_back = time.monotonic() - t0
    view = kv.view()
    assert view.nodes[0].gpu_total.num_blocks_used == 0  # the new incarnation is empty
    assert view.nodes[0].num_ranks_fresh == 1 and view.nodes[0].num_ranks_dead == 1
    after = view.counters.total
    assert after.alloc_new_blocks >= before.alloc_new_blocks  # never backwards
    record("rank dies", detect_dead_s=t_dead, restart_fresh_s=t_back)


def test_a_node_actor_dies_and_comes_back(kv) -> None:  # type: ignore[no-untyped-def]
    node = 1
    ranks = kv.topology.ranks_on(node)
    r = kv.rank(ranks[0])
    # before the crash: 8 blocks offloaded into the node's tier
    assert r.add_sequence("old", list(range(7000, 7033)))  # 8 full blocks
    r.free_sequence("old")
    assert r.add_sequence("push", list(range(8000, 8000 + 4 * 64)))  # evicts them all
    r.free_sequence("push")
    wait_until(lambda: ray.get(kv.node(node).host_stats.remote()).num_blocks_used >= 8)
    assert r.add_sequence("cached", list(range(9000, 9033)))  # 8 more, cached on the GPU
    r.free_sequence("cached")
    assert r.add_sequence("n1", list(range(100, 180)), report=True)  # 20 blocks
    wait_until(lambda: kv.view().nodes[node].gpu_total.num_blocks_used == 20)
    before = kv.view()
    assert r.call("settle_offloads", 20.0) == 0
    sent_before = r.cumulative().total.offloaded_blocks
    info0 = r.info()
    lost_before = info0["host_offload_failures"] + info0["host_offload_refused"]
    evicted = r.cumulative().total.evicted_blocks
    interval = kv.settings.report_interval_s
    t0 = time.monotonic()
    ray.kill(kv.node(node), no_restart=False)
    seen = set()
    watching = threading.Event()

    silences: list[tuple[SourceState, float]] = []  # (state, the node's silence) per view

    def state():  # type: ignore[no-untyped-def]
        v = kv.view()
        s = v.node_states[node]
        seen.add(s)
        silences.append((s, v.age_s(node)))
        return s

    def watch() -> None:  # every state the view passes through, while the test works
        while not watching.is_set():
            with contextlib.suppress(AggregatorUnavailable):
                state()
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    wait_until(lambda: state() is not FRESH, timeout_s=60)
    t_detect = time.monotonic() - t0
    # its ranks keep working meanwhile: growing, and evicting (offloads to a tier that is down)
    assert r.append_tokens("n1", list(range(4)))
    assert r.stats().total.num_blocks_used == 21
    assert r.add_sequence("evict", list(range(20_000, 20_000 + 4 * (64 - 21))))  # all free ones
    evicted_in_outage = r.cumulative().total.evicted_blocks - evicted
    assert evicted_in_outage >= 8  # "cached" among them
    r.free_sequence("evict")
    wait_until(lambda: answers(kv.node(node)), timeout_s=60)
    t_up = time.monotonic() - t0
    wait_until(
        lambda: state() is FRESH and kv.view().nodes[node].num_ranks_fresh == 2, timeout_s=60
    )
    t_fresh = time.monotonic() - t0
    watching.set()
    watcher.join()
    assert STALE in seen  # stale at once
    # dead whenever the aggregator's own clock saw the silence outlast dead_after_s (how long
    # the restart takes is the machine's business; what the view says about it is ours)
    longest = max(age for _, age in silences)
    assert all(st is DEAD for st, age in silences if age >= kv.settings.dead_after_s), silences
    if longest >= kv.settings.dead_after_s:
        assert DEAD in seen, (longest, seen)
    # reports queued during the outage arrive first; the view converges on the ranks' truth
    wait_until(lambda: kv.view().nodes[node].gpu_total.num_blocks_used == 21, timeout_s=60)
    view = kv.view()
    assert view.nodes[node].gpu_total.num_blocks_used == 21  # counted once, not twice
    assert view.gpu_total.num_blocks_total == before.gpu_total.num_blocks_total
    assert view.counters.total.alloc_new_blocks >= before.counters.total.alloc_new_blocks
    assert r.call("settle_offloads", 20.0) == 0  # every offload answered (or failed)
    info = r.info()
    landed = r.cumulative().total.offloaded_blocks - sent_before
    lost = info["host_offload_failures"] + info["host_offload_refused"] - lost_before
    # every block evicted during the outage is accounted for: stored by the new tier
    # (Ray delivers calls queued for a restarting actor) or dropped and counted
    assert landed + lost == evicted_in_outage
    host = ray.get(kv.node(node).host_stats.remote())
    # nothing from before the crash survived: the new tier holds only what landed since
    assert host.offloaded_blocks == landed and host.num_blocks_used == min(landed, 32)
    r.free_sequence("n1", report=True)
    record(
        "node actor dies",
        detect_s=t_detect,
        actor_back_s=t_up,
        fresh_s=t_fresh,
        fresh_after_back_intervals=(t_fresh - t_up) / interval,
        saw_dead=float(DEAD in seen),
        offloads_in_outage=evicted_in_outage,
        offloads_lost=lost,
    )


def ground_truth_used(kv) -> int:  # type: ignore[no-untyped-def]
    """Blocks in use according to the live ranks themselves."""
    return ground_truth(kv)[0]


def ground_truth(kv) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Blocks in use and cached according to the live ranks themselves."""
    used = cached = 0
    for r in range(kv.topology.world_size):
        try:
            stats = kv.rank(r).stats()
        except RankUnavailable:
            continue
        if stats:
            used, cached = (
                used + stats.total.num_blocks_used,
                cached + stats.total.num_blocks_cached,
            )
    return used, cached


def _snapshots(kv) -> int:  # type: ignore[no-untyped-def]
    """The sources the aggregator's index resynchronised from snapshots (-1: it did not
    answer this time)."""
    try:
        return int(kv.client.block_index_counts()["snapshots"])
    except AggregatorUnavailable:
        return -1


def _used_and_cached(view) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return view.gpu_total.num_blocks_used, view.gpu_total.num_blocks_cached


def test_the_aggregator_dies_and_is_rebuilt(kv) -> None:  # type: ignore[no-untyped-def]
    from kvfold.aggregator.client import KVFoldClient

    reader = KVFoldClient(namespace=kv.namespace, timeout_s=0.3)  # a reader with a tight budget
    probe = list(range(777_000, 777_064))  # blocks rank 0 keeps cached: keys in the index
    assert kv.rank(0).add_sequence("index-probe", probe)
    kv.rank(0).free_sequence("index-probe")
    truth = ground_truth(kv)
    wait_until(lambda: _used_and_cached(reader.view()) == truth)  # the probe's blocks are in
    before = reader.view()
    t0 = time.monotonic()
    ray.kill(kv.aggregator, no_restart=False)
    errors = 0
    t_err = None
    while True:
        t_call = time.monotonic()
        try:
            view = reader.view()
            if (
                view.version > before.version
                and all(s is FRESH for s in view.node_states)
                and (view.fresh_ranks == before.fresh_ranks)
            ):
                break
        except AggregatorUnavailable:  # any other error fails the test
            errors += 1
            t_err = t_err or time.monotonic() - t0
        # an answer or an error, never a hang (bounds far above the protocol's timeouts)
        assert time.monotonic() - t_call < reader.timeout_s + 30
        assert time.monotonic() - t0 < 120
        time.sleep(0.01)
    t_rebuilt = time.monotonic() - t0
    assert view.version > before.version  # keeps growing across the restart
    assert view.gpu_total == before.gpu_total  # rebuilt from the next pushes, exactly
    assert view.gpu_total.num_blocks_used == ground_truth_used(kv)
    # the block index (kept by the aggregator here: no racks) is rebuilt from snapshots
    held = kv.client.held_keys(0)
    assert held, "rank 0 was meant to hold the probe's blocks"

    def indexed_as_held() -> bool:
        try:  # a client's handle may still see the aggregator restarting: ask again
            return bool(kv.client.indexed_keys("rank", 0) == held)
        except AggregatorUnavailable:
            return False

    wait_until(indexed_as_held, timeout_s=60)
    wait_until(lambda: _snapshots(kv) >= 1, timeout_s=60)
    record("aggregator dies", errors_seen=errors, first_error_s=t_err or 0.0, rebuilt_s=t_rebuilt)


class CounterWatch:
    """Every counter a reader can see, sampled from the view and from Prometheus while the
    test works, until `stop()`; `backwards()` lists each counter that ever went back."""

    def __init__(self, kv) -> None:  # type: ignore[no-untyped-def]
        from kvfold.aggregator.client import KVFoldClient

        self.client = KVFoldClient(namespace=kv.namespace, timeout_s=1.0)
        self.samples: list[dict[object, float]] = []
        self.scrapes = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        url = None
        while not self._done.is_set():
            sample: dict[object, float] = {}
            with contextlib.suppress(AggregatorUnavailable):
                view = self.client.view()
                for n in view.nodes:
                    for w, d in n.counters.windows.items():
                        for f in BlockDeltas.__slots__:
                            sample[("view node", n.node, w, f)] = getattr(d, f)
                    if n.host is not None:
                        sample[("view host", n.node)] = n.host.offloaded_blocks
                for f in BlockDeltas.__slots__:
                    sample[("view cluster", f)] = getattr(view.counters.total, f)
                sample[("view cluster host",)] = view.host.offloaded_blocks
                url = url or self.client.metrics_url()
            if url is not None:
                try:
                    sample.update(prometheus_counters(url))
                    self.scrapes += 1
                except OSError:  # the aggregator restarting: on another port after
                    url = None
            if sample:
                self.samples.append(sample)
            self._done.wait(0.02)  # a sample every 20 ms until stopped

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def backwards(self) -> list[tuple[object, float, float]]:
        high: dict[object, float] = {}
        out = []
        for sample in self.samples:
            for name, value in sample.items():
                if value < high.get(name, 0):
                    out.append((name, high[name], value))
                high[name] = max(high.get(name, 0), value)
        return out


def prometheus_counters(url: str) -> dict[object, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        ("prometheus", s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        if fam.type == "counter"
        for s in fam.samples
        if s.name.endswith("_total")
    }


def test_counters_never_go_backwards_while_each_actor_kind_restarts(kv) -> None:  # type: ignore[no-untyped-def]
    """Work runs on nodes 1 and 2 while a rank, a node actor and the aggregator are killed
    (Ray restarts each); every counter in every view and scrape only ever grows."""
    workers = [2, 3, 4, 5]
    stop = threading.Event()
    done = [0]

    def work() -> None:  # prompts that share prefixes: allocations, reuse, evictions, offloads
        rng = random.Random(5)
        i = 0
        while not stop.is_set():
            r = kv.rank(workers[i % len(workers)])
            prompt = list(range(rng.randrange(4) * 100, rng.randrange(4) * 100 + 40))
            prompt += [rng.randrange(10_000, 20_000) for _ in range(rng.randrange(1, 60))]
            with contextlib.suppress(RankUnavailable):
                if r.add_sequence(f"mono{i}", prompt):
                    r.free_sequence(f"mono{i}", report=True)
                    done[0] += 1
            i += 1

    watch = CounterWatch(kv)
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        wait_until(lambda: done[0] >= 20 and watch.scrapes >= 5, timeout_s=60)

        def grows_past(n: int):  # type: ignore[no-untyped-def]
            return lambda: done[0] >= n

        # a rank
        old = kv.rank(2).info()["incarnation"]
        ray.kill(kv.rank_handles[2], no_restart=False)
        wait_until(lambda: kv.view().rank_summary(2)[0].incarnation not in (0, old), timeout_s=60)
        wait_until(grows_past(done[0] + 20), timeout_s=60)
        # a node actor (its host tier and its ranks' counts start over)
        ray.kill(kv.node(2), no_restart=False)
        wait_until(lambda: answers(kv.node(2)), timeout_s=60)
        wait_until(lambda: kv.view().node_states[2] is FRESH, timeout_s=60)
        wait_until(grows_past(done[0] + 20), timeout_s=60)
        # the aggregator (its counters go on from what it handed on)
        version = kv.view().version
        ray.kill(kv.aggregator, no_restart=False)
        wait_until(lambda: answers(kv.aggregator), timeout_s=60)
        seen = watch.scrapes

        def rebuilt() -> bool:
            try:
                view = kv.view()
            except AggregatorUnavailable:
                return False
            fresh = all(s is FRESH for s in view.node_states)
            return view.version > version and fresh and watch.scrapes > seen + 5

        wait_until(rebuilt, timeout_s=60)
        wait_until(grows_past(done[0] + 20), timeout_s=60)
    finally:
        stop.set()
        worker.join()
        watch.stop()
    assert len(watch.samples) > 50 and watch.scrapes > 10
    assert watch.backwards() == []
    record("counters through restarts", samples=len(watch.samples), scrapes=watch.scrapes)


def test_a_node_vanishes(kv, cluster) -> None:  # type: ignore[no-untyped-def]
    head = cluster.nodes[0].node_id
    node = next(n for n in (2, 1, 0) if kv.ray_node_ids[n] != head)  # the head cannot go
    index = next(i for i, n in enumerate(cluster.nodes) if n.node_id == kv.ray_node_ids[node])
    gone = set(kv.topology.ranks_on(node))
    held_prompt = list(range(3000, 3000 + 4 * 6 + 1))  # 6 full blocks, cached on its ranks
    for r in gone:
        assert kv.rank(r).add_sequence("held", held_prompt)
        kv.rank(r).free_sequence("held", report=True)
    # the held blocks in the index (the ranks may hold older keys already)
    wait_until(lambda: set(kv.client.index().match(held_prompt).gpu) >= gone, timeout_s=30)
    t0 = time.monotonic()
    cluster.remove_node(index)

    last: list[object] = []

    def dead():  # type: ignore[no-untyped-def]
        try:
            v = kv.view()
        except AggregatorUnavailable as e:
            last[:] = [repr(e)]
            return False
        last[:] = [v.node_states, v.dead_ranks, [v.age_s(n) for n in range(v.num_nodes)]]
        return v.node_states[node] is DEAD and gone <= set(v.dead_ranks)

    try:
        wait_until(dead, timeout_s=kv.settings.dead_after_s + 15)
    except AssertionError:
        raise AssertionError(f"node {node} not dead: {last}") from None
    t_dead = time.monotonic() - t0
    # what died leaves the index, and every replica of it: nothing of it is credited
    wait_until(lambda: all(not kv.client.indexed_keys("rank", r) for r in gone), timeout_s=30)
    replica = kv.client.index()
    assert all(not replica.keys("rank", r) for r in gone)
    assert not replica.keys("host", node)
    assert not set(replica.match(held_prompt).with_host) & gone
    view = kv.view()
    assert view.host.num_blocks_total == 2 * 32  # the vanished node's tier is excluded
    assert not (gone & set(view.fresh_ranks))
    ctl = AdmissionController(kv.client)
    for i in range(30):
        d = ctl.decide(AdmissionRequest(f"nv{i}", prompt_tokens=8, max_new_tokens=0))
        assert d.outcome is Outcome.ADMIT and d.rank not in gone
    record("node vanishes", detect_dead_s=t_dead)
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"


def test_a_dead_aggregator_is_a_clear_error_not_a_hang(kv) -> None:  # type: ignore[no-untyped-def]
    from kvfold.aggregator.client import KVFoldClient

    ray.kill(kv.aggregator, no_restart=True)
    reader = KVFoldClient(namespace=kv.namespace, timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(AggregatorUnavailable):  # an error, where a hang would time out
        wait_until(lambda: reader.view() is None, timeout_s=60)
    record("aggregator gone for good", error_after_s=time.monotonic() - t0)
