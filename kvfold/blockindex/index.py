"""BlockIndex: which ranks hold each prefix block on the GPU, which nodes hold it in their
host tier, and per rank the longest run of a prompt's blocks it could reuse.

Per window group, a key maps to a bitmask of ranks (Python ints: one AND checks every
rank at once):

    gpu[g][key]   ranks whose GPU cache holds the key
    host[g][key]  ranks whose node's host tier holds it (a node's bit set for each of
                  its ranks, so GPU and host runs walk together)

`match` walks a prompt's keys the way the cache itself reuses (kvfold.worker.cache): a
run of GPU hits from the window's first block, then a run of host hits onboarded after
it; the answer is a kvfold.blockindex.match.Match.

    gpu_run[r]    = the longest i with keys[start : start+i] all on rank r's GPU
    total_run[r]  = gpu_run[r] + the run its node's host tier holds from there on

Each source's own keys are kept too (`held`), so a source can be dropped or reset
from a snapshot in time proportional to what it held. Pure; no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import islice, repeat
from typing import TypeAlias

import numpy as np

from kvfold.blockindex.match import Match, Runs, disjoint, no_runs, walk
from kvfold.kvevents.events import (
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

    def node_of(self, source: Source) -> int:
        """The node a (known) source is on: a host tier's own, a rank's node."""
        kind, i = source
        return i if kind == HOST else self.rank_to_node[i]

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
    ) -> Runs:
        """Per rank: the GPU run and the GPU-then-host run of keys[start:limit] (blocks).

        The GPU run is one C-level pass: the running AND of the keys' masks, up to the
        first key no rank holds. Then, for each class of ranks with the same GPU run L,
        one more C-level pass over the keys' host masks from position L: a rank's node
        onboards what its host tier holds right after the rank's own GPU run."""
        n = self.world_size
        ks = keys[start:limit]
        if not ks or g >= len(self.gpu):
            return no_runs(n)
        gpu, nested = walk(map(self.gpu[g].get, ks, repeat(0)), self.all_ranks)
        masks = disjoint(nested)
        host = self.host[g]
        if not host:
            return Runs(tuple(gpu), tuple(gpu), tuple(masks), n)
        gpu_runs: list[int] = []
        total_runs: list[int] = []
        classes: list[int] = []
        # the class with no GPU run (it holds something only if its host tier does),
        # then each class with GPU run gpu[k]; a class's walk stops at the first key
        # none of its host tiers hold
        get, size = host.get, len(ks)
        no_gpu = self.all_ranks & ~nested[0] if nested else self.all_ranks
        for run, ranks in zip([0, *gpu], [no_gpu, *masks], strict=True):
            if run < size and get(ks[run], 0) & ranks:
                ends, extended = walk(map(get, islice(ks, run, None), repeat(0)), ranks)
                rest = ranks & ~extended[0]
                if rest and run:
                    gpu_runs.append(run)
                    total_runs.append(run)
                    classes.append(rest)
                for end, mask in zip(ends, disjoint(extended), strict=True):
                    gpu_runs.append(run)
                    total_runs.append(run + end)
                    classes.append(mask)
            elif run:
                gpu_runs.append(run)
                total_runs.append(run)
                classes.append(ranks)
        return Runs(tuple(gpu_runs), tuple(total_runs), tuple(classes), n)

    def match(self, keys: Sequence[BlockHash], prompt_tokens: int) -> Match:
        """Per rank, the blocks of a prompt (its full-block `keys`, `prompt_tokens` long)
        it could reuse: each window group from the block its window first sees, at most
        up to the last token (always computed); a prompt is covered as far as every
        group covers it (a sliding group from its first block on)."""
        n = self.world_size
        B = self.block_size
        if not self.windows or not keys or not B:
            return Match(no_runs(n))
        limit = min(len(keys), (prompt_tokens - 1) // B)
        if len(self.windows) == 1 and None in self.windows.values():  # full attention only
            g = next(iter(self.windows))
            return Match(self.runs(g, keys, 0, limit))
        gpu_cover = tot_cover = None
        for g, window in self.windows.items():
            start = window_manager(window, B).first_block(prompt_tokens)
            gpu_run, tot_run = self.runs(g, keys, start, limit).arrays()
            if start:  # a sliding window: covered up to where its run ends, if it has one
                gpu_run = np.where(gpu_run > 0, gpu_run + start, 0)
                tot_run = np.where(tot_run > 0, tot_run + start, 0)
            gpu_cover = gpu_run if gpu_cover is None else np.minimum(gpu_cover, gpu_run)
            tot_cover = tot_run if tot_cover is None else np.minimum(tot_cover, tot_run)
        assert gpu_cover is not None and tot_cover is not None
        return Match((gpu_cover, tot_cover))

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
