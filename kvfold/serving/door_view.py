"""What the door reads of kvfold's cluster view, and what it remembers of its own promises.
Pure; no Ray.

    engine_states(view, ranks, watermark)   each engine rank as the door sees it
    block_sizes(view, ranks)                the engines' tokens per block, as reported
    CommittedLog                            per engine, its committed blocks after each change;
      .most_between(rank, t0, t1)           the most it was at any time in [t0, t1]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from kvfold.serving.door_admission import EngineState
from kvfold.stats import BlockGauges
from kvfold.view import ClusterView, SourceState

COMMITTED_LOG_LEN = 20_000  # per engine: (time, committed) after each change


def _gauges(view: ClusterView | None, rank: int) -> tuple[list[BlockGauges], bool]:
    """A rank's gauges (every window) and whether it and its node are fresh."""
    found = view.rank_summary(rank) if view is not None else None
    if found is None or not found[0].gpu:
        return [], False
    summary, node_state = found
    gpu = summary.gpu or {}
    fresh = summary.state is SourceState.FRESH and node_state is SourceState.FRESH
    return list(gpu.values()), fresh


def engine_states(
    view: ClusterView | None, ranks: Iterable[int], watermark_blocks: int
) -> list[EngineState]:
    """Capacity (its blocks less the watermark), liveness (fresh, on a fresh node, with
    room) and the engine's own used blocks, per rank; a rank not in the view has none."""
    out = []
    for rank in ranks:
        gauges, fresh = _gauges(view, rank)
        if not gauges:
            out.append(EngineState(rank, 0, False, None))
            continue
        total = sum(int(g.num_blocks_total) for g in gauges)
        used = sum(int(g.num_blocks_used) for g in gauges)
        capacity = max(total - watermark_blocks, 0)
        out.append(EngineState(rank, capacity, fresh and capacity > 0, used))
    return out


def block_sizes(view: ClusterView | None, ranks: Iterable[int]) -> set[int]:
    """The tokens per block the engines report (the door needs exactly one)."""
    return {g.tokens_per_block for r in ranks for g in _gauges(view, r)[0] if g.tokens_per_block}


class CommittedLog:
    """Per engine, (wall time, committed blocks) after each change, the newest
    COMMITTED_LOG_LEN kept: what the door had promised at a time, for the cross-check
    against the engine's own gauge and for tests that sample the engine."""

    def __init__(self, ranks: Sequence[int], now: float) -> None:
        self._log = {r: deque([(now, 0)], maxlen=COMMITTED_LOG_LEN) for r in ranks}

    def record(self, rank: int, now: float, committed: int) -> None:
        self._log[rank].append((now, committed))

    def most_between(self, rank: int, t0: float, t1: float) -> int:
        """The most committed on `rank` at any time in [t0, t1]: what held at t0 (the last
        change at or before it) and every change up to t1."""
        before = best = 0
        for t, c in self._log[rank]:
            if t <= t0:
                before = c
            elif t <= t1:
                best = max(best, c)
        return max(best, before)


__all__ = ["COMMITTED_LOG_LEN", "CommittedLog", "block_sizes", "engine_states"]
