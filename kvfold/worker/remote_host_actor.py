"""RemoteHostTier: the node's host KV tier as a rank's cache sees it, over Ray.

The cache talks to its host tier through the `HostTier` seam (kvfold.worker.host_path);
this is the seam's Ray side, one per rank actor. Fetches wait (up to HOST_TIMEOUT_S) for
the node's answer, since a prompt's plan needs them; offloads never do: they are counted
when the node answers, at the rank's next report or `settle_offloads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import ray
from ray.exceptions import RayError

from kvfold.errors import NodeUnavailable
from kvfold.hosttier.layout import BlockLayout
from kvfold.hosttier.packing import unpack_blocks
from kvfold.ray_actor import InFlight
from kvfold.stats import Window
from kvfold.worker.cache import PagedKVCache

HOST_TIMEOUT_S = 2.0


class RankSide(Protocol):
    """What the tier needs of its rank actor (kvfold.worker.rank_actor.RankWorker)."""

    @property
    def node(self) -> int: ...
    @property
    def layout(self) -> BlockLayout | None: ...

    def node_handle(self) -> Any: ...


class RemoteHostTier:
    """The node's host tier as seen from a rank: the HostTier seam over the node actor.

    Failures raise (NodeUnavailable, Ray's errors, a timeout); the cache's HostLink
    turns each into a miss and counts it (kvfold.worker.host_path).
    """

    def __init__(self, rank: RankSide) -> None:
        self.rank = rank
        self.offload_failures = 0  # answered with an error after the engine moved on
        self.offload_refused = 0  # the host did not store it (held already, tier off, too big)
        self.pending: InFlight[list[tuple[Window, int]]] = InFlight()  # [(window, nbytes)]

    def _node(self) -> Any:
        node = self.rank.node_handle()
        if node is None:
            raise NodeUnavailable(self.rank.node, "no host-KV actor found")
        return node

    def fetch(self, window: Window, keys: Sequence[bytes]) -> list[np.ndarray]:
        ref = self._node().host_get.remote(self.rank.layout, window, list(keys))
        packed, lengths = ray.get(ref, timeout=HOST_TIMEOUT_S)
        return unpack_blocks(packed, lengths)

    def offload_many(self, items: list[tuple[Window, bytes, np.ndarray]]) -> list[bool] | None:
        # the engine's step never waits on the host's answer: settle() counts it later
        ref = self._node().host_put_many.remote(self.rank.layout, items)
        self.pending.add(ref, [(w, int(p.nbytes)) for w, _, p in items])
        return None

    def settle(self, cache: PagedKVCache, timeout_s: float = 0.0) -> None:
        """Count the offloads the host has answered (waiting up to `timeout_s` for all)."""
        if timeout_s:
            self.pending.wait(timeout_s)

        def stored(answer: list[bool], blocks: list[tuple[Window, int]]) -> None:
            for (window, nbytes), ok in zip(blocks, answer, strict=True):
                if ok:
                    cache.record_offload(window, nbytes)
                else:
                    self.offload_refused += 1

        def failed(_error: RayError, blocks: list[tuple[Window, int]]) -> None:
            self.offload_failures += len(blocks)  # the node died, or refused the layout

        self.pending.settle(stored, failed)
