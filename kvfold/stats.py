"""Frozen stats types that cross actor boundaries.

Counts travel; ratios are properties computed from counts. Adding two stats
objects adds their counts, so folding is associative and order-independent.
A window is `None` for full attention or an int (sliding window, in tokens).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import TypeAlias

Window: TypeAlias = int | None


class SequenceStatus(enum.IntEnum):
    """Where a sequence is in its life on one rank."""

    QUEUEING = 0  # known, holds no blocks
    IN_PREFILL = 1  # blocks held, prompt being computed
    PREFILLED = 2
    IN_DECODE = 3
    ON_HOLD = 4  # paused, keeps its blocks
    COMPLETED = 5  # blocks released


VALID_STATUSES: frozenset[SequenceStatus] = frozenset(
    {
        SequenceStatus.IN_PREFILL,
        SequenceStatus.PREFILLED,
        SequenceStatus.IN_DECODE,
        SequenceStatus.ON_HOLD,
    }
)
"""Statuses that count for utilization: the sequence holds blocks."""


def window_sort_key(window: Window) -> tuple[int, int]:
    """Full attention first, then windows by size."""
    return (0, 0) if window is None else (1, window)


def window_label(window: Window) -> str:
    return "full" if window is None else str(window)


def ratio(numerator: int, denominator: int) -> float:
    """numerator / denominator, 0.0 when the denominator is 0."""
    return numerator / denominator if denominator else 0.0


@dataclass(frozen=True, slots=True)
class BlockGauges:
    """A snapshot of one block pool (or a sum of pools). Counts of blocks.

    used: reference count > 0. cached: reference 0, key held, evictable.
    free = total - used: free for allocation, cached blocks included.
    committed: used plus the blocks the sequences may still need to reach their
    declared lengths (kvfold.worker.commitments); room = total - committed.
    """

    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_blocks_cached: int = 0
    tokens_per_block: int = 0  # 0 when summed over pools of different sizes
    num_blocks_committed: int = 0

    @property
    def num_blocks_room(self) -> int:
        """Blocks no sequence holds or may still need: total - max(committed, used)."""
        return self.num_blocks_total - max(self.num_blocks_committed, self.num_blocks_used)

    @property
    def num_blocks_free(self) -> int:
        return self.num_blocks_total - self.num_blocks_used

    @property
    def usage(self) -> float:
        """used / total in 0.0-1.0; 0.0 when total is 0."""
        return ratio(self.num_blocks_used, self.num_blocks_total)

    @property
    def free_percent(self) -> float:
        """100 * free / total; 0.0 when total is 0."""
        return 100.0 * ratio(self.num_blocks_free, self.num_blocks_total)

    def __add__(self, other: BlockGauges) -> BlockGauges:
        return total_of((self, other))

    def as_tuple(self) -> tuple[int, ...]:
        return _gauge_values(self)


@dataclass(frozen=True, slots=True)
class BlockDeltas:
    """Counts for one window over one interval (or a sum of intervals/windows).

    The allocation counters mean what TensorRT-LLM's `getFreeBlock` counts: a taken
    block is new when it has never held a token (a freed partial tail or an evicted
    block is not), so alloc_new + evicted <= alloc_total; a prefix-cache hit is not an
    allocation (docs/decisions.md).
    """

    alloc_total_blocks: int = 0  # taken from the free list: never used, freed, or evicted
    alloc_new_blocks: int = 0  # of those, blocks that had never held a token
    reused_blocks: int = 0  # prompt blocks found in this rank's prefix cache
    onboarded_blocks: int = 0  # prompt blocks copied in from the host tier
    onboarded_bytes: int = 0
    missed_blocks: int = 0  # prompt blocks computed afresh (partial last included)
    gen_alloc_blocks: int = 0  # blocks allocated while decoding
    evicted_blocks: int = 0  # cached blocks whose key was dropped for room
    offloaded_blocks: int = 0  # blocks copied out to the host tier
    offloaded_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """reused / (reused + missed), 0.0 when nothing was looked up."""
        return ratio(self.reused_blocks, self.reused_blocks + self.missed_blocks)

    @property
    def hit_rate_with_host(self) -> float:
        """(reused + onboarded) / (reused + onboarded + missed)."""
        hits = self.reused_blocks + self.onboarded_blocks
        return ratio(hits, hits + self.missed_blocks)

    def __add__(self, other: BlockDeltas) -> BlockDeltas:
        return BlockDeltas(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, ...]:
        return _delta_values(self)


DELTA_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(BlockDeltas))
_delta_values = attrgetter(*DELTA_FIELDS)
GAUGE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(BlockGauges))
_gauge_values = attrgetter(*GAUGE_FIELDS)


def sum_gauges(items: Iterable[Mapping[Window, BlockGauges]]) -> dict[Window, BlockGauges]:
    """Per-window sums. tokens_per_block is kept where every non-empty part agrees, else 0."""
    acc: dict[Window, list[int]] = {}
    tpbs: dict[Window, set[int]] = {}
    for m in items:
        for w, g in m.items():
            a = acc.get(w)
            if a is None:
                acc[w] = [
                    g.num_blocks_total,
                    g.num_blocks_used,
                    g.num_blocks_cached,
                    g.num_blocks_committed,
                ]
                tpbs[w] = {g.tokens_per_block}
            else:
                a[0] += g.num_blocks_total
                a[1] += g.num_blocks_used
                a[2] += g.num_blocks_cached
                a[3] += g.num_blocks_committed
                tpbs[w].add(g.tokens_per_block)
    out = {}
    for w, a in acc.items():
        t = tpbs[w] - {0} if len(tpbs[w]) > 1 else tpbs[w]
        out[w] = BlockGauges(a[0], a[1], a[2], next(iter(t)) if len(t) == 1 else 0, a[3])
    return out


def sum_deltas(items: Iterable[Mapping[Window, BlockDeltas]]) -> dict[Window, BlockDeltas]:
    acc: dict[Window, list[int]] = {}
    for m in items:
        for w, d in m.items():
            a = acc.get(w)
            if a is None:
                acc[w] = list(d.as_tuple())
            else:
                for i, x in enumerate(d.as_tuple()):
                    a[i] += x
    return {w: BlockDeltas(*a) for w, a in acc.items()}


def total_of(values: Iterable[BlockGauges]) -> BlockGauges:
    out = sum_gauges({None: v} for v in values)
    return out.get(None, BlockGauges())


def total_deltas(values: Iterable[BlockDeltas]) -> BlockDeltas:
    out = sum_deltas({None: v} for v in values)
    return out.get(None, BlockDeltas())


def sum_hosts(values: Iterable[HostStats | None]) -> HostStats:
    acc = [0] * len(HOST_FIELDS)
    for h in values:
        if h is not None:
            for i, x in enumerate(h.as_tuple()):
                acc[i] += x
    return HostStats(*acc)


def sum_status_counts(items: Iterable[Mapping[SequenceStatus, int]]) -> dict[SequenceStatus, int]:
    acc = dict.fromkeys(SequenceStatus, 0)
    for m in items:
        for s, n in m.items():
            acc[s] += n
    return acc


def num_valid(counts: Mapping[SequenceStatus, int]) -> int:
    """Sequences that hold blocks: IN_PREFILL, PREFILLED, IN_DECODE, ON_HOLD."""
    return sum(counts.get(s, 0) for s in VALID_STATUSES)


@dataclass(frozen=True, slots=True)
class KVStats:
    """A snapshot of one rank's GPU KV cache: per window, and sequences by status."""

    windows: Mapping[Window, BlockGauges]
    num_sequences_by_status: Mapping[SequenceStatus, int] = field(
        default_factory=lambda: dict.fromkeys(SequenceStatus, 0)
    )

    @property
    def total(self) -> BlockGauges:
        """Summed over windows (pools are disjoint, so nothing is double counted)."""
        return total_of(self.windows.values())

    @property
    def num_valid_sequences(self) -> int:
        return num_valid(self.num_sequences_by_status)


@dataclass(frozen=True, slots=True)
class IterationStats:
    """Deltas since the previous commit, per window."""

    windows: Mapping[Window, BlockDeltas]

    @property
    def total(self) -> BlockDeltas:
        return total_deltas(self.windows.values())

    @property
    def hit_rate(self) -> float:
        return self.total.hit_rate

    @property
    def hit_rate_with_host(self) -> float:
        return self.total.hit_rate_with_host

    def __add__(self, other: IterationStats) -> IterationStats:
        return IterationStats(sum_deltas([self.windows, other.windows]))


@dataclass(frozen=True, slots=True)
class HostStats:
    """A node's host-memory KV tier. Counted once per node, never once per rank.

    Gauges: total, used (holding KV), evictable (used and droppable now).
    Counters (cumulative since the tier started): offloaded/onboarded blocks
    and bytes, dropped_blocks (evicted without ever being onboarded).
    """

    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_blocks_evictable: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    onboarded_blocks: int = 0
    onboarded_bytes: int = 0
    dropped_blocks: int = 0
    evicted_blocks: int = 0  # all host evictions, onboarded-before or not
    refused_blocks: int = 0  # offloads refused (tier off, down, or full of pinned blocks)

    @property
    def num_blocks_free(self) -> int:
        return self.num_blocks_total - self.num_blocks_used

    @property
    def usage(self) -> float:
        return ratio(self.num_blocks_used, self.num_blocks_total)

    @property
    def free_percent(self) -> float:
        return 100.0 * ratio(self.num_blocks_free, self.num_blocks_total)

    def __add__(self, other: HostStats) -> HostStats:
        return HostStats(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[int, ...]:
        return _host_values(self)


HOST_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(HostStats))
_host_values = attrgetter(*HOST_FIELDS)
UNKNOWABLE = ("cached", "committed", "deltas")
"""A rank's numbers an engine may not publish (DESIGN §10): its gauges' cached and
committed blocks, and its per-iteration block counters. A report lists the ones it does
not know; they travel as 0 and are shown, folded and admitted on as unknown, never as 0."""
NUM_HOST_GAUGES = 3  # total, used, evictable: the rest of HOST_FIELDS are counters
HOST_COUNTER_FIELDS = HOST_FIELDS[NUM_HOST_GAUGES:]


def host_counters(host: HostStats | None) -> tuple[int, ...]:
    """The cumulative fields of a host tier's stats (zeros for no tier)."""
    if host is None:
        return (0,) * len(HOST_COUNTER_FIELDS)
    return host.as_tuple()[NUM_HOST_GAUGES:]


def with_host_counters(gauges: HostStats | None, counters: tuple[int, ...]) -> HostStats | None:
    """`gauges`' gauges with `counters` as its counters; None when there is neither a tier
    nor anything counted (a node whose tier is gone keeps showing what it counted)."""
    if gauges is None and not any(counters):
        return None
    head = (0,) * NUM_HOST_GAUGES if gauges is None else gauges.as_tuple()[:NUM_HOST_GAUGES]
    return HostStats(*head, *counters)


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one rank sends its node, once per report interval (decoded and validated).

    `gpu` is None while the rank's KV cache is not bound (counted 0 free, 0 total).
    `deltas` are the counts since the rank's previous report. `tickets`: per admission
    controller id, the highest ticket this incarnation has taken in (placed or
    refused), so a controller releases exactly the reservations the gauges now hold.
    `num_refused`: placements refused because they would over-commit (cumulative).
    `unknown`: which of UNKNOWABLE its source does not publish (an engine's rank).
    """

    rank: int
    incarnation: int
    seq: int
    gpu: Mapping[Window, BlockGauges] | None
    deltas: Mapping[Window, BlockDeltas]
    num_sequences_by_status: Mapping[SequenceStatus, int]
    tickets: Mapping[str, int] = field(default_factory=dict)
    num_refused: int = 0
    unknown: frozenset[str] = frozenset()  # of UNKNOWABLE: what its source does not publish

    @property
    def gpu_total(self) -> BlockGauges:
        return total_of(self.gpu.values()) if self.gpu is not None else BlockGauges()
