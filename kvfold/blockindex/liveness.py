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

from kvfold.blockindex.events import HOST, RANK
from kvfold.blockindex.index import Source
from kvfold.view import ClusterView, SourceState

# a source's life as the feed has it: (incarnation, incarnations it retired), or None
Life = tuple[int, tuple[int, ...]] | None


def sources_gone(
    view: ClusterView,
    node_incarnations: Mapping[int, int],
    sources: Iterable[Source],
    life_of: Mapping[Source, Life],
) -> list[Source]:
    """Of `sources` (those with a stream or entries), the ones to drop. A view's
    incarnation of 0 (or a node not in `node_incarnations`) means it never heard the
    source in any life."""
    rank_states = view.rank_states()
    rank_incarnations = {r.rank: r.incarnation for n in view.nodes for r in n.ranks}
    node_dead = {r.rank for n in view.nodes if n.state is SourceState.DEAD for r in n.ranks}
    out: list[Source] = []
    for source in sources:
        kind, i = source
        if kind == RANK:
            if not 0 <= i < len(rank_states):
                continue
            if i in node_dead:  # its node is dead or removed: whatever life it is in
                out.append(source)
                continue
            state, seen = rank_states[i], rank_incarnations.get(i, 0)
        elif kind == HOST:
            if not 0 <= i < view.num_nodes:
                continue
            state, seen = view.nodes[i].state, node_incarnations.get(i, 0)
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


__all__ = ["sources_gone"]
