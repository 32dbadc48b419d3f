"""Admission as a pure function of (view, reservations, request, now_s). No Ray.

Blocks needed per window (B tokens per block, F tokens to hold):

    full attention:  ceil(F / B)
    window W:        min(ceil(F / B), ceil(W / B) + 1)

    GUARANTEED_NO_EVICT: F = prompt + max_new_tokens (the request can finish without eviction)
    MAX_UTILIZATION:     F = prompt + B             (the prompt and one block of growth)

Only fresh ranks of fresh nodes are candidates. A rank's room in window w is
    free[w] - reserved[w] - watermark_blocks
where `reserved` holds blocks promised since the rank's reports last accounted
for them. Every window must fit on the same rank.

Outcomes, checked in this order:
    QUEUE  no_fresh_capacity        no fresh rank at all (never an admit onto stale numbers)
    REJECT exceeds_rank_capacity    no fresh rank could hold it empty (total - watermark_blocks)
    ADMIT  fits                     the rank with the longest known prefix, then the most room
    QUEUE  insufficient_free_blocks fits a rank's total, not its room now
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvfold.checks import check_int, check_positive
from kvfold.stats import Window, window_sort_key
from kvfold.view import ClusterView, SourceState
from kvfold.worker.windows import window_manager

IntArray = npt.NDArray[np.int64]


class Policy(enum.Enum):
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    MAX_UTILIZATION = "max_utilization"


class Outcome(enum.Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What a scheduler asks about. prefix_keys: the prompt's full-block keys (optional)."""

    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    prefix_keys: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        for name in ("prompt_tokens", "max_new_tokens"):
            check_int(name, getattr(self, name), 1 if name == "prompt_tokens" else 0)


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    reason: str
    view_version: int
    node: int | None = None
    rank: int | None = None
    blocks: dict[Window, int] = field(default_factory=dict)


def blocks_needed(
    prompt_tokens: int,
    max_new_tokens: int,
    windows: Sequence[Window],
    tokens_per_block: int,
    policy: Policy,
) -> dict[Window, int]:
    """The most blocks each window group holds while the request runs (kvfold.worker.windows):
    to its declared length under GUARANTEED_NO_EVICT, the prompt plus one block else."""
    B = tokens_per_block
    F = prompt_tokens + (max_new_tokens if policy is Policy.GUARANTEED_NO_EVICT else B)
    return {w: window_manager(w, B).max_blocks(F) for w in windows}


@dataclass(slots=True)
class Reservation:
    """Blocks promised to `rank` for a request. Until the rank's reports name the
    request, all of `blocks`; after, only the growth its prompt does not cover
    yet (`residual`), held until release() or the residual TTL."""

    request_id: str
    rank: int
    blocks: dict[Window, int]
    made_at_s: float
    prompt_blocks: dict[Window, int] = field(default_factory=dict)
    accounted: bool = False


class CapacityIndex:
    """Per-rank capacity of one view as arrays, so a decision is a few vector ops."""

    def __init__(self, view: ClusterView) -> None:
        self.version = view.version
        self.world_size = view.world_size
        self.rank_to_node = np.asarray(view.rank_to_node, dtype=np.int64)
        windows: set[Window] = set()
        tpb = 0
        for n in view.fresh_nodes:
            for r in n.ranks:
                if r.state is SourceState.FRESH and r.gpu:
                    windows.update(r.gpu)
                    tpb = tpb or next(iter(r.gpu.values())).tokens_per_block
        self.windows: tuple[Window, ...] = tuple(sorted(windows, key=window_sort_key))
        self.tokens_per_block = tpb
        k = len(self.windows)
        self.free: IntArray = np.zeros((k, self.world_size), dtype=np.int64)
        self.total: IntArray = np.zeros((k, self.world_size), dtype=np.int64)
        self.fresh = np.zeros(self.world_size, dtype=bool)
        col = {w: i for i, w in enumerate(self.windows)}
        for n in view.fresh_nodes:
            for r in n.ranks:
                if r.state is not SourceState.FRESH:
                    continue
                self.fresh[r.rank] = True
                for w, g in (r.gpu or {}).items():
                    self.free[col[w], r.rank] = g.num_blocks_free
                    self.total[col[w], r.rank] = g.num_blocks_total
        self.added: dict[int, frozenset[str | int]] = {
            r.rank: frozenset(r.added_seq_ids)
            for n in view.nodes
            for r in n.ranks
            if r.added_seq_ids
        }


class AdmissionPolicy:
    """Reservations and decisions. Not thread-safe: AdmissionController adds the lock."""

    def __init__(
        self,
        policy: Policy = Policy.GUARANTEED_NO_EVICT,
        watermark_blocks: int = 0,
        reservation_ttl_s: float = 30.0,
        no_fresh: Outcome = Outcome.QUEUE,
        affinity_keys: int = 200_000,
        residual_ttl_s: float = 3600.0,
    ) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy, got {policy!r}")
        check_int("watermark_blocks", watermark_blocks, 0)
        check_positive("reservation_ttl_s", reservation_ttl_s)
        if no_fresh not in (Outcome.QUEUE, Outcome.REJECT):
            raise ValueError(f"no_fresh must be QUEUE or REJECT, got {no_fresh!r}")
        self.capacity_policy = policy
        self.watermark_blocks = watermark_blocks
        self.ttl_s = reservation_ttl_s
        self.residual_ttl_s = residual_ttl_s
        self.no_fresh = no_fresh
        self.index: CapacityIndex | None = None
        self.reservations: dict[str, Reservation] = {}
        self.reserved: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._room: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._capacity: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._key_to_rank: OrderedDict[bytes, int] = OrderedDict()
        self._affinity_keys = affinity_keys

    # ---------------------------------------------------------------- views

    def load_view(self, view: ClusterView, now_s: float) -> None:
        """Take a newer view; release reservations its reports account for, and expired ones."""
        if self.index is not None and view.version <= self.index.version:
            self.expire(now_s)
            return
        old = self.index
        self.index = idx = CapacityIndex(view)
        # fresh ranks' capacity less the watermark; -1 for ranks that are not candidates
        self._capacity = np.where(idx.fresh, idx.total - self.watermark_blocks, -1)
        if old is None or old.windows != idx.windows or old.world_size != idx.world_size:
            self.reserved = np.zeros_like(idx.free)
            self._room = idx.free - self.watermark_blocks
            for res in self.reservations.values():
                self._add(res, +1)
        else:
            self._room = idx.free - self.reserved - self.watermark_blocks
        for res in list(self.reservations.values()):
            if not res.accounted and res.request_id in self.index.added.get(res.rank, ()):
                # the view now counts the prompt's blocks; keep only the growth still to come
                self._add(res, -1)
                res.blocks = {w: n - res.prompt_blocks.get(w, 0) for w, n in res.blocks.items()}
                res.accounted = True
                self._add(res, +1)
        self.expire(now_s)

    def expire(self, now_s: float) -> None:
        """Drop reservations past their TTL: never accounted for within `ttl_s`, or
        accounted but never released within `residual_ttl_s`."""
        for rid, r in list(self.reservations.items()):
            ttl = self.residual_ttl_s if r.accounted else self.ttl_s
            if now_s - r.made_at_s >= ttl:
                self._drop(rid)

    def _add(self, res: Reservation, sign: int) -> None:
        assert self.index is not None
        for w, n in res.blocks.items():
            if w in self.index.windows:
                i = self.index.windows.index(w)
                self.reserved[i, res.rank] += sign * n
                self._room[i, res.rank] -= sign * n

    def _drop(self, request_id: str) -> None:
        res = self.reservations.pop(request_id)
        self._add(res, -1)

    def release(self, request_id: str) -> bool:
        """The request is done (or was never started): free what was promised for it."""
        if request_id not in self.reservations:
            return False
        self._drop(request_id)
        return True

    # ---------------------------------------------------------------- decisions

    def room(self) -> IntArray:
        """Blocks that could still be promised, per window and rank (negative: none).
        Kept up to date as reservations change: free - reserved - watermark."""
        return self._room

    def decide(self, request: AdmissionRequest, now_s: float) -> Decision:
        idx = self.index
        version = idx.version if idx is not None else 0
        if idx is None or not idx.fresh.any() or not idx.windows:
            return Decision(self.no_fresh, "no_fresh_capacity", version)
        if request.request_id in self.reservations:
            raise ValueError(f"request_id {request.request_id!r} already holds a reservation")
        need = blocks_needed(
            request.prompt_tokens,
            request.max_new_tokens,
            idx.windows,
            idx.tokens_per_block,
            self.capacity_policy,
        )
        need_col = np.asarray([need[w] for w in idx.windows], dtype=np.int64)[:, None]
        could: npt.NDArray[np.bool_] = np.all(self._capacity >= need_col, axis=0)
        if not could.any():
            return Decision(Outcome.REJECT, "exceeds_rank_capacity", version, blocks=need)
        room = self._room
        fits: npt.NDArray[np.bool_] = could & np.all(room >= need_col, axis=0)
        if not fits.any():
            return Decision(Outcome.QUEUE, "insufficient_free_blocks", version, blocks=need)
        rank, by_prefix = self._choose(request, fits, room)
        prompt = blocks_needed(
            request.prompt_tokens, 0, idx.windows, idx.tokens_per_block, Policy.GUARANTEED_NO_EVICT
        )
        res = Reservation(request.request_id, rank, need, now_s, prompt)
        self.reservations[request.request_id] = res
        self._add(res, +1)
        self._remember(request.prefix_keys, rank)
        node = int(idx.rank_to_node[rank])
        reason = "fits_prefix" if by_prefix else "fits"
        return Decision(Outcome.ADMIT, reason, version, node=node, rank=rank, blocks=need)

    def _choose(
        self, request: AdmissionRequest, fits: npt.NDArray[np.bool_], room: IntArray
    ) -> tuple[int, bool]:
        """Longest known prefix first; then the most room in the tightest window."""
        if request.prefix_keys:
            best, best_len = -1, 0
            for i, key in enumerate(request.prefix_keys):
                r = self._key_to_rank.get(key)
                if r is None:
                    break
                if fits[r] and i + 1 > best_len:
                    best, best_len = r, i + 1
            if best >= 0:
                return best, True
        slack = np.where(fits, room.min(axis=0), -1)
        return int(slack.argmax()), False

    def _remember(self, keys: Sequence[bytes], rank: int) -> None:
        table = self._key_to_rank
        for k in keys:
            table[k] = rank
            table.move_to_end(k)
        while len(table) > self._affinity_keys:
            table.popitem(last=False)

    def promised(self, rank: int) -> dict[Window, int]:
        assert self.index is not None
        return {w: int(self.reserved[i, rank]) for i, w in enumerate(self.index.windows)}
