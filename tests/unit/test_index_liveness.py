"""What died leaves the index: a source is dropped as soon as the view holds it not alive
by any path (its rank dead, its node dead or removed, its incarnation replaced), and kept
while it is only stale or when its stream is newer than what the view shows."""

from __future__ import annotations

from kvfold.aggregator.fold import RankRecord, fold_cluster, fold_node
from kvfold.blockindex.feed import IndexFeed
from kvfold.blockindex.index import BlockIndex, Source
from kvfold.blockindex.liveness import Liveness, sources_gone
from kvfold.kvevents.events import GPU, HOST, RANK, BlockStored, Envelope, EventBatch
from kvfold.topology import Topology
from kvfold.view import ClusterView, SourceState
from tests.unit.builders import make_report

TOPO = Topology(4, 2)  # nodes 0: ranks 0, 1; 1: ranks 2, 3
FRESH, STALE, DEAD = SourceState.FRESH, SourceState.STALE, SourceState.DEAD


def view_of(
    node_states: dict[int, SourceState],
    rank_incarnations: dict[int, int] | None = None,
    rank_states: dict[int, SourceState] | None = None,
) -> ClusterView:
    """Every rank reported (incarnation 1 unless told), fresh at its node unless told."""
    incs, states = rank_incarnations or {}, rank_states or {}
    nodes = {
        n: fold_node(
            TOPO,
            n,
            {
                r: RankRecord(make_report(r, incarnation=incs.get(r, 1)), states.get(r))
                for r in TOPO.ranks_on(n)
            },
            None,
        )
        for n in range(TOPO.num_nodes)
    }
    return fold_cluster(TOPO, nodes, node_states)


def stored(kind: str, source: int, incarnation: int, seq: int, key: int) -> Envelope:
    medium = GPU if kind == RANK else "CPU"
    event = BlockStored((key,), None, 4, medium)
    return Envelope(kind, source, incarnation, seq, EventBatch(0.0, (event,)))


def feed_with_everyone(incarnation: int = 1) -> IndexFeed:
    feed = IndexFeed(BlockIndex(TOPO.as_list()))
    for r in range(TOPO.world_size):
        assert feed.ingest(stored(RANK, r, incarnation, 1, 100 + r)) == "applied"
    for n in range(TOPO.num_nodes):
        assert feed.ingest(stored(HOST, n, 50 + n, 1, 200 + n)) == "applied"
    return feed


def gone(view: ClusterView, feed: IndexFeed, node_incarnations: dict[int, int]) -> set[Source]:
    sources = set(feed.streams) | set(feed.index.held)
    lives = {s: feed.life(s) for s in sources}
    whole = set(sources_gone(Liveness.of_view(view, node_incarnations), sources, lives))
    for n in range(TOPO.num_nodes):  # a shard asks for its own sources' nodes alone
        own = {s for s in sources if (s[1] if s[0] == HOST else TOPO.node_of(s[1])) == n}
        part = set(sources_gone(Liveness.of_view(view, node_incarnations, [n]), sources, lives))
        assert part == whole & own
    return whole


NODE_INCS = {0: 50, 1: 51}


def test_the_ranks_of_a_dead_node_leave_though_their_last_summaries_say_fresh() -> None:
    feed = feed_with_everyone()
    view = view_of({0: FRESH, 1: DEAD})
    assert view.nodes[1].ranks[0].state is FRESH  # what the node last said of its ranks
    assert gone(view, feed, NODE_INCS) == {(RANK, 2), (RANK, 3), (HOST, 1)}


def test_a_dead_rank_leaves_and_a_stale_one_stays() -> None:
    feed = feed_with_everyone()
    view = view_of({0: FRESH, 1: STALE}, rank_states={1: DEAD})
    assert gone(view, feed, NODE_INCS) == {(RANK, 1)}


def test_a_replaced_incarnation_leaves_before_its_successor_publishes() -> None:
    feed = feed_with_everyone()
    view = view_of({0: FRESH, 1: FRESH}, rank_incarnations={3: 7})  # rank 3 restarted
    assert gone(view, feed, {0: 50, 1: 99}) == {(RANK, 3), (HOST, 1)}  # node 1 restarted too


def test_a_stream_newer_than_the_view_stays() -> None:
    feed = feed_with_everyone()
    assert feed.ingest(stored(RANK, 3, 7, 1, 300)) == "applied"  # rank 3's new life came first
    view = view_of({0: FRESH, 1: FRESH})  # the view still shows life 1
    assert gone(view, feed, NODE_INCS) == set()
    view = view_of({0: FRESH, 1: FRESH}, rank_states={3: DEAD})  # life 1 dead: not the stream's
    assert gone(view, feed, NODE_INCS) == set()


def test_what_left_comes_back_only_through_a_snapshot() -> None:
    feed = feed_with_everyone()
    for source in gone(view_of({0: FRESH, 1: DEAD}), feed, NODE_INCS):
        feed.drop(source)
    assert feed.index.keys_of((RANK, 2)) == {}
    # the same life again (it was only silent): out of sync, nothing credited yet
    assert feed.ingest(stored(RANK, 2, 1, 2, 999)) == "kept"
    assert feed.index.keys_of((RANK, 2)) == {} and (RANK, 2) in feed.wanted()
    assert feed.ingest(stored(RANK, 3, 8, 1, 400)) == "applied"  # a new life starts clean
    assert feed.index.keys_of((RANK, 3)) == {0: {400}}


def test_late_batches_of_a_retired_life_stay_out_after_a_drop() -> None:
    feed = feed_with_everyone()
    assert feed.ingest(stored(RANK, 2, 9, 1, 500)) == "applied"  # life 9 retires life 1
    feed.drop((RANK, 2))
    assert feed.ingest(stored(RANK, 2, 1, 2, 999)) == "stale_incarnation"


def test_a_dead_nodes_rank_leaves_even_when_its_stream_is_a_newer_life() -> None:
    """Rank 2 restarted after its node actor died for good: its events reach the index,
    its reports never will, so the view keeps the old life, dead. It is not credited."""
    feed = feed_with_everyone()
    assert feed.ingest(stored(RANK, 2, 7, 1, 300)) == "applied"  # life 7, life 1 retired
    view = view_of({0: FRESH, 1: DEAD})  # the view still shows life 1, its node dead
    assert (RANK, 2) in gone(view, feed, NODE_INCS)


def test_a_late_batch_of_a_dropped_life_never_displaces_its_successor() -> None:
    feed = feed_with_everyone()
    feed.drop((RANK, 2))  # the view showed a new life (9) before its events came
    assert feed.ingest(stored(RANK, 2, 9, 1, 600)) == "applied"
    assert feed.ingest(stored(RANK, 2, 1, 2, 999)) == "stale_incarnation"  # late, life 1
    assert feed.index.keys_of((RANK, 2)) == {0: {600}}
    assert feed.ingest(stored(RANK, 2, 9, 2, 601)) == "applied"


def test_a_dropped_life_coming_back_at_its_first_batch_is_not_credited_yet() -> None:
    feed = IndexFeed(BlockIndex(TOPO.as_list()))
    assert feed.ingest(stored(RANK, 1, 5, 1, 700)) == "applied"
    feed.drop((RANK, 1))  # silent past dead_after_s
    assert feed.ingest(stored(RANK, 1, 5, 1, 700)) == "kept"  # a resend of seq 1: unknown
    assert feed.index.keys_of((RANK, 1)) == {} and (RANK, 1) in feed.wanted()
