"""What the door sees of the cluster: kvfold's view and a replica of the block index,
followed together from the aggregator (or from the racks' index shards), in the door's
event loop. A Ray shell: the door actor (kvfold.serving.door_actor) owns one.

    ViewFollower(namespace)
      await poll()   -> a new view, or None when the view has not moved (the index replica
                        is brought up to date either way)
      replica        the block index as last followed (None before the first view)
      forget()       drop the aggregator's handle: asked again on the next poll (it restarted)
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import ray

from kvfold.aggregator.view_delta import ViewReader
from kvfold.blockindex.client import IndexClient
from kvfold.blockindex.feed import NO_CURSOR, Replica
from kvfold.naming import AGGREGATOR_NAME


class ViewFollower:
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.replica: Replica | None = None
        self.version: int | None = None  # the version of the last view handed out
        self._reader = ViewReader()
        self._aggregator: Any = None
        self._index: IndexClient | None = None  # who keeps the block index, once asked

    def forget(self) -> None:
        self._aggregator = None

    async def poll(self) -> Any:
        if self._aggregator is None:
            self._aggregator = ray.get_actor(AGGREGATOR_NAME, namespace=self.namespace)
        if self._index is None:
            index = IndexClient(self.namespace)
            await asyncio.to_thread(index.resolve)  # asked once: who keeps the block index
            self._index = index
        asked = self._reader.position
        cursor_asked = self.replica.cursor if self.replica is not None else NO_CURSOR
        if self._index.sharded():  # racks keep the index: their shards, asked together
            view_bytes = await self._aggregator.view_since.remote(asked)
            answer = await self._index.since_async(cursor_asked)
        else:  # the aggregator keeps it: one call for both
            view_bytes, index_bytes = await self._aggregator.view_and_index_since.remote(
                asked, cursor_asked
            )
            answer = pickle.loads(index_bytes)
        view = self._reader.apply(view_bytes, asked)
        if view is None:
            return None
        if self.replica is None or list(view.rank_to_node) != self.replica.rank_to_node:
            self.replica = Replica(list(view.rank_to_node))
            if cursor_asked != NO_CURSOR:  # those ops were for the replica just dropped
                answer = await self._index.since_async(NO_CURSOR)
        cursor, ops, whole = answer
        self.replica.take(tuple(cursor), ops, whole)
        if view.version == self.version:
            return None
        self.version = view.version
        return view


__all__ = ["ViewFollower"]
