"""Tickets settle reservations exactly: out of order, across restarts, for late readers;
leases split a rank's room among controllers; the two old breakages as regressions."""

from __future__ import annotations

import pytest

from kvfold.admission import AdmissionController, AdmissionRequest, Outcome, Policy
from kvfold.aggregator.fold import fold_cluster, fold_node
from kvfold.stats import RankReport
from kvfold.tickets import TicketBook
from kvfold.topology import Topology
from kvfold.view import ClusterView
from kvfold.worker import PagedKVCache
from tests.unit.builders import make_cache, toks
from tests.unit.test_admission import make_view

GNE = Policy.GUARANTEED_NO_EVICT


def view_of(
    topo: Topology, caches: dict[int, PagedKVCache], books: dict[int, TicketBook], version: int
) -> ClusterView:
    """The view the ranks' reports would fold into, taken from the real caches now."""
    reports = {}
    for r, cache in caches.items():
        stats = cache.stats()
        reports[r] = RankReport(
            rank=r,
            incarnation=1,
            seq=version,
            gpu=dict(stats.windows),
            deltas={},
            num_sequences_by_status=dict(stats.num_sequences_by_status),
            tickets=books[r].snapshot(),
            num_refused=cache.num_refused,
        )
    nodes = {
        n: fold_node(topo, n, {r: reports[r] for r in topo.ranks_on(n)}, None)
        for n in range(topo.num_nodes)
    }
    return fold_cluster(topo, nodes, version=version)


class Holder:
    """A view source the test swaps."""

    def __init__(self, view: ClusterView) -> None:
        self.current = view

    def view(self) -> ClusterView:
        return self.current


def test_a_ticket_shown_out_of_order_settles_every_ticket_at_or_below_it() -> None:
    topo = Topology(1, 1)
    src = Holder(make_view(topo, total=100))
    ctl = AdmissionController(src, refresh_interval_s=0.0)
    cid = ctl.controller_id
    ds = [ctl.decide(AdmissionRequest(f"r{i}", 16, 0)) for i in range(1, 6)]  # 4 blocks each
    assert [d.ticket.number for d in ds] == [1, 2, 3, 4, 5]
    assert ctl.policy.promised(0)[None] == 20
    # the rank took in 1 and 2, then 5 overtook 3 and 4: it shows 5 with 1, 2, 5 committed
    src.current = make_view(topo, used={0: 12}, tickets={0: {cid: 5}}, version=2)
    ctl.refresh(force=True)
    assert not ctl.policy.reservations  # 3 and 4 released too: they arrive late, checked there
    assert ctl.policy.settled == 5
    # an older view arriving after a newer one changes nothing
    src.current = make_view(topo, used={0: 0}, version=1)
    ctl.refresh(force=True)
    assert ctl.policy.index is not None and ctl.policy.index.version == 2
    assert ctl.decide(AdmissionRequest("r6", 16, 0)).ticket.number == 6  # type: ignore[union-attr]


def test_a_view_older_than_the_newest_reservation_keeps_it() -> None:
    topo = Topology(2, 2)
    src = Holder(make_view(topo, total=10))
    ctl = AdmissionController(src, refresh_interval_s=0.0)
    cid = ctl.controller_id
    a = ctl.decide(AdmissionRequest("a", 32, 0))  # 8 of 10 on rank 0
    b = ctl.decide(AdmissionRequest("b", 32, 0))  # 8 of 10 on rank 1
    assert (a.rank, b.rank) == (0, 1)
    # a newer version built before b reached rank 1: it shows a's ticket only
    src.current = make_view(topo, total=10, used={0: 8}, tickets={0: {cid: 1}}, version=2)
    ctl.refresh(force=True)
    assert list(ctl.policy.reservations) == ["b"] and ctl.policy.promised(1)[None] == 8
    d = ctl.decide(AdmissionRequest("c", 12, 0))  # 3 blocks: rank 0 has 2, rank 1 has 2
    assert (d.outcome, d.reason) == (Outcome.QUEUE, "insufficient_free_blocks")


def test_a_rank_restart_starts_its_tickets_over() -> None:
    topo = Topology(1, 1)
    src = Holder(make_view(topo, total=100))
    ctl = AdmissionController(src, refresh_interval_s=0.0)
    cid = ctl.controller_id
    for i in range(3):
        ctl.decide(AdmissionRequest(f"r{i}", 16, 0))
    src.current = make_view(topo, used={0: 8}, tickets={0: {cid: 2}}, version=2)
    ctl.refresh(force=True)
    assert list(ctl.policy.reservations) == ["r2"]
    # the rank restarts empty (a new incarnation, an empty ticket table); r2 is still on its
    # way and held; r0, r1 died with the old incarnation and are not counted again
    src.current = make_view(topo, used={0: 0}, version=3, incarnation=2)
    ctl.refresh(force=True)
    assert list(ctl.policy.reservations) == ["r2"] and ctl.policy.promised(0)[None] == 4
    d = ctl.decide(AdmissionRequest("r3", 16, 0))
    assert d.ticket is not None and d.ticket.number == 4
    # the new incarnation takes in r2 and r3
    src.current = make_view(topo, used={0: 8}, tickets={0: {cid: 4}}, version=4, incarnation=2)
    ctl.refresh(force=True)
    assert not ctl.policy.reservations


def test_a_restarted_controller_takes_a_new_id_and_is_not_settled_by_the_old_one() -> None:
    topo = Topology(1, 1)
    old = AdmissionController(lambda: make_view(topo, total=100))
    for i in range(3):
        old.decide(AdmissionRequest(f"r{i}", 16, 0))
    shown = {0: {old.controller_id: 3}}
    src = Holder(make_view(topo, used={0: 12}, tickets=shown, version=5))
    new = AdmissionController(src, refresh_interval_s=0.0)
    assert new.controller_id != old.controller_id
    d = new.decide(AdmissionRequest("n1", 16, 0))
    assert d.ticket is not None and d.ticket.number == 1
    src.current = make_view(topo, used={0: 12}, tickets=shown, version=6)
    new.refresh(force=True)
    assert list(new.policy.reservations) == ["n1"]  # the old id's ticket 3 says nothing of it


def test_a_late_reader_settles_exactly_and_keeps_the_growth_owed() -> None:
    """Regression: reservations were settled by ids a view listed for 2 s; a scheduler
    reading later never saw them (the prompt counted twice, then the growth dropped)."""
    topo = Topology(1, 1)
    cache, book = make_cache(num_blocks=40), TicketBook()
    src = Holder(view_of(topo, {0: cache}, {0: book}, 1))
    ctl = AdmissionController(src, refresh_interval_s=0.0)
    d = ctl.decide(AdmissionRequest("a", 20, 60))  # 20 + 60 tokens: 20 blocks
    assert d.outcome is Outcome.ADMIT and d.blocks == {None: 20}
    assert cache.add_sequence("a", toks(0, 20), max_new_tokens=60, policy=d.policy or GNE)
    book.take(d.ticket)
    # many reports later (any number of them: the table keeps the highest ticket)
    for _ in range(50):
        cache.append_tokens("a", [1])
    src.current = view_of(topo, {0: cache}, {0: book}, 2)
    ctl.refresh(force=True)
    assert not ctl.policy.reservations
    g = src.current.gpu[None]
    assert (g.num_blocks_used, g.num_blocks_committed) == (18, 20)  # growth still owed
    e = ctl.decide(AdmissionRequest("b", 80, 0))  # 20 blocks: exactly the room
    assert e.outcome is Outcome.ADMIT
    f = ctl.decide(AdmissionRequest("c", 4, 0))
    assert f.outcome is Outcome.QUEUE  # the growth "a" is owed is not handed out
    assert cache.add_sequence("b", toks(1000, 80), policy=GNE)
    for _ in range(10):
        assert cache.append_tokens("a", [2])  # "a" reaches its declared length
    cache.check_integrity()


def test_a_sliding_window_keeps_the_blocks_its_decode_needs() -> None:
    """Regression: the residual after settlement came from the window's bound
    (ceil(W/B) + 1), not from what the prompt held; a later admission took the blocks
    the first request's decode still needed, and its append was refused."""
    topo = Topology(1, 1)
    windows = {None: 64, 16: 12}
    cache, book = make_cache(num_blocks=windows, windows=(None, 16)), TicketBook()
    src = Holder(view_of(topo, {0: cache}, {0: book}, 1))
    ctl = AdmissionController(src, refresh_interval_s=0.0)
    # prompt 4 tokens (1 block), declared to 24: the window holds up to 5 blocks on the way
    d = ctl.decide(AdmissionRequest("a", 4, 20))
    assert d.blocks == {None: 6, 16: 5}
    assert cache.add_sequence("a", toks(0, 4), max_new_tokens=20)
    book.take(d.ticket)
    src.current = view_of(topo, {0: cache}, {0: book}, 2)
    ctl.refresh(force=True)
    assert src.current.gpu[16].num_blocks_committed == 5  # 1 held + 4 still to come
    e = ctl.decide(AdmissionRequest("b", 16, 12))  # window: 16 -> 28 tokens holds 5
    assert e.outcome is Outcome.ADMIT and e.blocks[16] == 5
    assert cache.add_sequence("b", toks(500, 16), max_new_tokens=12)
    book.take(e.ticket)
    src.current = view_of(topo, {0: cache}, {0: book}, 3)
    ctl.refresh(force=True)
    assert ctl.decide(AdmissionRequest("c", 4, 20)).outcome is Outcome.QUEUE  # 2 left, needs 5
    for i in range(20):
        assert cache.append_tokens("a", [i]), f"a's growth refused at token {4 + i}"
    for i in range(12):
        assert cache.append_tokens("b", [i]), f"b's growth refused at token {16 + i}"
    cache.check_integrity()
    assert cache.num_refused == 0


def test_leases_split_each_rank_among_controllers() -> None:
    topo = Topology(1, 1)
    view = make_view(topo, total=100, used={0: 20})  # 80 blocks of room
    ctls = [AdmissionController(lambda: view, num_controllers=4) for _ in range(4)]
    promised = 0
    for c in ctls:
        for i in range(10):
            d = c.decide(AdmissionRequest(f"{c.controller_id}-{i}", 24, 0))  # 6 blocks
            if d.outcome is Outcome.ADMIT:
                promised += 6
        assert c.policy.promised(0)[None] == 18  # 3 x 6 within a lease of 20
    assert promised <= 80
    # a request larger than any lease may take the whole room where this controller
    # has nothing unseen (one such promise per rank and view); a small one never
    # leaves its lease
    big = AdmissionController(lambda: view, num_controllers=4)
    d = big.decide(AdmissionRequest("big", 200, 0))  # 50 blocks > a lease of 20
    assert d.outcome is Outcome.ADMIT
    assert big.decide(AdmissionRequest("big2", 200, 0)).outcome is Outcome.QUEUE
    assert big.decide(AdmissionRequest("mid", 100, 0)).outcome is Outcome.QUEUE
    assert big.decide(AdmissionRequest("small", 4, 0)).outcome is Outcome.QUEUE


@pytest.mark.parametrize(
    "source",
    [
        lambda: (_ for _ in ()).throw(RuntimeError("connection reset")),
        lambda: None,
        lambda: {"version": 3},
    ],
    ids=["raises", "none", "not-a-view"],
)
def test_a_view_source_failing_in_any_way_queues_no_fresh_view(source) -> None:  # type: ignore[no-untyped-def]
    ctl = AdmissionController(source)
    d = ctl.decide(AdmissionRequest("a", 4, 1))
    assert (d.outcome, d.reason) == (Outcome.QUEUE, "no_fresh_view")
    assert ctl.view_error


def test_a_request_id_reused_after_release_is_a_new_request() -> None:
    topo = Topology(1, 1)
    ctl = AdmissionController(lambda: make_view(topo, total=10))
    first = ctl.decide(AdmissionRequest("a", 32, 0))
    with pytest.raises(ValueError, match="release"):
        ctl.decide(AdmissionRequest("a", 32, 0))
    assert ctl.release("a") and not ctl.release("a")
    again = ctl.decide(AdmissionRequest("a", 32, 0))
    assert again.outcome is Outcome.ADMIT and again.ticket != first.ticket
    assert ctl.policy.promised(0)[None] == 8  # counted once
