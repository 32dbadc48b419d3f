"""Admission as a pure function of (view, this controller's unseen promises, request,
now_s). No Ray. DESIGN §6; docs/admission.md says what is promised.

Blocks needed per window (B tokens per block, F the declared end):

    GUARANTEED_NO_EVICT: F = prompt + max_new_tokens (it runs to the end without eviction)
    MAX_UTILIZATION:     F = prompt + min(max_new_tokens, B)  (the prompt and one block)

    full attention:  ceil(F / B)
    window W:        the most blocks the window holds at once from the prompt to F,
                     at most min(ceil(F / B), ceil(W / B) + 1) (kvfold.worker.windows)

A rank's room in window w is what its last report left uncommitted, less what this
controller promised it since:

    room = total - committed - watermark_blocks - reserved

`committed` is the rank's own count (held blocks plus what its sequences may still
need, kvfold.worker.commitments); `reserved` holds only the admissions whose ticket
the rank has not shown yet (kvfold.worker.tickets): a reservation is released the
moment a view shows its ticket. With `num_controllers` controllers admitting into
the same ranks, each promises only from its lease, room // num_controllers; a
request larger than any lease may take a whole rank's room where this controller
has nothing unseen (the rank's own check refuses a collision).

Outcomes, checked in this order:
    QUEUE  no_fresh_capacity        no fresh rank at all (never an admit onto stale numbers)
    REJECT exceeds_rank_capacity    no fresh rank could hold it at its full length, empty
                                    (total - watermark_blocks; under either policy: a
                                    request that can never finish is never admitted)
    ADMIT  fits | fits_prefix       on the rank the router picks among those that fit
                                    (kvfold.admission.routing; fits_prefix: it holds some
                                    of the prompt, as far as the router knows)
    QUEUE  insufficient_free_blocks fits a rank's total, not its room now
"""

from __future__ import annotations

import enum
import operator
import os
import secrets
import socket
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvfold.admission.reservations import ReservationBook
from kvfold.admission.routing import (
    Router,
    RoutingWeights,
    SentPrefixes,
    lowest,
    precise_cost,
)
from kvfold.blockindex.feed import Replica
from kvfold.checks import check_int, check_positive
from kvfold.stats import Window, window_sort_key
from kvfold.view import ClusterView, SourceState
from kvfold.worker.commitments import Policy, declared_end
from kvfold.worker.tickets import MAX_CONTROLLER_ID_CHARS, Ticket, check_controller_id
from kvfold.worker.windows import window_manager

IntArray = npt.NDArray[np.int64]
FRESH = SourceState.FRESH

__all__ = [
    "AdmissionPolicy",
    "AdmissionRequest",
    "Decision",
    "Outcome",
    "Policy",
    "blocks_needed",
    "new_controller_id",
]


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
    """What to do with a request, why, and on which view. An ADMIT names the rank and
    carries what the scheduler passes to it with the request: the policy and the ticket."""

    outcome: Outcome
    reason: str
    view_version: int
    node: int | None = None
    rank: int | None = None
    blocks: dict[Window, int] = field(default_factory=dict)
    ticket: Ticket | None = None
    policy: Policy | None = None
    prefix_blocks: int = 0  # prompt blocks the chosen rank holds, as the router knew it


def blocks_needed(
    prompt_tokens: int,
    max_new_tokens: int,
    windows: Sequence[Window],
    tokens_per_block: int,
    policy: Policy,
) -> dict[Window, int]:
    """The most blocks each window group holds at once while the request grows from its
    prompt to its declared end (what the rank will count as its commitment)."""
    end = declared_end(prompt_tokens, max_new_tokens, policy, tokens_per_block)
    return {w: window_manager(w, tokens_per_block).peak_blocks(prompt_tokens, end) for w in windows}


def new_controller_id(name: str = "") -> str:
    """A controller id unique to this process and start: a restarted controller never
    reuses the ticket numbers its predecessor handed out."""
    base = name or f"{socket.gethostname()[:24]}-{os.getpid()}"
    return f"{base[: MAX_CONTROLLER_ID_CHARS - 9]}-{secrets.token_hex(4)}"


class CapacityIndex:
    """Per-rank capacity of one view as arrays, so a decision is a few vector ops.
    Built in one pass over the ranks (a refresh at 1,024 ranks is on the hot path)."""

    def __init__(self, view: ClusterView, controller_id: str) -> None:
        self.version = view.version
        self.world_size = n = view.world_size
        self.rank_to_node = np.asarray(view.rank_to_node, dtype=np.int64)
        rooms: dict[Window, list[int]] = {}  # total - max(committed, used), per window
        totals: dict[Window, list[int]] = {}
        fresh = [False] * n
        tpb = 0
        seen: dict[int, int] = {}  # this controller's highest ticket each rank has shown
        for node in view.nodes:
            node_fresh = node.state is FRESH
            for r in node.ranks:
                if r.tickets:
                    t = r.tickets.get(controller_id)
                    if t:
                        seen[r.rank] = t
                gpu = r.gpu
                if not (node_fresh and gpu and r.state is FRESH):
                    continue
                rank = r.rank
                fresh[rank] = True
                for w, g in gpu.items():
                    room = rooms.get(w)
                    if room is None:
                        room = rooms[w] = [0] * n
                        totals[w] = [0] * n
                        tpb = tpb or g.tokens_per_block
                    held = g.num_blocks_committed
                    if held < g.num_blocks_used:
                        held = g.num_blocks_used
                    room[rank] = g.num_blocks_total - held
                    totals[w][rank] = g.num_blocks_total
        self.windows: tuple[Window, ...] = tuple(sorted(rooms, key=window_sort_key))
        self.col = {w: i for i, w in enumerate(self.windows)}
        self.tokens_per_block = tpb
        self.managers = [window_manager(w, tpb) for w in self.windows]
        k = len(self.windows)
        self.room: IntArray = np.array([rooms[w] for w in self.windows], dtype=np.int64)
        self.total: IntArray = np.array([totals[w] for w in self.windows], dtype=np.int64)
        self.room.shape = self.total.shape = (k, n)
        self.fresh = np.array(fresh, dtype=bool)
        self.any_fresh = any(fresh)
        self.seen: IntArray = np.zeros(n, dtype=np.int64)
        if seen:
            self.seen[list(seen)] = list(seen.values())


class AdmissionPolicy:
    """Reservations and decisions for one controller. Not thread-safe:
    AdmissionController adds the lock."""

    def __init__(
        self,
        policy: Policy = Policy.GUARANTEED_NO_EVICT,
        watermark_blocks: int = 0,
        reservation_ttl_s: float = 30.0,
        no_fresh: Outcome = Outcome.QUEUE,
        controller_id: str | None = None,
        num_controllers: int = 1,
        affinity_keys: int = 200_000,
        router: Router = Router.APPROX_PREFIX,
        weights: RoutingWeights | None = None,
    ) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy, got {policy!r}")
        check_int("watermark_blocks", watermark_blocks, 0)
        check_positive("reservation_ttl_s", reservation_ttl_s)
        check_int("num_controllers", num_controllers, 1)
        if not isinstance(router, Router):
            raise TypeError(f"router must be a Router, got {router!r}")
        if no_fresh not in (Outcome.QUEUE, Outcome.REJECT):
            raise ValueError(f"no_fresh must be QUEUE or REJECT, got {no_fresh!r}")
        self.capacity_policy = policy
        self.watermark_blocks = watermark_blocks
        self.ttl_s = reservation_ttl_s
        self.no_fresh = no_fresh
        self.controller_id = check_controller_id(controller_id or new_controller_id())
        self.num_controllers = num_controllers
        self.index: CapacityIndex | None = None
        self.book = ReservationBook()  # promises the ranks have not shown yet
        self.last_ticket = 0
        self.settled = 0  # reservations released because a view showed their ticket
        self.expired = 0  # reservations released by their TTL
        self.reserved: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._room: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._capacity: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._min_fresh_capacity: list[int] = []
        self._committed0: IntArray = np.zeros(0, dtype=np.int64)  # first window, per rank
        self._key_to_rank: OrderedDict[bytes, int] = OrderedDict()
        self._affinity_keys = affinity_keys
        self._rng = np.random.default_rng(list(self.controller_id.encode()))
        self.router = router
        self.weights = weights or RoutingWeights()
        self.blocks: Replica | None = None  # the cluster block index, for precise_prefix
        # precise_prefix: prompts this controller sent that the index may not show yet
        self.sent = SentPrefixes(self.weights.sent_ttl_s)
        self._turn = -1  # round_robin: the last rank chosen

    @property
    def reservations(self) -> list[str]:
        """The request ids this controller holds promises for, oldest first."""
        return self.book.request_ids()

    # ---------------------------------------------------------------- views

    def load_view(self, view: ClusterView, now_s: float) -> None:
        """Take a newer view: release the reservations whose ticket it shows, and the
        expired ones; an older or equal version changes nothing but expiry."""
        if self.index is not None and view.version <= self.index.version:
            self.expire(now_s)
            return
        idx = CapacityIndex(view, self.controller_id)
        self.settled += self.book.settle(idx.seen)
        self.expired += self.book.expire(now_s - self.ttl_s)
        self.index = idx
        # fresh ranks' capacity less the watermark; -1 for ranks that are not candidates
        self._capacity = np.where(idx.fresh, idx.total - self.watermark_blocks, -1)
        # per window, the least any fresh rank can hold: a request within it fits some
        # rank's total wherever it is fresh
        fresh_capacity = self._capacity[:, idx.fresh]
        self._min_fresh_capacity = fresh_capacity.min(axis=1).tolist() if idx.any_fresh else []
        self._committed0 = idx.total[0] - idx.room[0] if idx.windows else idx.total.sum(0)
        self._recount(idx)

    def _recount(self, idx: CapacityIndex) -> None:
        self.reserved = self.book.reserved(idx.windows, idx.world_size)
        self._room = self._lease(idx) - self.reserved

    def _lease(self, idx: CapacityIndex) -> IntArray:
        """What this controller may promise per window and rank, before its own
        reservations: the rank's room less the watermark, split among the controllers."""
        room = idx.room - self.watermark_blocks
        return room if self.num_controllers == 1 else room // self.num_controllers

    def expire(self, now_s: float) -> None:
        """Drop reservations not shown by their rank within `ttl_s` (the request never
        reached it: it holds nothing there)."""
        dropped = self.book.expire(now_s - self.ttl_s)
        if dropped:
            self.expired += dropped
            if self.index is not None:
                self._recount(self.index)

    def release(self, request_id: str) -> bool:
        """Forget the promise for a request that will not reach its rank (cancelled,
        refused). True if one was held; once the rank has shown its ticket the rank
        counts the request itself, and this returns False."""
        gone = self.book.remove(request_id)
        if gone is None:
            return False
        rank, blocks = gone
        idx = self.index
        if idx is not None:
            for w, n in blocks.items():
                i = idx.col.get(w)
                if i is not None:
                    self.reserved[i, rank] -= n
                    self._room[i, rank] += n
        return True

    # ---------------------------------------------------------------- decisions

    def room(self) -> IntArray:
        """Blocks this controller could still promise, per window and rank (negative:
        none). Kept up to date as reservations change."""
        return self._room

    def decide(self, request: AdmissionRequest, now_s: float) -> Decision:
        idx = self.index
        version = idx.version if idx is not None else 0
        if idx is None or not idx.any_fresh or not idx.windows:
            return Decision(self.no_fresh, "no_fresh_capacity", version)
        if request.request_id in self.book:
            raise ValueError(
                f"request_id {request.request_id!r} is admitted and not yet placed; "
                "release() it before deciding it again"
            )
        # per window: the blocks it is promised, and what it holds at its full length
        # (which must fit some empty rank, whatever the policy: else it never finishes)
        P, B = request.prompt_tokens, idx.tokens_per_block
        full_end = P + request.max_new_tokens
        end = full_end
        if self.capacity_policy is not Policy.GUARANTEED_NO_EVICT:
            end = declared_end(P, request.max_new_tokens, self.capacity_policy, B)
        need_list = [m.peak_blocks(P, end) for m in idx.managers]
        whole = need_list if end == full_end else [m.peak_blocks(P, full_end) for m in idx.managers]
        need = dict(zip(idx.windows, need_list, strict=True))
        could: npt.NDArray[np.bool_]
        floor = self._min_fresh_capacity
        if len(floor) == len(whole) and all(map(operator.le, whole, floor)):
            could = idx.fresh  # within what every fresh rank can hold (never written to)
        else:
            could = np.all(self._capacity >= np.array(whole)[:, None], axis=0)
            if not could.any():
                return Decision(Outcome.REJECT, "exceeds_rank_capacity", version, blocks=need)
        room = self._room
        single = len(need_list) == 1
        need_col = np.array(need_list)[:, None]
        fits: npt.NDArray[np.bool_] = could & (
            room[0] >= need_list[0] if single else (room >= need_col).all(0)
        )
        overflow = False
        if not fits.any() and self.num_controllers > 1:
            room = self._whole_room_where_no_lease_fits(idx, need_col)
            fits = could & np.all(room >= need_col, axis=0)
            overflow = True
        if not fits.any():
            return Decision(Outcome.QUEUE, "insufficient_free_blocks", version, blocks=need)
        rank, prefix = self._choose(request, fits, room, now_s, overflow)
        self.last_ticket += 1
        self.book.add(request.request_id, rank, self.last_ticket, need, now_s)
        if single:
            self.reserved[0, rank] += need_list[0]
            self._room[0, rank] -= need_list[0]
        else:
            self.reserved[:, rank] += need_col[:, 0]
            self._room[:, rank] -= need_col[:, 0]
        if self.router is Router.APPROX_PREFIX:
            self._remember(request.prefix_keys, rank)
        elif self.router is Router.PRECISE_PREFIX:
            self.sent.add(request.prefix_keys, rank, now_s)
        return Decision(
            Outcome.ADMIT,
            "fits_prefix" if prefix else "fits",
            version,
            node=int(idx.rank_to_node[rank]),
            rank=rank,
            blocks=need,
            ticket=Ticket.trusted(self.controller_id, self.last_ticket),
            policy=self.capacity_policy,
            prefix_blocks=prefix,
        )

    def _whole_room_where_no_lease_fits(self, idx: CapacityIndex, need_col: IntArray) -> IntArray:
        """For a request larger than a lease: a rank's whole room, on ranks where it is
        larger than the lease and this controller has nothing unseen (-1 elsewhere).
        Another controller may promise the same blocks before the next report: the
        rank's own check refuses the collision."""
        whole = idx.room - self.watermark_blocks
        larger = np.any(self._lease(idx) < need_col, axis=0)
        mine = np.any(self.reserved != 0, axis=0)
        return np.where(larger & ~mine, whole, -1)

    def _choose(
        self,
        request: AdmissionRequest,
        fits: npt.NDArray[np.bool_],
        room: IntArray,
        now_s: float,
        overflow: bool = False,
    ) -> tuple[int, int]:
        """The rank among those that fit, by the router (kvfold.admission.routing), and
        the prompt blocks it holds as far as the router knows. Beyond a lease, any rank
        that fits, at random: controllers that all overflow at once would otherwise all
        pick the same rank."""
        if overflow:
            return int(self._rng.choice(np.flatnonzero(fits))), 0
        router = self.router
        blocks = self.blocks
        if (
            router is Router.PRECISE_PREFIX
            and blocks is not None
            and request.prefix_keys
            and blocks.index.world_size == self.index.world_size  # type: ignore[union-attr]
        ):
            assert self.index is not None
            match = blocks.index.match(request.prefix_keys, request.prompt_tokens)
            B = self.index.tokens_per_block
            match = self.sent.overlay(
                match, request.prefix_keys, (request.prompt_tokens - 1) // B, now_s
            )
            prompt_blocks = -(-request.prompt_tokens // B)
            cost = precise_cost(
                match, prompt_blocks, self.weights, self._committed0, self.reserved[0]
            )
            rank = lowest(cost, fits, room)
            return rank, match.of(rank)[1]
        if router is Router.APPROX_PREFIX and request.prefix_keys:
            best, best_len = -1, 0
            for i, key in enumerate(request.prefix_keys):
                r = self._key_to_rank.get(key)
                if r is None:
                    break
                if fits[r] and i + 1 > best_len:
                    best, best_len = r, i + 1
            if best >= 0:
                return best, best_len
        if router is Router.ROUND_ROBIN:
            order = np.flatnonzero(fits)
            later = order[order > self._turn]
            self._turn = int(later[0] if len(later) else order[0])
            return self._turn, 0
        slack = np.where(fits, room.min(axis=0), -1)
        return int(slack.argmax()), 0

    def _remember(self, keys: Sequence[bytes], rank: int) -> None:
        table = self._key_to_rank
        for k in keys:
            table[k] = rank
            table.move_to_end(k)
        while len(table) > self._affinity_keys:
            table.popitem(last=False)

    def promised(self, rank: int) -> dict[Window, int]:
        """Blocks this controller has promised `rank` that the rank has not shown yet."""
        assert self.index is not None
        return {w: int(self.reserved[i, rank]) for i, w in enumerate(self.index.windows)}
