"""The cluster block index (kvfold.blockindex): event ingest, longest-prefix match,
memory per entry, and decide() with precise routing, at 1,024 ranks on 128 nodes.

Ingest counts block hashes applied per second from decoded batches (and, beside it,
from msgpack bytes: the decode is in the aggregator's path too). The match is of a
128-block prompt held, to various depths, by a hot set of ranks: the shape of shared
system prompts. decide() is timed against the same controller routing by least load
(the ratio says what precise routing adds). The requests it admits are placed: every
few decisions a view shows their tickets (untimed), and the prompts they were sent with
stay counted as held (kvfold.admission.sent) until the index would show them.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
from _report import info, percentile, report
from bench_admission import view_at_scale

from kvfold.admission import AdmissionController, AdmissionRequest, Outcome, Router
from kvfold.blockindex.events import (
    RANK,
    BlockStored,
    Envelope,
    EventBatch,
    decode_envelope,
    encode_envelope,
)
from kvfold.blockindex.feed import IndexFeed, Replica
from kvfold.blockindex.index import BlockIndex

WORLD, GPN = 1024, 8
RANK_TO_NODE = [r // GPN for r in range(WORLD)]


def _keys(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(32, "little") for i in range(n)]


def ingest() -> None:
    """Batches of 64 stored blocks, round-robin over ranks; the rate of block hashes."""
    n_batches, per = 4000, 64
    envs = [
        Envelope(
            RANK,
            i % WORLD,
            1,
            i // WORLD + 1,
            EventBatch(0.0, (BlockStored(tuple(_keys(per, i * per)), None, 16),)),
        )
        for i in range(n_batches)
    ]
    wire = [encode_envelope(e) for e in envs]
    rates, wire_rates = [], []
    for _ in range(3):
        feed = IndexFeed(BlockIndex(RANK_TO_NODE))
        t0 = time.perf_counter()
        for e in envs:
            feed.ingest(e)
        rates.append(n_batches * per / (time.perf_counter() - t0))
        feed = IndexFeed(BlockIndex(RANK_TO_NODE))
        t0 = time.perf_counter()
        for data in wire:
            feed.ingest(decode_envelope(data))
        wire_rates.append(n_batches * per / (time.perf_counter() - t0))
    rate, wire_rate = sorted(rates)[1], sorted(wire_rates)[1]
    report("ingest: block events applied per second, one core", rate, "/s", 1e6, False)
    info("  from msgpack bytes (decode + apply)", wire_rate, "/s")


def hot_index(host: bool = True) -> tuple[BlockIndex, list[bytes]]:
    """A 128-block prompt of a multi-turn conversation behind a shared system prompt:
    256 ranks hold its first 16 blocks (the system prompt), 16 ranks its first 64 (an
    earlier turn), 2 ranks all 128, and 8 nodes' host tiers its first 32; every rank
    also holds 2,000 blocks of its own."""
    idx = BlockIndex(RANK_TO_NODE)
    prompt = _keys(128, 10**9)
    rng = np.random.default_rng(0)
    hot = rng.choice(WORLD, 256, replace=False).tolist()
    for i, r in enumerate(hot):
        depth = 128 if i < 2 else 64 if i < 18 else 16
        idx.store((RANK, r), 0, prompt[:depth])
    for r in range(WORLD):
        idx.store((RANK, r), 0, _keys(2000, (r + 1) * 10**6))
    idx.windows[0], idx.block_size = None, 16
    for n in rng.choice(WORLD // GPN, 8, replace=False).tolist():
        if host:
            idx.store(("host", n), 0, prompt[:32])
    return idx, prompt


def match() -> BlockIndex:
    for host in (False, True):
        idx, prompt = hot_index(host)
        lat = []
        for _ in range(3000):
            t0 = time.perf_counter()
            idx.match(prompt, 128 * 16 + 1)  # the answer, compressed (Runs)
            lat.append(time.perf_counter() - t0)
        med = sorted(lat)[len(lat) // 2]
        where = "GPU and 8 host tiers" if host else "GPU only"
        report(f"longest-prefix match, 128 blocks, 1,024 ranks ({where}), median", med * 1e6,
               "us", 20.0)  # fmt: skip
        info("  p99", percentile(lat, 0.99) * 1e6, "us")
    for name, depth in (("no rank holds it", 0), ("64 ranks at 64 different depths", 64)):
        other, keys = BlockIndex(RANK_TO_NODE), _keys(128, 7 * 10**9)
        for i in range(depth):
            other.store((RANK, i * 16), 0, keys[: 2 * i + 1])
        other.windows[0], other.block_size = None, 16
        lat = []
        for _ in range(2000):
            t0 = time.perf_counter()
            other.match(keys, 128 * 16 + 1)
            lat.append(time.perf_counter() - t0)
        info(f"  match when {name}, median", sorted(lat)[1000] * 1e6, "us")
    return idx


def memory() -> None:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = BlockIndex(RANK_TO_NODE)
    keys = _keys(250_000)
    for r in range(4):  # a million (key, rank) entries: each key on 4 ranks
        idx.store((RANK, r * 200), 0, keys)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    keys_bytes = 250_000 * (32 + 33)  # the 32-byte keys themselves, as Python bytes
    info("index memory per million (key, rank) entries", used / 2**20, "MiB")
    info("  of which the keys themselves", keys_bytes / 2**20, "MiB")
    assert idx.num_entries == 1_000_000


def decide(idx: BlockIndex, settle_every: int = 4) -> None:
    view = view_at_scale(WORLD, GPN)
    # the same ranks, showing every ticket the controller could have handed out
    shown = view_at_scale(WORLD, GPN, 2, {r: {"bench": 10**9} for r in range(WORLD)})
    prompt = _keys(128, 10**9)
    replica = Replica(RANK_TO_NODE)
    replica.index = idx
    results: dict[object, float] = {}  # p99 per router
    medians: dict[object, float] = {}
    cpu_p99: dict[object, float] = {}  # the code's own: CPU time of the call, p99
    waited: dict[object, float] = {}  # share of calls that waited > 20 us off the CPU
    settled_p99: dict[object, float] = {}  # p99 of the calls that do not follow a refresh
    first_p50: dict[object, float] = {}  # median of the first call after each refresh
    for router in (Router.LEAST_LOADED, Router.PRECISE_PREFIX, Router.PRECISE_PREFIX):
        if router in results:  # the second time: the same index with no host tiers
            replica.index = hot_index(host=False)[0]
        ctl = AdmissionController(
            lambda: view,
            refresh_interval_s=3600.0,
            controller_id="bench",
            router=router,
            index_source=lambda cursor: (cursor, [], False),
        )
        ctl.refresh(force=True)
        ctl.policy.blocks = replica
        lat, cpu, follows = [], [], []
        version = view.version
        for i in range(10_000):
            n = 32 + i % 97
            req = AdmissionRequest(f"r{i}", n * 16 + 1, 256, tuple(prompt[:n]))
            c0, t0 = time.thread_time(), time.perf_counter()
            d = ctl.decide(req)
            lat.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            assert d.outcome is Outcome.ADMIT, d
            follows.append(i % settle_every == 0)
            if i % settle_every == settle_every - 1:  # placed: the ranks show the tickets
                version += 1
                ctl.load_view(dataclasses.replace(shown, version=version))
        lat, cpu, follows = lat[500:], cpu[500:], follows[500:]
        key = "gpu only" if router in results else router
        results[key] = percentile(lat, 0.99)
        medians[key] = percentile(lat, 0.5)
        cpu_p99[key] = percentile(cpu, 0.99)
        # wall time the thread did not run: the operating system's part of the tail
        settled_p99[key] = percentile([t for t, f in zip(lat, follows, strict=True) if not f], 0.99)
        first_p50[key] = percentile([t for t, f in zip(lat, follows, strict=True) if f], 0.5)
        waited[key] = sum(1 for w, c in zip(lat, cpu, strict=True) if w - c > 20e-6) / len(lat)
    base = results[Router.LEAST_LOADED]
    info("decide() least_loaded, median (same run)", medians[Router.LEAST_LOADED] * 1e6, "us")
    info("decide() least_loaded, p99 (same run)", base * 1e6, "us")
    for key, where in ((Router.PRECISE_PREFIX, "GPU and host tiers"), ("gpu only", "GPU only")):
        info(f"decide() precise_prefix, median ({where})", medians[key] * 1e6, "us")
        report(f"decide() precise_prefix, p99, 1,024 ranks ({where})", results[key] * 1e6, "us",
               100.0)  # fmt: skip
        info("  ratio to least_loaded", results[key] / base, "x")
        report(f"  its CPU time p99: the code's own tail ({where})", cpu_p99[key] * 1e6, "us",
               100.0)  # fmt: skip
        info("  calls that waited > 20 us off the CPU (the OS's)", 100 * waited[key], "%")
        info(
            f"  p99 of the calls not right after a refresh ({where})", settled_p99[key] * 1e6, "us"
        )
        info(
            f"  the first call after a refresh, median ({where}; a refresh every {settle_every})",
            first_p50[key] * 1e6,
            "us",
        )
    info("decide() least_loaded, CPU time p99 (same run)", cpu_p99[Router.LEAST_LOADED] * 1e6, "us")


if __name__ == "__main__":
    ingest()
    idx = match()
    memory()
    decide(idx)
