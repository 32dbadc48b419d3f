"""One engine rank's ingest: vLLM KV-event frames, as they come off the wire, through
kvfold's decoder and content keys (kvfold.engines.engine_source) into block-index ops
(kvfold.blockindex.index), counted in block events per second.

The workload is vLLM's shape: each batch stores a request's new blocks (8 blocks of 32
tokens, with token ids, chained to a cached prefix or a root) and evicts as many old
ones (one BlockRemoved per block, as vLLM sends them). The anchor, measured in the same
run, is the in-process index ingest: the same events already decoded and keyed, applied
to the same index, so the ratio is what reading an engine adds on top of the index.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import msgpack
from _report import info, report

from kvfold.blockindex.index import BlockIndex
from kvfold.engines.engine_source import EngineSource
from kvfold.kvevents.events import RANK

B = 32
PER_BATCH = 8  # blocks stored per batch, and as many removed
SOURCE = (RANK, 0)


def frames(n_batches: int, seed: int = 0) -> list[list[bytes]]:
    """vLLM-shaped live messages: each stores 8 new blocks under a live parent (or a
    root), then evicts the 8 oldest live leaves."""
    rng = random.Random(seed)
    out: list[list[bytes]] = []
    live: list[int] = []  # engine hashes, oldest first
    next_hash = 1
    for seq in range(n_batches):
        events: list[dict[str, object]] = []
        if len(live) > 4 * PER_BATCH:
            for h in live[:PER_BATCH]:
                events.append(
                    {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
                )
            del live[:PER_BATCH]
        parent = rng.choice(live[-PER_BATCH:]) if live and rng.random() < 0.7 else None
        hashes = list(range(next_hash, next_hash + PER_BATCH))
        next_hash += PER_BATCH
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": [rng.randrange(32_000) for _ in range(B * PER_BATCH)],
                "block_size": B,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        )
        live += hashes
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        out.append([b"kv-events", seq.to_bytes(8, "big"), payload])
    return out


def num_events(messages: list[list[bytes]]) -> int:
    """Block events on the wire: one per block stored or removed."""
    total = 0
    for m in messages:
        for e in msgpack.unpackb(m[2], raw=False)[1]:
            total += len(e["block_hashes"])
    return total


def main() -> None:
    messages = frames(20_000)
    n = num_events(messages)
    # the engine rank's path, from wire bytes
    source, index = EngineSource(), BlockIndex([0])
    keyed: list[list[object]] = []
    t0 = time.perf_counter()
    for m in messages:
        events = source.take_live(m, 0.0)
        index.apply(SOURCE, events)
        keyed.append(events)
    wire_s = time.perf_counter() - t0
    assert not source.refused and source.expected == len(messages)
    # the anchor: the same keyed events, in process, onto a fresh index
    anchor = BlockIndex([0])
    t0 = time.perf_counter()
    for events in keyed:
        anchor.apply(SOURCE, events)  # type: ignore[arg-type]
    anchor_s = time.perf_counter() - t0
    assert anchor.keys_of(SOURCE) == index.keys_of(SOURCE)
    wire_rate, anchor_rate = n / wire_s, n / anchor_s
    report("engine rank ingest, wire bytes -> index ops (events/s)", wire_rate, "ev/s",
           200_000, lower_is_better=False)  # fmt: skip
    info("in-process index ingest of the same events (anchor, events/s)", anchor_rate, "ev/s")
    info("engine ingest / in-process ingest (ratio)", wire_rate / anchor_rate, "x")
    info("block events in the run", n, "")


if __name__ == "__main__":
    main()
