"""IndexClient: one reader's way to the cluster block index from any driver: who keeps
it (the aggregator, or with racks each rack its nodes' shard), asked once, and the ops
after a replica's cursor from all of them. The Ray shell over kvfold.blockindex.feed's
replicas (KVFoldClient, controllers, the front door's door and the load harness use it).

Every Ray failure is translated into AggregatorUnavailable; every call has a timeout.
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
    """One reader's way to the block index (DESIGN §9, docs/scale.md): who keeps it, asked
    of the aggregator once, and the ops after its replica's cursor from all of them.

    With one keeper (the aggregator) a cursor is that feed's own and its answer passes
    through. With shards the keepers are asked at once and their answers merge into one
    replica's ops (kvfold.blockindex.feed.follow_shards): a shard that restarted answers
    whole and only its nodes' sources are rebuilt; one that does not answer in time keeps
    its cursor until the next refresh. Not thread-safe: one replica's follower uses it."""

    def __init__(self, namespace: str, timeout_s: float = 5.0) -> None:
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._shards: list[tuple[str, frozenset[int]]] | None = None
        self._sharded = False
        self._handles: dict[str, Any] = {}  # a restarted actor keeps its handle
        self.num_shard_answers_missed = 0  # not had in time: taken at a later refresh
        self.last_answer_bytes = 0  # what the last since() was sent, all keepers together

    def shards(self) -> list[tuple[str, frozenset[int]]]:
        """(actor name, its nodes) of every keeper, asked of the aggregator once."""
        if self._shards is None:
            agg = self._actor(AGGREGATOR_NAME)
            try:
                listed = ray.get(agg.index_shards.remote(), timeout=self.timeout_s)
            except (RayActorError, GetTimeoutError) as e:
                self._handles.pop(AGGREGATOR_NAME, None)
                raise AggregatorUnavailable(f"the kvfold aggregator did not answer: {e}") from e
            self._shards = [(name, frozenset(nodes)) for name, nodes in listed]
            self._sharded = [name for name, _ in self._shards] != [AGGREGATOR_NAME]
        return self._shards

    def sharded(self) -> bool:
        """Racks keep the index (several keepers), not the aggregator alone."""
        self.shards()
        return self._sharded

    def keeper(self, node: int) -> str:
        """The name of the actor keeping `node`'s sources in the index."""
        for name, nodes in self.shards():
            if node in nodes:
                return name
        raise ValueError(f"node must be one of the deployment's nodes, got {node!r}")

    def ask(self, name: str, method: str, *args: Any) -> Any:
        """One keeper's answer to `method` (counts, a source's keys)."""
        try:
            return ray.get(getattr(self._actor(name), method).remote(*args), timeout=self.timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            self._handles.pop(name, None)
            raise AggregatorUnavailable(
                f"{name}, a keeper of the index, did not answer: {e}"
            ) from e

    def resolve(self) -> list[tuple[str, frozenset[int]]]:
        """The keepers, each with its handle looked up where it has none (a Ray lookup
        each: a caller with an event loop calls this in a thread)."""
        shards = self.shards()
        for name, _ in shards:
            self._handle(name)
        return shards

    def since(self, cursor: Any) -> Answer:
        """The ops after a replica's `cursor`, from every keeper, waiting `timeout_s` at
        most for all of them together."""
        shards = self.resolve()
        refs = self._ask_since(shards, cursor)
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
                if not self._sharded:
                    raise AggregatorUnavailable(f"{name} did not answer: {e}") from e
                answers.append(None)
        return self._merged(shards, cursor, answers)

    async def since_async(self, cursor: Any) -> Answer:
        """since(), awaited in an event loop (the front door's); lookups off the loop."""
        shards = self._shards
        if shards is None or any(name not in self._handles for name, _ in shards):
            shards = await asyncio.to_thread(self.resolve)
        refs = self._ask_since(shards, cursor)

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
        return self._merged(shards, cursor, answers)

    def _ask_since(self, shards: Sequence[tuple[str, frozenset[int]]], cursor: Any) -> list[Any]:
        """One call per keeper with a handle (None where it has none now)."""
        if not self._sharded:
            return [self._actor(AGGREGATOR_NAME).block_index_since.remote(cursor)]
        cursors = shard_cursor(cursor, [name for name, _ in shards])
        handles = [self._handles.get(name) for name, _ in shards]
        return [
            None if h is None else h.block_index_since.remote(c)
            for h, c in zip(handles, cursors, strict=True)
        ]

    def _merged(
        self,
        shards: Sequence[tuple[str, frozenset[int]]],
        cursor: Any,
        answers: Sequence[bytes | None],
    ) -> Answer:
        self.last_answer_bytes = sum(len(a) for a in answers if a is not None)
        if not self._sharded:
            if answers[0] is None:
                raise AggregatorUnavailable(f"{AGGREGATOR_NAME} did not answer in time")
            now, ops, whole = pickle.loads(answers[0])
            return tuple(now), ops, whole
        self.num_shard_answers_missed += sum(a is None for a in answers)
        decoded = [None if a is None else pickle.loads(a) for a in answers]
        return follow_shards(shards, cursor, decoded)

    def _handle(self, name: str) -> Any | None:
        actor = self._handles.get(name)
        if actor is None:
            actor = named_actor(name, self.namespace)
            if actor is not None:
                self._handles[name] = actor
        return actor

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
