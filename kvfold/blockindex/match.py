"""What a prompt could reuse on each rank, as the block index answers it (kvfold.blockindex.index).

Per rank two runs, in blocks from the prompt's first: `gpu` on the rank's own GPU, and
`total`, that run followed by what its node's host tier could onboard after it. Most
ranks hold nothing of a given prompt, and those that do hold it to a few depths (a
system prompt, an earlier turn), so an answer is kept as a few disjoint classes of
ranks with one (gpu, total) each: `Runs`. A router reads one rank, the longest run, or
adds a weighted sum onto its scores from it, touching only the ranks that hold something.
Pure; no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import groupby, pairwise

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Runs:
    """Disjoint classes of ranks: every rank in `masks[k]` (a bitmask of ranks) holds
    `gpu[k]` blocks on its GPU and `total[k]` >= gpu[k] with its host tier's; every
    rank in no class holds none."""

    gpu: tuple[int, ...]
    total: tuple[int, ...]
    masks: tuple[int, ...]
    world_size: int

    def of(self, rank: int) -> tuple[int, int]:
        """One rank's (gpu, total)."""
        bit = 1 << rank
        for g, t, mask in zip(self.gpu, self.total, self.masks, strict=True):
            if mask & bit:
                return g, t
        return 0, 0

    def arrays(self) -> tuple[IntArray, IntArray]:
        """(gpu, total), one entry per rank."""
        n = self.world_size
        gpu, total = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for g, t, mask in zip(self.gpu, self.total, self.masks, strict=True):
            ranks = ranks_of(mask, n)
            gpu[ranks] = g
            total[ranks] = t
        return gpu, total

    def add_weighted(self, out: FloatArray, gpu_weight: float, host_weight: float) -> None:
        """out += gpu_weight x gpu + host_weight x (total - gpu), per rank: one add per
        class (where the host tier adds nothing, gpu_weight x gpu exactly)."""
        n = self.world_size
        for g, t, mask in zip(self.gpu, self.total, self.masks, strict=True):
            out[ranks_of(mask, n)] += gpu_weight * g + host_weight * (t - g)

    @property
    def longest(self) -> int:
        """The longest run any rank has, host included (blocks from the prompt's first)."""
        return max(self.total, default=0)


def no_runs(world_size: int) -> Runs:
    """No rank holds anything."""
    return Runs((), (), (), world_size)


_RANKS: dict[tuple[int, int], npt.NDArray[np.intp]] = {}
_MAX_RANKS = 4096


def ranks_of(mask: int, n: int) -> npt.NDArray[np.intp]:
    """The ranks of a bitmask, as a read-only index array. Kept for the masks seen
    lately: a popular prefix gives the same classes decision after decision."""
    key = (mask, n)
    ranks = _RANKS.get(key)
    if ranks is None:
        raw = np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), np.uint8)
        ranks = np.flatnonzero(np.unpackbits(raw, count=n, bitorder="little"))
        ranks.flags.writeable = False
        if len(_RANKS) >= _MAX_RANKS:
            _RANKS.clear()
        _RANKS[key] = ranks
    return ranks


def walk(masks: Iterable[int], ranks: int) -> tuple[list[int], list[int]]:
    """The runs of `ranks` along successive positions, position i held by masks[i]: a
    rank's run is how many positions from the first all hold it. Returns (ends, nested):
    the ranks in nested[j] (each a subset of the one before) run at least ends[j].
    Equal masks in a row are grouped at C speed, so the cost is one step per change of
    holders, not per position."""
    ends: list[int] = []
    nested: list[int] = []
    pos = 0
    for mask, same in groupby(masks):
        alive = ranks & mask
        if not alive:
            break
        pos += len(list(same))
        if alive == ranks and nested:
            ends[-1] = pos
        else:
            ends.append(pos)
            nested.append(alive)
        ranks = alive
    return ends, nested


def disjoint(nested: list[int]) -> list[int]:
    """Nested masks (each a subset of the one before) as disjoint ones: the ranks in
    each and in none after it."""
    return [m & ~after for m, after in pairwise(nested)] + nested[-1:]


class Match:
    """Per rank, the prompt blocks it could reuse: on its GPU (`gpu`), and with what its
    node's host tier could onboard after them (`total`, >= gpu). Blocks of the prompt's
    full-attention positions: for sliding windows, the covered prefix.

    Kept as `Runs` (or, where window groups were combined, as arrays); `of`, `longest`
    and `add_weighted` read the runs, and the arrays are made only when asked for. `held`
    raises some ranks' (gpu, total): what a controller just sent there, say."""

    __slots__ = ("_arrays", "_held", "_runs", "world_size")

    def __init__(
        self,
        runs: Runs | tuple[IntArray, IntArray],
        held: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        self._runs = runs if isinstance(runs, Runs) else None
        self._arrays = None if isinstance(runs, Runs) else _read_only(runs)
        self._held = dict(held or {})
        self.world_size = runs.world_size if isinstance(runs, Runs) else len(runs[0])

    def with_held(self, rank: int, gpu: int, total: int) -> Match:
        """The same match with `rank` holding at least (gpu, total)."""
        g, t = self.of(rank)
        base = self._runs if self._runs is not None else self._base_arrays()
        return Match(base, {**self._held, rank: (max(g, gpu), max(t, total, gpu))})

    def of(self, rank: int) -> tuple[int, int]:
        """One rank's (gpu, total)."""
        held = self._held.get(rank)
        return held if held is not None else self._base_of(rank)

    def _base_of(self, rank: int) -> tuple[int, int]:
        """One rank's (gpu, total), before `held`."""
        if self._runs is not None:
            return self._runs.of(rank)
        gpu, total = self._base_arrays()
        return int(gpu[rank]), int(total[rank])

    def _base_arrays(self) -> tuple[IntArray, IntArray]:
        if self._arrays is None:
            assert self._runs is not None
            self._arrays = _read_only(self._runs.arrays())
        return self._arrays

    def _with_held(self, which: int) -> IntArray:
        out = self._base_arrays()[which]
        if self._held:
            out = out.copy()
            for rank, held in self._held.items():
                out[rank] = held[which]
            out.flags.writeable = False
        return out

    @property
    def gpu(self) -> IntArray:
        """Per rank, the prompt's blocks (from its first) on the rank's GPU. Read-only."""
        return self._with_held(0)

    @property
    def total(self) -> IntArray:
        """Per rank, `gpu` and the blocks its node's host tier holds right after. Read-only."""
        return self._with_held(1)

    def add_weighted(self, out: FloatArray, gpu_weight: float, host_weight: float) -> None:
        """out += gpu_weight x gpu + host_weight x (total - gpu), per rank, in place,
        touching only the ranks that hold something (from runs: one add per class)."""
        if self._runs is not None:
            self._runs.add_weighted(out, gpu_weight, host_weight)
        else:
            gpu, total = self._base_arrays()
            out += gpu_weight * gpu + host_weight * (total - gpu)
        for rank, (g, t) in self._held.items():
            base_g, base_t = self._base_of(rank)
            out[rank] += gpu_weight * (g - base_g) + host_weight * ((t - g) - (base_t - base_g))

    @property
    def longest(self) -> int:
        """The longest run any rank has, host included."""
        if self._runs is not None:
            longest = self._runs.longest
        else:
            longest = int(self._base_arrays()[1].max(initial=0))
        return max([longest, *(t for _, t in self._held.values())])


def _read_only(arrays: tuple[IntArray, IntArray]) -> tuple[IntArray, IntArray]:
    for a in arrays:
        a.flags.writeable = False
    return arrays
