"""Which sources leave the block index: those the view holds not alive by any path.
Pure; no Ray.

A source's entries may be credited only while the view says the life that published
them is alive. A source (a rank's GPU cache, a node's host tier) is gone when:

    its own state is DEAD                      (Ray or silence says so)
    its node is DEAD (or removed)              (every rank of it: ClusterView.rank_states)
    the view knows a life the stream is not in (the incarnation was replaced)

unless the stream is known to be newer than what the view shows (the view's life is
among the stream's retired ones: a restarted source whose events came before its
report did). A dead node's ranks go whatever their stream: nothing of a new life can
reach the view through a node that is gone. A stream dropped in a race with a report
heals itself: its next batch opens a new stream, out of sync, and a snapshot puts its
keys back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvfold.blockindex.index import Source
from kvfold.kvevents.events import HOST, RANK
from kvfold.view import ClusterView, SourceState

# a source's life as the feed has it: (incarnation, incarnations it retired), or None
Life = tuple[int, tuple[int, ...]] | None


@dataclass(frozen=True, slots=True)
class Liveness:
    """What `sources_gone` reads of a view, for some of its nodes: a few values per rank,
    so an index shard asks the aggregator for its own sources' nodes alone, not for the
    view (whose entries change with every report)."""

    # rank -> (its state as ClusterView.rank_states says, the incarnation the view holds
    # (0: never heard), whether its node is dead or removed)
    ranks: Mapping[int, tuple[SourceState, int, bool]]
    # node -> (its state, the incarnation accepted from it (0: none))
    nodes: Mapping[int, tuple[SourceState, int]]

    @classmethod
    def of_view(
        cls,
        view: ClusterView,
        node_incarnations: Mapping[int, int],
        nodes: Iterable[int] | None = None,
    ) -> Liveness:
        """Of `nodes` (every node when None; those outside the view are left out)."""
        ranks: dict[int, tuple[SourceState, int, bool]] = {}
        out: dict[int, tuple[SourceState, int]] = {}
        for i in range(view.num_nodes) if nodes is None else nodes:
            if not 0 <= i < view.num_nodes:
                continue
            node = view.nodes[i]
            out[i] = (node.state, node_incarnations.get(i, 0))
            fresh, dead = node.state is SourceState.FRESH, node.state is SourceState.DEAD
            for r in node.ranks:
                state = r.state if fresh or r.state is SourceState.DEAD else node.state
                ranks[r.rank] = (state, r.incarnation, dead)
        return cls(ranks, out)


def sources_gone(
    liveness: Liveness, sources: Iterable[Source], life_of: Mapping[Source, Life]
) -> list[Source]:
    """Of `sources` (those with a stream or entries), the ones to drop. A view's
    incarnation of 0 means it never heard the source in any life; a source whose rank or
    node `liveness` does not cover stays."""
    out: list[Source] = []
    for source in sources:
        kind, i = source
        if kind == RANK:
            rank = liveness.ranks.get(i)
            if rank is None:
                continue
            state, seen, node_dead = rank
            if node_dead:  # its node is dead or removed: whatever life it is in
                out.append(source)
                continue
        elif kind == HOST:
            node = liveness.nodes.get(i)
            if node is None:
                continue
            state, seen = node
        else:
            continue
        if _gone(state, seen, life_of.get(source)):
            out.append(source)
    return out


def _gone(state: SourceState, seen: int, life: Life) -> bool:
    if life is None:  # entries without a stream: only the view's word counts
        return state is SourceState.DEAD
    incarnation, retired = life
    if seen and seen != incarnation:
        return seen not in retired  # replaced; kept when the stream is the newer life
    return state is SourceState.DEAD


__all__ = ["Liveness", "sources_gone"]
