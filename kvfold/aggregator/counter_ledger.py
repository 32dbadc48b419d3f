"""CounterLedger: every counter a reader sees, kept so that none ever goes backwards.
Pure; no Ray.

A node actor counts from zero in each of its lives (its ranks' block deltas, its host
tier's moves, the rank reports it refused), and an aggregator from zero in each of its
own. The ledger keeps, per node:

    base   what its ended lives counted, summed
    life   (incarnation, what the current life counted: the largest seen, per field)

and publishes base + life. A report of a new incarnation ends the life before it (adds
it to the base); one of the same life can only raise it (per field, the larger: a
counter is never lowered by a report that overtook another). Schedulers' decision
counts are kept the same way, a scheduler whose counts fall having started a new life.

`carried()` hands the whole ledger to the next aggregator (which its Ray shell keeps in
Ray's GCS before it publishes a view, so what was published is always carried);
`carry(bytes)` takes it: a node's next report of the carried life supersedes it, one of
a new life ends it. Published counters therefore go on from where the last aggregator's
stood, through rank, node-actor and aggregator restarts, so Prometheus' `rate()` is right.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from kvfold.codec.fields import delta_rows, deltas_field
from kvfold.stats import HOST_COUNTER_FIELDS, BlockDeltas, Window, sum_deltas
from kvfold.topology import Topology

CARRY_FORMAT = 2
MAX_CARRIED_NAMES = 4096  # reasons and schedulers kept per table


@dataclass(frozen=True, slots=True)
class NodeCounters:
    """What one node counted: block deltas per window, its host tier's counters (in the
    order of `stats.HOST_COUNTER_FIELDS`), and rank reports it refused, by reason."""

    blocks: Mapping[Window, BlockDeltas]
    host: tuple[int, ...] = (0,) * len(HOST_COUNTER_FIELDS)
    refused: Mapping[str, int] | None = None

    def plus(self, other: NodeCounters) -> NodeCounters:
        return NodeCounters(
            sum_deltas([self.blocks, other.blocks]),
            tuple(a + b for a, b in zip(self.host, other.host, strict=True)),
            _add(self.refused or {}, other.refused or {}),
        )

    def at_least(self, other: NodeCounters) -> NodeCounters:
        """Per field, the larger of the two (two reports of one life)."""
        blocks = dict(self.blocks)
        for w, d in other.blocks.items():
            mine = blocks.get(w)
            blocks[w] = d if mine is None else BlockDeltas(*map(max, mine.as_tuple(), d.as_tuple()))
        refused = dict(self.refused or {})
        for r, n in (other.refused or {}).items():
            refused[r] = max(refused.get(r, 0), n)
        return NodeCounters(blocks, tuple(map(max, self.host, other.host)), refused)


def _add(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


class CounterLedger:
    def __init__(self, topology: Topology, windows: Collection[Window] | None) -> None:
        self.topology = topology
        self.windows = windows
        self.base: dict[int, NodeCounters] = {}
        self.lives: dict[int, tuple[int, NodeCounters]] = {}
        self.totals: dict[int, NodeCounters] = {}  # base + life, per node
        self.own_refused: Counter[str] = Counter()  # node reports refused by aggregators
        self.schedulers: dict[str, tuple[dict[str, int], dict[str, int]]] = {}  # base, life
        self.changes = 0  # grows with every change of what is published
        self._carried_at = -1  # `changes` when last carried

    # ------------------------------------------------------------------ nodes

    def observe(self, node: int, incarnation: int, counts: NodeCounters) -> NodeCounters:
        """A node's counters as of its newest report; returns what to publish for it."""
        life = self.lives.get(node)
        if life is not None and life[0] == incarnation:
            now = life[1].at_least(counts)
            if now == life[1]:
                return self.totals[node]
        else:
            now = counts
            if life is not None:  # that life ended: it goes into the base
                old = self.base.get(node)
                self.base[node] = life[1] if old is None else old.plus(life[1])
        self.lives[node] = (incarnation, now)
        base = self.base.get(node)
        self.totals[node] = now if base is None else base.plus(now)
        self.changes += 1
        return self.totals[node]

    def refuse(self, reason: str) -> None:
        """A node report this aggregator refused."""
        self.own_refused[reason] += 1
        self.changes += 1

    def refused(self) -> dict[tuple[str, str], int]:
        """Refused reports by (where, reason): 'aggregator' for node reports, 'node' for
        rank reports refused at the nodes."""
        nodes: Counter[str] = Counter()
        for t in self.totals.values():
            nodes.update(t.refused or {})
        out = {("aggregator", r): c for r, c in self.own_refused.items()}
        out.update({("node", r): c for r, c in nodes.items()})
        return out

    # ------------------------------------------------------------------ schedulers

    def observe_scheduler(self, scheduler: str, counts: Mapping[str, int]) -> None:
        """A scheduler's cumulative decision counts ('outcome:reason' -> n)."""
        base, life = self.schedulers.get(scheduler, ({}, {}))
        if any(counts.get(k, 0) < v for k, v in life.items()):  # it started over
            base = _add(base, life)
        elif dict(counts) == life:
            return
        self.schedulers[scheduler] = (base, dict(counts))
        self.changes += 1

    def decisions(self) -> dict[tuple[str, str], int]:
        """Every scheduler's decisions by (outcome, reason), over all their lives."""
        total: dict[str, int] = {}
        for base, life in self.schedulers.values():
            total = _add(_add(total, base), life)
        out: dict[tuple[str, str], int] = {}
        for key, n in total.items():
            outcome, _, reason = key.partition(":")
            out[(outcome, reason)] = n
        return out

    # ------------------------------------------------------------------ hand-over

    def take_carry(self) -> bytes | None:
        """`carried()` when anything changed since the last time, else None."""
        if self._carried_at == self.changes:
            return None
        self._carried_at = self.changes
        return self.carried()

    def carry_failed(self) -> None:
        """What `take_carry` gave could not be kept: give it again next time."""
        self._carried_at = -1

    def carried(self) -> bytes:
        """Everything the next aggregator needs so that counters go on (msgpack)."""
        nodes: dict[int, Any] = {}
        for node in set(self.base) | set(self.lives):
            base = self.base.get(node)
            life = self.lives.get(node)
            nodes[node] = [
                None if base is None else _rows(base),
                None if life is None else [life[0], _rows(life[1])],
            ]
        msg = {
            "v": CARRY_FORMAT,
            "nodes": nodes,
            "refused": dict(self.own_refused),
            "schedulers": {s: [b, lf] for s, (b, lf) in self.schedulers.items()},
        }
        out: bytes = msgpack.packb(msg, use_bin_type=True)
        return out

    def carry(self, data: bytes) -> None:
        """Take a previous aggregator's ledger (before any report). Read whole and checked
        before anything is used: bad bytes raise ValueError and change nothing."""
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(msg, dict) or msg.get("v") != CARRY_FORMAT:
            raise ValueError(f"carried counters: not format {CARRY_FORMAT}")
        bases: dict[int, NodeCounters] = {}
        lives: dict[int, tuple[int, NodeCounters]] = {}
        for node, (base, life) in dict(msg["nodes"]).items():
            self.topology.check_node(node)
            if base is not None:
                bases[node] = self._counters(base, f"nodes[{node}].base")
            if life is not None:
                lives[node] = (int(life[0]), self._counters(life[1], f"nodes[{node}].life"))
        refused = _names(msg.get("refused", {}), "refused")
        schedulers = {
            str(s): (_names(b, f"schedulers[{s}]"), _names(lf, f"schedulers[{s}]"))
            for s, (b, lf) in list(dict(msg.get("schedulers", {})).items())[:MAX_CARRIED_NAMES]
        }
        self.base.update(bases)
        self.lives.update(lives)
        for node in set(bases) | set(lives):
            parts = [p for p in (bases.get(node), lives.get(node, (0, None))[1]) if p]
            total = parts[0]
            for p in parts[1:]:
                total = total.plus(p)
            self.totals[node] = total
        self.own_refused.update(refused)
        self.schedulers.update(schedulers)
        self.changes += 1

    def _counters(self, row: Any, name: str) -> NodeCounters:
        blocks, host, refused = row
        host = tuple(int(x) for x in host)
        if len(host) != len(HOST_COUNTER_FIELDS) or min(host, default=0) < 0:
            raise ValueError(f"carried counters: {name} host counters are malformed")
        return NodeCounters(deltas_field(blocks, name, self.windows), host, _names(refused, name))


def _rows(c: NodeCounters) -> list[Any]:
    return [delta_rows(c.blocks), list(c.host), dict(c.refused or {})]


def _names(value: Any, name: str) -> dict[str, int]:
    if not isinstance(value, dict):
        raise ValueError(f"carried counters: {name} must be a map of counts")
    out = {str(k): int(v) for k, v in list(value.items())[:MAX_CARRIED_NAMES]}
    if any(v < 0 for v in out.values()):
        raise ValueError(f"carried counters: {name} holds a negative count")
    return out


__all__ = ["CounterLedger", "NodeCounters"]
