"""BlockIndex: which ranks hold each prefix block on the GPU, which nodes hold it in their
host tier, and per rank the longest run of a prompt's blocks it could reuse.

Per window group, a key maps to a bitmask of ranks (Python ints: one AND checks every
rank at once):

    gpu[g][key]   ranks whose GPU cache holds the key
    host[g][key]  ranks whose node's host tier holds it (a node's bit set for each of
                  its ranks, so GPU and host runs walk together)

`match` walks a prompt's keys once, with two running masks, the way the cache itself
reuses (kvfold.worker.cache): a run of GPU hits from the window's first block, then a
run of host hits onboarded after it.

    gpu_run[r]    = the longest i with keys[start : start+i] all on rank r's GPU
    total_run[r]  = gpu_run[r] + the run its node's host tier holds from there on

Each source's own keys are kept too (`held`), so a source can be dropped or reset
from a snapshot in time proportional to what it held. Pure; no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, groupby, repeat, takewhile
from operator import and_
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from kvfold.blockindex.events import (
    GPU,
    HOST,
    RANK,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)
from kvfold.stats import Window
from kvfold.worker.windows import window_manager

Source: TypeAlias = tuple[str, int]  # (RANK, rank) or (HOST, node)
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Runs:
    """Per-rank run lengths, compressed: nested rank masks (each a subset of the one
    before), each lasting `spans[j]` more positions. A rank in masks 0..j holds
    spans[0] + ... + spans[j] blocks. A lookup's answer costs O(distinct lengths)."""

    masks: tuple[int, ...]
    spans: tuple[int, ...]
    world_size: int

    def array(self) -> IntArray:
        """The run of every rank, as an array: a rank in the first c masks holds the
        blocks those masks last. Masks seen lately are unpacked once (popular prefixes
        give the same masks decision after decision)."""
        n = self.world_size
        if not self.masks:
            return np.zeros(n, dtype=np.int64)
        counts = _unpacked(self.masks[0], n).astype(np.intp)
        for m in self.masks[1:]:
            counts += _unpacked(m, n)
        ends = np.array(list(accumulate(self.spans, initial=0)), dtype=np.int64)
        out: IntArray = ends[counts]
        return out

    @property
    def longest(self) -> int:
        return sum(self.spans)


_UNPACKED: dict[tuple[int, int], npt.NDArray[np.uint8]] = {}
_MAX_UNPACKED = 4096


def _unpacked(mask: int, n: int) -> npt.NDArray[np.uint8]:
    """A rank mask as n 0/1 bytes (read-only; kept for the masks seen lately)."""
    key = (mask, n)
    bits = _UNPACKED.get(key)
    if bits is None:
        raw = np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), np.uint8)
        bits = np.unpackbits(raw, count=n, bitorder="little")
        bits.flags.writeable = False
        if len(_UNPACKED) >= _MAX_UNPACKED:
            _UNPACKED.clear()
        _UNPACKED[key] = bits
    return bits


def _runs(acc: list[int], n: int) -> Runs:
    """Runs from the running masks of successive positions (they only lose bits)."""
    masks, spans = [], []
    for m, same in groupby(acc):
        masks.append(m)
        spans.append(len(list(same)))
    return Runs(tuple(masks), tuple(spans), n)


class Match:
    """Per rank, the prompt blocks it could reuse: on its GPU (`gpu`), and with what its
    node's host tier could onboard after them (`total`, >= gpu). Blocks of the
    prompt's full-attention positions: for sliding windows, the covered prefix.
    Built from compressed runs; the arrays are made when first asked for."""

    __slots__ = ("_gpu", "_gpu_runs", "_total", "_total_runs")

    def __init__(
        self,
        gpu: IntArray | Runs,
        total: IntArray | Runs,
    ) -> None:
        self._gpu_runs = gpu if isinstance(gpu, Runs) else None
        self._total_runs = total if isinstance(total, Runs) else None
        self._gpu = None if isinstance(gpu, Runs) else gpu
        self._total = None if isinstance(total, Runs) else total

    @property
    def gpu(self) -> IntArray:
        if self._gpu is None:
            assert self._gpu_runs is not None
            self._gpu = self._gpu_runs.array()
        return self._gpu

    @property
    def total(self) -> IntArray:
        if self._total is None:
            assert self._total_runs is not None
            t = self._total_runs
            self._total = self.gpu if t is self._gpu_runs else t.array()
        return self._total

    @property
    def longest(self) -> int:
        """The longest run any rank has, host included."""
        if self._total_runs is not None:
            return self._total_runs.longest
        return int(self.total.max(initial=0))


class BlockIndex:
    def __init__(self, rank_to_node: Sequence[int]) -> None:
        self.rank_to_node = list(rank_to_node)
        self.world_size = n = len(self.rank_to_node)
        self.all_ranks = (1 << n) - 1
        self.node_mask: dict[int, int] = {}
        for r, node in enumerate(self.rank_to_node):
            self.node_mask[node] = self.node_mask.get(node, 0) | (1 << r)
        self.gpu: list[dict[BlockHash, int]] = []
        self.host: list[dict[BlockHash, int]] = []  # rank-expanded masks
        self.host_nodes: list[dict[BlockHash, int]] = []  # node masks
        self.windows: dict[int, Window] = {}  # group -> window, as events said
        self.block_size = 0
        self.held: dict[Source, list[set[BlockHash]]] = {}
        self.ignored_events = 0  # events of a medium the source does not own

    # ------------------------------------------------------------------ changes

    def _group(self, g: int) -> None:
        while len(self.gpu) <= g:
            self.gpu.append({})
            self.host.append({})
            self.host_nodes.append({})

    def _sets(self, source: Source, g: int) -> set[BlockHash]:
        sets = self.held.get(source)
        if sets is None:
            sets = self.held[source] = []
        while len(sets) <= g:
            sets.append(set())
        return sets[g]

    def check_source(self, source: Source) -> None:
        kind, i = source
        known = 0 <= i < self.world_size if kind == RANK else kind == HOST and i in self.node_mask
        if not known:
            raise ValueError(f"block index: unknown source {source!r}")

    def store(self, source: Source, g: int, keys: Iterable[BlockHash]) -> None:
        self._group(g)
        held = self._sets(source, g)
        kind, i = source
        if kind == RANK:
            table, bit = self.gpu[g], 1 << i
            get = table.get
            for k in keys:
                table[k] = get(k, 0) | bit
                held.add(k)
            return
        nodes, ranks, nbit, rbits = self.host_nodes[g], self.host[g], 1 << i, self.node_mask[i]
        for k in keys:
            nodes[k] = nodes.get(k, 0) | nbit
            ranks[k] = ranks.get(k, 0) | rbits
            held.add(k)

    def remove(self, source: Source, g: int, keys: Iterable[BlockHash]) -> None:
        held = self.held.get(source)
        if held is None or g >= len(held):
            return
        mine = held[g]
        kind, i = source
        if kind == RANK:
            table, keep = self.gpu[g], ~(1 << i)
            for k in keys:
                if k in mine:
                    mine.discard(k)
                    m = table[k] & keep
                    if m:
                        table[k] = m
                    else:
                        del table[k]
            return
        nodes, ranks, keep = self.host_nodes[g], self.host[g], ~(1 << i)
        for k in keys:
            if k in mine:
                mine.discard(k)
                m = nodes[k] & keep
                if m:
                    nodes[k] = m
                    ranks[k] = self._expand(m)
                else:
                    del nodes[k]
                    del ranks[k]

    def _expand(self, node_mask: int) -> int:
        out = 0
        while node_mask:
            low = node_mask & -node_mask
            out |= self.node_mask[low.bit_length() - 1]
            node_mask ^= low
        return out

    def clear(self, source: Source) -> None:
        """Forget everything `source` holds (AllBlocksCleared; a dead source)."""
        for g, keys in enumerate(self.held.get(source, [])):
            self.remove(source, g, list(keys))
        self.held.pop(source, None)

    def reset(
        self,
        source: Source,
        keys: Mapping[int, Iterable[BlockHash]],
        windows: Mapping[int, Window],
        block_size: int = 0,
    ) -> None:
        """Replace what `source` holds with a snapshot of its keys, per group."""
        self.check_source(source)
        self.clear(source)
        self.windows.update(windows)
        self.block_size = self.block_size or block_size
        for g, ks in keys.items():
            self.store(source, g, ks)

    def apply(self, source: Source, events: Iterable[Event]) -> None:
        """Apply one batch of a source's events, in order."""
        own = GPU if source[0] == RANK else None
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.clear(source)
                continue
            if (e.medium == GPU) != (own == GPU):
                self.ignored_events += 1  # e.g. a rank's own CPU tier: not the node's
                continue
            if isinstance(e, BlockStored):
                self.windows.setdefault(e.group_idx, e.sliding_window)
                self.block_size = self.block_size or e.block_size
                self.store(source, e.group_idx, e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.remove(source, e.group_idx, e.block_hashes)

    # ------------------------------------------------------------------ queries

    def keys_of(self, source: Source) -> dict[int, set[BlockHash]]:
        """What the index holds for `source`, per group (non-empty groups only)."""
        return {g: set(s) for g, s in enumerate(self.held.get(source, [])) if s}

    def sources(self) -> list[Source]:
        return [s for s, sets in self.held.items() if any(sets)]

    @property
    def num_entries(self) -> int:
        """(key, source) pairs held."""
        return sum(len(s) for sets in self.held.values() for s in sets)

    def runs(
        self, g: int, keys: Sequence[BlockHash], start: int = 0, limit: int | None = None
    ) -> tuple[Runs, Runs]:
        """Per rank: the GPU run and the GPU-then-host run of keys[start:limit] (blocks).

        The GPU run is one C-level pass (the running AND of the keys' masks, up to the
        first key no rank holds); the host walk covers only the keys some host tier holds."""
        n = self.world_size
        ks = keys[start:limit]
        if not ks or g >= len(self.gpu):
            none = Runs((), (), n)
            return none, none
        gacc = list(takewhile(bool, accumulate(map(self.gpu[g].get, ks, repeat(0)), and_)))
        gpu_runs = _runs(gacc, n)
        host = self.host[g]
        if not host:
            return gpu_runs, gpu_runs
        hs = list(map(host.get, ks, repeat(0)))
        held = list(compress(range(len(hs)), hs))
        if not held:
            return gpu_runs, gpu_runs
        # alive[i] = gacc[i] | (alive[i-1] & hs[i]): equal to gacc[i] wherever no host
        # tier holds key i, so only [first host key, last host key] needs the walk
        gacc_full = gacc + [0] * (len(ks) - len(gacc))
        lo, hi = held[0], held[-1]
        if lo > len(gacc):  # every GPU run ended before the first key a host tier holds
            return gpu_runs, gpu_runs
        alive_acc = gacc_full[:lo]
        alive = alive_acc[-1] if lo else self.all_ranks
        for i in range(lo, hi + 1):
            alive = gacc_full[i] | (alive & hs[i])
            if not alive:
                break
            alive_acc.append(alive)
        else:
            alive_acc += list(takewhile(bool, gacc_full[hi + 1 :]))
        return gpu_runs, _runs(alive_acc, n)

    def match(self, keys: Sequence[BlockHash], prompt_tokens: int) -> Match:
        """Per rank, the blocks of a prompt (its full-block `keys`, `prompt_tokens` long)
        it could reuse: each window group from the block its window first sees, at most
        up to the last token (always computed); a prompt is covered as far as every
        group covers it (a sliding group from its first block on)."""
        n = self.world_size
        B = self.block_size
        if not self.windows or not keys or not B:
            none = Runs((), (), n)
            return Match(none, none)
        limit = min(len(keys), (prompt_tokens - 1) // B)
        if len(self.windows) == 1 and None in self.windows.values():  # full attention only
            g = next(iter(self.windows))
            return Match(*self.runs(g, keys, 0, limit))
        gpu_cover = tot_cover = None
        for g, window in self.windows.items():
            start = window_manager(window, B).first_block(prompt_tokens)
            gpu_runs, tot_runs = self.runs(g, keys, start, limit)
            gpu_run, tot_run = gpu_runs.array(), tot_runs.array()
            if start:  # a sliding window: covered up to where its run ends, if it has one
                gpu_run = np.where(gpu_run > 0, gpu_run + start, 0)
                tot_run = np.where(tot_run > 0, tot_run + start, 0)
            gpu_cover = gpu_run if gpu_cover is None else np.minimum(gpu_cover, gpu_run)
            tot_cover = tot_run if tot_cover is None else np.minimum(tot_cover, tot_run)
        assert gpu_cover is not None and tot_cover is not None
        return Match(gpu_cover, tot_cover)

    def node_run(self, node: int, keys: Sequence[BlockHash], g: int = 0) -> int:
        """How many leading `keys` node's host tier holds in group g."""
        if g >= len(self.host_nodes):
            return 0
        table, bit, n = self.host_nodes[g], 1 << node, 0
        for k in keys:
            if not table.get(k, 0) & bit:
                break
            n += 1
        return n
