"""The cluster block index as its readers follow it: from the feeds that keep it, asked
together (DESIGN §9, docs/scale.md).

    IndexClient(namespace)      who keeps which nodes' part of the index (the aggregator
      .since(cursor)            every node's; with racks, each rack actor its rack's),
      .since_async(cursor)      and the ops after a replica's cursor, from all of them
      .keeper(node)             the actor keeping one node's sources

With one keeper (the aggregator) a cursor is that feed's own, and its answer passes
through as it is. With shards, the keepers are asked at once, and their answers merge
into one replica's ops (kvfold.blockindex.feed.merge_shards): a shard that restarted
answers whole and only its nodes' sources are rebuilt. A shard that does not answer in
time keeps its cursor, and the replica takes it at the next refresh.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from kvfold.blockindex.feed import Op, follow_shards, shard_cursor
from kvfold.errors import AggregatorUnavailable
from kvfold.naming import AGGREGATOR_NAME
from kvfold.ray_actor import named_actor

Answer = tuple[Any, list[Op], bool]  # (cursor now, ops, whole)


class IndexClient:
    """One reader's way to the block index: who keeps it (asked of the aggregator once),
    and the ops after its replica's cursor from all of them. Not thread-safe: one
    replica's follower uses it."""

    def __init__(self, namespace: str, timeout_s: float = 5.0) -> None:
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._shards: list[tuple[str, frozenset[int]]] | None = None
        self._handles: dict[str, Any] = {}  # a restarted actor keeps its handle
        self.num_shard_answers_missed = 0  # not had in time: taken at a later refresh
        self.last_answer_bytes = 0  # what the last since() was sent, all keepers together

    def shards(self) -> list[tuple[str, frozenset[int]]]:
        """(actor name, its nodes) of every keeper, asked of the aggregator once; their
        handles looked up now (a caller with an event loop calls this in a thread)."""
        if self._shards is None:
            agg = self._actor(AGGREGATOR_NAME)
            try:
                listed = ray.get(agg.index_shards.remote(), timeout=self.timeout_s)
            except (RayActorError, GetTimeoutError) as e:
                self._handles.pop(AGGREGATOR_NAME, None)
                raise AggregatorUnavailable(f"the kvfold aggregator did not answer: {e}") from e
            self._shards = [(name, frozenset(nodes)) for name, nodes in listed]
        for name, _ in self._shards:
            self._handle(name)
        return self._shards

    def keeper(self, node: int) -> str:
        """The name of the actor keeping `node`'s sources in the index."""
        for name, nodes in self.shards():
            if node in nodes:
                return name
        raise ValueError(f"node must be one of the deployment's nodes, got {node!r}")

    def sharded(self) -> bool:
        """Racks keep the index (several keepers), not the aggregator alone."""
        shards = self.shards()
        return not (len(shards) == 1 and shards[0][0] == AGGREGATOR_NAME)

    def since(self, cursor: Any) -> Answer:
        """The ops after a replica's `cursor`, from every keeper, waiting `timeout_s` at
        most for all of them together."""
        shards = self.shards()
        refs = self._ask(shards, cursor)
        pending = [r for r in refs if r is not None]
        ready = set()
        if pending:
            ready = set(ray.wait(pending, num_returns=len(pending), timeout=self.timeout_s)[0])
        answers: list[bytes | None] = []
        for (name, _), ref in zip(shards, refs, strict=True):
            try:
                answers.append(ray.get(ref) if ref in ready else None)
            except RayError as e:
                self._handles.pop(name, None)
                if not self.sharded():
                    raise AggregatorUnavailable(f"{name} did not answer: {e}") from e
                answers.append(None)
        if not self.sharded() and answers[0] is None:
            raise AggregatorUnavailable(f"{AGGREGATOR_NAME} did not answer in {self.timeout_s} s")
        return self._merged(shards, cursor, answers)

    async def since_async(self, cursor: Any) -> Answer:
        """since(), awaited in an event loop (the front door's)."""
        shards = self._shards
        if shards is None or any(self._handles.get(n) is None for n, _ in shards):
            shards = await asyncio.to_thread(self.shards)  # lookups off the loop
        refs = self._ask(shards, cursor)

        async def one(name: str, ref: Any) -> bytes | None:
            if ref is None:
                return None
            try:
                got: bytes = await asyncio.wait_for(ref, self.timeout_s)
                return got
            except RayActorError:
                self._handles.pop(name, None)
            except (RayError, asyncio.TimeoutError):
                pass
            return None

        asked = zip(shards, refs, strict=True)
        answers = list(await asyncio.gather(*(one(name, ref) for (name, _), ref in asked)))
        if not self.sharded() and answers[0] is None:
            raise AggregatorUnavailable(f"{AGGREGATOR_NAME} did not answer")
        return self._merged(shards, cursor, answers)

    def _ask(self, shards: Sequence[tuple[str, frozenset[int]]], cursor: Any) -> list[Any]:
        """One call per keeper with a handle (None where it has none now)."""
        if not self.sharded():
            return [self._actor(AGGREGATOR_NAME).block_index_since.remote(cursor)]
        cursors = shard_cursor(cursor, [n for n, _ in shards])
        refs = []
        for (name, _), c in zip(shards, cursors, strict=True):
            actor = self._handles.get(name)
            refs.append(None if actor is None else actor.block_index_since.remote(c))
        return refs

    def _handle(self, name: str) -> Any | None:
        actor = self._handles.get(name)
        if actor is None:
            actor = named_actor(name, self.namespace)
            if actor is not None:
                self._handles[name] = actor
        return actor

    def _merged(
        self,
        shards: Sequence[tuple[str, frozenset[int]]],
        cursor: Any,
        answers: Sequence[bytes | None],
    ) -> Answer:
        self.last_answer_bytes = sum(len(a) for a in answers if a is not None)
        if not self.sharded():
            assert answers[0] is not None
            now, ops, whole = pickle.loads(answers[0])
            return tuple(now), ops, whole
        self.num_shard_answers_missed += sum(a is None for a in answers)
        decoded = [None if a is None else pickle.loads(a) for a in answers]
        return follow_shards(shards, cursor, decoded)

    def _actor(self, name: str) -> Any:
        actor = self._handle(name)
        if actor is None:
            raise AggregatorUnavailable(f"no {name} in namespace {self.namespace!r}")
        return actor


def sum_index_counts(counts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The index's counts over its shards: numbers summed, sources out of sync listed
    together, the last error of any."""
    out: dict[str, Any] = {}
    for c in counts:
        for k, v in c.items():
            if k == "out_of_sync":
                out[k] = out.get(k, []) + list(v)
            elif k == "last_error":
                out[k] = v or out.get(k)
            else:
                out[k] = out.get(k, 0) + v
    return out


__all__ = ["IndexClient", "sum_index_counts"]
