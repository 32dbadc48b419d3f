"""Benchmark-only actors: nothing here ships in kvfold's production actors.

ProbeNode is the real HostKVActor plus two plain endpoints (a baseline of the same bytes
through Ray's object store); TransferProbe sits where a rank would and times both paths
against it.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import numpy as np
import ray

from kvfold.aggregator.node_actor import HostKVActor
from kvfold.hosttier import unpack_blocks
from kvfold.hosttier.layout import BlockLayout


class ProbeNode(HostKVActor):
    def sink(self, data: np.ndarray) -> int:
        """Receive a plain array (the baseline for offloading)."""
        return int(data.nbytes)

    def source(self, nbytes: int) -> np.ndarray:
        """Send a plain array of `nbytes` (the baseline for onboarding)."""
        return np.ones(nbytes, dtype=np.uint8)


class TransferProbe:
    def __init__(self, node: Any, layout: BlockLayout) -> None:
        self.node = node
        self.layout = layout

    def measure(self, num_blocks: int, repeats: int) -> dict[str, list[float]]:
        """Seconds per transfer of `num_blocks` blocks, one entry per repeat: offload and
        onboard through the host tier, and the same bytes as one plain array each way."""
        window, nbytes = self.layout.bytes_per_block[0]
        payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        out: dict[str, list[float]] = {
            "offload": [],
            "onboard": [],
            "plain_put": [],
            "plain_get": [],
        }
        for _ in range(repeats):
            keys = [secrets.token_bytes(32) for _ in range(num_blocks)]
            t0 = time.perf_counter()
            stored = ray.get(
                self.node.host_put_many.remote(self.layout, [(window, k, payload) for k in keys])
            )
            out["offload"].append(time.perf_counter() - t0)
            if not all(stored):
                raise ValueError(f"host tier stored {sum(stored)} of {num_blocks} blocks")
            t0 = time.perf_counter()
            packed, lengths = ray.get(self.node.host_get.remote(self.layout, window, keys))
            got = unpack_blocks(packed, lengths)
            out["onboard"].append(time.perf_counter() - t0)
            if len(got) != num_blocks or got[0].tobytes() != payload.tobytes():
                raise ValueError("onboarded bytes differ from offloaded bytes")
            arr = np.tile(payload, num_blocks)
            t0 = time.perf_counter()
            ray.get(self.node.sink.remote(ray.put(arr)))
            out["plain_put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get(self.node.source.remote(arr.nbytes))
            out["plain_get"].append(time.perf_counter() - t0)
        return out
