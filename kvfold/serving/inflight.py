"""What each engine is still prefilling or running, by content: the prompt blocks of every
request the door sent there and has not seen end. Pure; no Ray.

    InFlight.add(request_id, rank, keys)   a request placed on `rank` (its full prompt blocks)
    InFlight.remove(request_id)            it ended
    InFlight.match(keys) -> {rank: blocks} the longest prefix of `keys` on each engine

The block index learns an engine's blocks from its KV events, which come once a prefill is
done. A request sharing a prefix with one still prefilling would find nothing there and go
elsewhere, to compute the prefix again beside it; this is the part of "held" the events do
not show yet. The prompt of a running request is in its engine's cache (computed, or being
computed ahead of anything sent after it), so the door counts it held there, and the index
counts it once the engine says so. Keys are prefix-chained (kvfold.worker.hashing): a key
stands for its whole prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


class InFlight:
    def __init__(self) -> None:
        self._on: dict[int, Counter[bytes]] = {}
        self._sent: dict[str, tuple[int, tuple[bytes, ...]]] = {}

    def add(self, request_id: str, rank: int, keys: Sequence[bytes]) -> None:
        if request_id in self._sent:
            self.remove(request_id)
        held = tuple(keys)
        self._sent[request_id] = (rank, held)
        self._on.setdefault(rank, Counter()).update(held)

    def remove(self, request_id: str) -> None:
        sent = self._sent.pop(request_id, None)
        if sent is None:
            return
        rank, keys = sent
        on = self._on[rank]
        on.subtract(keys)
        for k in keys:
            if on[k] <= 0:
                del on[k]

    def match(self, keys: Sequence[bytes]) -> dict[int, int]:
        """Per engine with any, the blocks of `keys`' longest prefix sent there and not ended."""
        out = {}
        for rank, on in self._on.items():
            n = 0
            for k in keys:
                if k not in on:
                    break
                n += 1
            if n:
                out[rank] = n
        return out

    def __len__(self) -> int:
        return len(self._sent)


__all__ = ["InFlight"]
