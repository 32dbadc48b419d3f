"""Snapshot: what one source (a rank's cache, a node's host tier) holds, taken whole, to
bring an index back in step with it after a gap in its event stream. Pure; no Ray."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvfold.kvevents.events import BlockHash
from kvfold.stats import Window


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A source's keys per group, as of batch `seq` of `incarnation` (taken together)."""

    kind: str
    source: int
    incarnation: int
    seq: int
    keys: Mapping[int, Sequence[BlockHash]]
    windows: Mapping[int, Window]
    block_size: int = 0  # tokens per block (0: not known)
