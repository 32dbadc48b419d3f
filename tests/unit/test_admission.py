"""Admission policy: blocks needed, outcomes, no over-commit under threads, FIFO order."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvfold.admission import (
    AdmissionController,
    AdmissionRequest,
    FifoAdmissionQueue,
    Outcome,
    Policy,
    Router,
    blocks_needed,
)
from kvfold.admission.settings import ControllerSettings, settings_for_controllers
from kvfold.aggregator.fold import RankRecord, fold_cluster, fold_node
from kvfold.stats import BlockDeltas, BlockGauges, RankReport, SequenceStatus
from kvfold.topology import Topology
from kvfold.view import ClusterView, SourceState
from kvfold.worker.hashing import block_keys

GNE, MAXU = Policy.GUARANTEED_NO_EVICT, Policy.MAX_UTILIZATION


def make_view(
    topo: Topology,
    used: dict[int, int] | None = None,
    total: int = 100,
    windows=(None,),  # type: ignore[no-untyped-def]
    states: dict[int, SourceState] | None = None,
    tickets: dict[int, dict[str, int]] | None = None,
    version: int = 1,
    committed: dict[int, int] | None = None,
    incarnation: int = 1,
) -> ClusterView:
    """A view whose ranks report `used` blocks, `committed` (default: used) and tickets."""
    used, committed = used or {}, committed or {}
    reports = {
        r: RankReport(
            rank=r,
            incarnation=incarnation,
            seq=version,
            gpu={
                w: BlockGauges(total, used.get(r, 0), 0, 4, committed.get(r, used.get(r, 0)))
                for w in windows
            },
            deltas={w: BlockDeltas() for w in windows},
            num_sequences_by_status=dict.fromkeys(SequenceStatus, 0),
            tickets=(tickets or {}).get(r, {}),
        )
        for r in range(topo.world_size)
    }
    views = {
        n: fold_node(
            topo,
            n,
            {r: RankRecord(reports[r], (states or {}).get(r)) for r in topo.ranks_on(n)},
            None,
        )
        for n in range(topo.num_nodes)
    }
    return fold_cluster(topo, views, version=version)


def test_blocks_needed_per_window_both_policies() -> None:
    # B = 4; prompt 30, max_new 20
    gne = blocks_needed(30, 20, (None, 8, 64), 4, GNE)
    # F = 50: full ceil(50/4) = 13; W=8: min(13, ceil(8/4) + 1 = 3) = 3; W=64: min(13, 17) = 13
    assert gne == {None: 13, 8: 3, 64: 13}
    mu = blocks_needed(30, 20, (None, 8, 64), 4, MAXU)
    # F = 30 + 4 = 34: full ceil(34/4) = 9; W=8: 3; W=64: min(9, 17) = 9
    assert mu == {None: 9, 8: 3, 64: 9}
    assert blocks_needed(30, 2, (None,), 4, MAXU) == {None: 8}  # never past max_new_tokens
    # exact, not the bound: a 9-token window over 4-token blocks meets at most 3 blocks
    # (the bound ceil(9/4) + 1 = 4 needs a span of 10 tokens)
    assert blocks_needed(30, 20, (9,), 4, GNE) == {9: 3}


def test_admit_reject_queue_and_reasons() -> None:
    topo = Topology(4, 2)
    view = make_view(topo, used={0: 90, 1: 95, 2: 99, 3: 80})
    ctl = AdmissionController(lambda: view, policy=GNE, watermark_blocks=2)
    big = ctl.decide(AdmissionRequest("too-big", prompt_tokens=400, max_new_tokens=0))
    assert (big.outcome, big.reason) == (Outcome.REJECT, "exceeds_rank_capacity")  # 100 > 100 - 2
    d = ctl.decide(AdmissionRequest("a", prompt_tokens=40, max_new_tokens=20))  # 15 blocks
    assert (d.outcome, d.rank, d.node) == (Outcome.ADMIT, 3, 1)  # only rank 3 has 20 - 2 >= 15
    assert d.view_version == 1 and d.blocks == {None: 15}
    q = ctl.decide(AdmissionRequest("b", prompt_tokens=40, max_new_tokens=20))
    assert (q.outcome, q.reason) == (Outcome.QUEUE, "insufficient_free_blocks")  # 18 - 15 = 3 left
    assert ctl.decisions[("admit", "fits")] == 1


def test_every_window_must_fit_on_the_same_rank() -> None:
    topo = Topology(2, 2)
    reports_view = make_view(topo, windows=(None, 8), total=10)
    ctl = AdmissionController(lambda: reports_view)
    # full needs ceil(36/4) = 9 <= 10, window 8 needs min(9, 3) = 3 <= 10: fits
    assert ctl.decide(AdmissionRequest("x", 30, 6)).outcome is Outcome.ADMIT
    # 44 tokens -> 11 full blocks > 10 total: rejected although window 8 would fit
    d = ctl.decide(AdmissionRequest("y", 40, 4))
    assert (d.outcome, d.reason) == (Outcome.REJECT, "exceeds_rank_capacity")


def test_all_stale_queues_with_no_fresh_capacity() -> None:
    topo = Topology(4, 2)
    stale = {r: SourceState.STALE for r in range(4)}
    view = make_view(topo, states=stale)
    d = AdmissionController(lambda: view).decide(AdmissionRequest("a", 4, 1))
    assert (d.outcome, d.reason) == (Outcome.QUEUE, "no_fresh_capacity")
    d = AdmissionController(lambda: view, no_fresh=Outcome.REJECT).decide(
        AdmissionRequest("a", 4, 1)
    )
    assert (d.outcome, d.reason) == (Outcome.REJECT, "no_fresh_capacity")
    # one stale rank is never a candidate, however empty it looks
    view = make_view(topo, used={0: 99, 1: 99, 2: 99, 3: 0}, states={3: SourceState.STALE})
    d = AdmissionController(lambda: view).decide(AdmissionRequest("b", 20, 0))
    assert (d.outcome, d.reason) == (Outcome.QUEUE, "insufficient_free_blocks")


@pytest.mark.parametrize("policy", [GNE, MAXU])
def test_no_over_commit_from_four_threads_then_capacity_returns(policy: Policy) -> None:
    topo = Topology(8, 4)
    watermark = 5
    view = make_view(topo, used={r: 10 * r for r in range(8)}, total=100)
    ctl = AdmissionController(lambda: view, policy=policy, watermark_blocks=watermark)
    ctl.refresh(force=True)
    admitted: list = []  # type: ignore[type-arg]
    lock = threading.Lock()

    def worker(t: int) -> None:
        for i in range(50):
            d = ctl.decide(AdmissionRequest(f"t{t}-{i}", prompt_tokens=17, max_new_tokens=12))
            if d.outcome is Outcome.ADMIT:
                with lock:
                    admitted.append((f"t{t}-{i}", d))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (
        ctl.decisions[("admit", "fits")] + ctl.decisions[("queue", "insufficient_free_blocks")]
        == 200
    )
    per_rank: dict[int, int] = {}
    top: dict[int, int] = {}
    for _, d in admitted:
        per_rank[d.rank] = per_rank.get(d.rank, 0) + d.blocks[None]
        top[d.rank] = max(top.get(d.rank, 0), d.ticket.number)
    assert sorted(d.ticket.number for _, d in admitted) == list(range(1, len(admitted) + 1))
    for r in range(8):
        assert per_rank.get(r, 0) <= 100 - 10 * r - watermark  # never promised more than it had
        assert ctl.policy.promised(r)[None] == per_rank.get(r, 0)
    assert len(admitted) < 200  # the cluster filled up: the rest were queued, not over-promised
    # the ranks take the requests in and report them: committed holds them, the tickets say so
    committed = {r: 10 * r + per_rank.get(r, 0) for r in range(8)}
    cid = ctl.controller_id
    view = make_view(
        topo,
        used={r: 10 * r for r in range(8)},
        committed=committed,
        tickets={r: {cid: t} for r, t in top.items()},
        version=2,
    )
    ctl.refresh(force=True)
    assert all(ctl.policy.promised(r)[None] == 0 for r in range(8))  # nothing counted twice
    assert ctl.policy.settled == len(admitted) and not ctl.policy.reservations
    assert ctl.decide(AdmissionRequest("full", 17, 12)).outcome is Outcome.QUEUE
    assert not any(ctl.release(rid) for rid, _ in admitted)  # the ranks hold them now
    # the requests finish at the ranks: the capacity comes back with their reports
    view = make_view(topo, used={r: 10 * r for r in range(8)}, version=3)
    ctl.refresh(force=True)
    d = ctl.decide(AdmissionRequest("after", prompt_tokens=17, max_new_tokens=12))
    assert d.outcome is Outcome.ADMIT and d.rank == 0  # rank 0 has the most room again


def test_reservations_expire_after_ttl() -> None:
    topo = Topology(1, 1)
    now = [0.0]
    view = make_view(topo, total=20)
    ctl = AdmissionController(lambda: view, reservation_ttl_s=5.0, clock=lambda: now[0])
    assert ctl.decide(AdmissionRequest("a", 60, 0)).outcome is Outcome.ADMIT  # 15 of 20
    assert ctl.decide(AdmissionRequest("b", 60, 0)).outcome is Outcome.QUEUE
    now[0] = 5.0
    ctl.refresh(force=True)
    assert ctl.decide(AdmissionRequest("b", 60, 0)).outcome is Outcome.ADMIT
    assert ctl.policy.expired == 1


def test_prefix_affinity_prefers_the_rank_that_holds_the_prefix() -> None:
    topo = Topology(4, 4)
    view = make_view(topo, used={0: 0, 1: 50, 2: 50, 3: 50})
    ctl = AdmissionController(lambda: view)
    keys = (b"k1", b"k2", b"k3")
    first = ctl.decide(AdmissionRequest("a", 12, 1, keys))
    assert first.rank == 0  # most room
    view = make_view(topo, used={0: 90, 1: 50, 2: 50, 3: 50}, version=2)
    ctl.refresh(force=True)
    second = ctl.decide(AdmissionRequest("b", 12, 1, (b"k1", b"k2", b"zz")))
    assert (second.rank, second.reason) == (0, "fits_prefix")  # holds k1, k2 and still fits
    other = ctl.decide(AdmissionRequest("c", 12, 1, (b"q",)))
    assert other.rank != 0


def test_a_released_admission_is_not_a_prefix_holder() -> None:
    """precise_prefix, with an index that knows nothing: A goes to rank 0 and is released,
    never placed; rank 0 then fills. B, with A's prompt, must not follow A there."""
    topo = Topology(2, 2)
    views = [make_view(topo, total=100)]
    ctl = AdmissionController(
        lambda: views[-1],
        router="precise_prefix",
        index_source=lambda cursor: (cursor, [], False),  # no rank holds anything
        clock=lambda: 0.0,  # within the sent TTL throughout
    )
    keys = tuple(block_keys(np.arange(33), 4))  # 8 full blocks of 4 tokens, and one token
    a = ctl.decide(AdmissionRequest("a", 33, 1, keys))
    assert (a.outcome, a.rank, a.prefix_blocks) == (Outcome.ADMIT, 0, 0)  # a tie: rank 0
    assert ctl.release("a")
    views.append(make_view(topo, used={0: 30}, version=2))
    ctl.refresh(force=True)
    # cost = 4 x prefill blocks + active blocks, 9 prompt blocks (ceil(33 / 4)):
    #   rank 0: 4 x 9 + 30 + 9 = 75; rank 1: 4 x 9 + 0 + 9 = 45
    #   (rank 0 credited with A's 8 blocks: 4 x 1 + 30 + 1 = 35, and B would go there)
    b = ctl.decide(AdmissionRequest("b", 33, 1, keys))
    assert (b.rank, b.reason, b.prefix_blocks) == (1, "fits", 0)
    # C follows B's sending: rank 1: 4 x 1 + (0 + 9 promised) + 1 = 14 against 75
    c = ctl.decide(AdmissionRequest("c", 33, 1, keys))
    assert (c.rank, c.reason, c.prefix_blocks) == (1, "fits_prefix", 8)
    assert ctl.release("b")  # C sent the same keys since: they still count, for C
    d = ctl.decide(AdmissionRequest("d", 33, 1, keys))
    assert (d.rank, d.reason, d.prefix_blocks) == (1, "fits_prefix", 8)
    assert ctl.release("d") and ctl.release("c")
    e = ctl.decide(AdmissionRequest("e", 33, 1, keys))
    assert (e.rank, e.reason, e.prefix_blocks) == (1, "fits", 0)  # 45 against 75, nothing held
    assert len(ctl.policy.chooser.sent) == 8  # E's own sending


def test_approx_prefix_forgets_a_released_request_too() -> None:
    topo = Topology(2, 2)
    views = [make_view(topo, total=100)]
    ctl = AdmissionController(lambda: views[-1], router="approx_prefix", clock=lambda: 0.0)
    keys = tuple(block_keys(np.arange(33), 4))
    a = ctl.decide(AdmissionRequest("a", 33, 1, keys))
    assert (a.rank, a.prefix_blocks) == (0, 0)
    assert ctl.release("a")
    b = ctl.decide(AdmissionRequest("b", 33, 1, keys))
    assert (b.reason, b.prefix_blocks) == ("fits", 0)  # nothing credited to rank 0
    c = ctl.decide(AdmissionRequest("c", 33, 1, keys))
    assert (c.rank, c.reason, c.prefix_blocks) == (b.rank, "fits_prefix", 8)  # B's sending
    assert ctl.release("b")  # C sent the same keys since: they stay, for C
    d = ctl.decide(AdmissionRequest("d", 33, 1, keys))
    assert (d.rank, d.reason, d.prefix_blocks) == (b.rank, "fits_prefix", 8)


def test_fifo_queue_stops_at_the_first_queue_and_drops_rejects() -> None:
    topo = Topology(1, 1)
    view = make_view(topo, total=10)
    ctl = AdmissionController(lambda: view)
    q: FifoAdmissionQueue[tuple[str, int]] = FifoAdmissionQueue(
        lambda item: AdmissionRequest(item[0], item[1], 0)
    )
    for item in [("small-1", 8), ("huge", 400), ("big", 36), ("small-2", 4)]:
        q.push(item)
    got = [(item[0], d.outcome) for item, d in q.pump(ctl.decide)]
    # small-1 takes 2 of 10; huge can never fit; big (9 blocks) waits; small-2 must not overtake
    assert got == [("small-1", Outcome.ADMIT), ("huge", Outcome.REJECT), ("big", Outcome.QUEUE)]
    assert len(q) == 2


def test_bad_requests_and_arguments() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        AdmissionRequest("a", 0, 1)
    with pytest.raises(ValueError, match="request_id"):
        AdmissionRequest("", 1, 1)
    with pytest.raises(ValueError, match="watermark"):
        AdmissionController(lambda: None, watermark_blocks=-1)
    with pytest.raises(TypeError, match="view_source"):
        AdmissionController(42)
    with pytest.raises(ValueError, match="no_fresh"):
        AdmissionController(lambda: None, no_fresh=Outcome.ADMIT)
    with pytest.raises(ValueError, match="num_controllers"):
        AdmissionController(lambda: None, num_controllers=0)
    with pytest.raises(ValueError, match="controller id"):
        AdmissionController(lambda: None, controller_id="x" * 65)


class IndexedViews:
    """A view source that also serves the cluster block index (KVFoldClient's seams),
    an index in which no rank holds anything."""

    def __init__(self, view: ClusterView) -> None:
        self._view = view

    def view(self) -> ClusterView:
        return self._view

    def block_index_since(self, cursor: object) -> tuple[object, list[object], bool]:
        return cursor, [], False  # (the cursor, no ops after it, not a whole snapshot)


def test_controller_settings_reach_the_controller() -> None:
    two = settings_for_controllers(
        2, MAXU, router="least_loaded", sent_ttl_s=0.5, controller_ids=["ctl-a", "ctl-b"]
    )
    assert [(s.num_controllers, s.router, s.sent_ttl_s, s.controller_id) for s in two] == [
        (2, "least_loaded", 0.5, "ctl-a"),
        (2, "least_loaded", 0.5, "ctl-b"),
    ]
    view = make_view(Topology(2, 2))
    settings = ControllerSettings(router="precise_prefix", sent_ttl_s=0.5, controller_id="ctl-c")
    ctl = settings.build(IndexedViews(view))
    assert (ctl.router, ctl.policy.chooser.sent.ttl_s) == (Router.PRECISE_PREFIX, 0.5)
    d = ctl.decide(AdmissionRequest("a", 8, 1, (b"k1",)))
    assert d.ticket is not None and d.ticket.controller == "ctl-c"
    # unset: a new id each, the router chosen by the view source, the default TTL
    ids = {s.build(lambda: view).controller_id for s in settings_for_controllers(3)}
    assert len(ids) == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"router": "nearest"}, ValueError, r"router must be one of \['round_robin', .*'nearest'"),
        ({"sent_ttl_s": 0}, ValueError, "sent_ttl_s must be a finite number > 0, got 0"),
        ({"sent_ttl_s": -1.5}, ValueError, "sent_ttl_s must be .* > 0, got -1.5"),
        ({"controller_ids": ["a", "a"]}, ValueError, r"controller_ids must be 2 distinct ids"),
        ({"controller_ids": ["a"]}, ValueError, r"controller_ids must be 2 .*got \['a'\]"),
        ({"controller_ids": "ab"}, TypeError, "controller_ids must be a sequence of 2 str"),
        ({"controller_ids": ["a", "x" * 65]}, ValueError, "controller id must be"),
        ({"refresh_interval_s": -1}, ValueError, "refresh_interval_s must be .* >= 0, got -1"),
        ({"watermark_blocks": -1}, ValueError, "watermark_blocks must be >= 0, got -1"),
        ({"refresh_interval_s": 0}, ValueError, "refresh_interval_s must be a finite number > 0"),
        ({"refresh_in_background": "yes"}, TypeError, "refresh_in_background must be a bool"),
        ({"claims": 1}, TypeError, "claims must be a bool"),
        ({"router": Router.ROUND_ROBIN}, AssertionError, "ray.remote called"),  # all good
    ],
)
def test_start_controllers_checks_its_arguments_before_any_ray_call(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict, error: type, says: str
) -> None:  # type: ignore[type-arg]
    from kvfold.replay import scheduler_actor

    class NoRay:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"ray.{name} called before the arguments were checked")

    monkeypatch.setattr(scheduler_actor, "ray", NoRay())
    with pytest.raises(error, match=says):
        scheduler_actor.start_controllers("ns", 2, **kwargs)


def test_max_utilization_never_admits_what_can_never_finish() -> None:
    topo = Topology(1, 1)
    ctl = AdmissionController(lambda: make_view(topo, total=20), policy=MAXU)
    # the prompt and one block fit (9 blocks), but 36 + 60 tokens (24 blocks) never would
    d = ctl.decide(AdmissionRequest("long", 36, 60))
    assert (d.outcome, d.reason) == (Outcome.REJECT, "exceeds_rank_capacity")
    d = ctl.decide(AdmissionRequest("fits", 36, 40))  # 19 blocks at its full length
    assert d.outcome is Outcome.ADMIT and d.blocks == {None: 10}  # it is promised 36 + 4
