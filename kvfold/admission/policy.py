"""AdmissionPolicy: one controller's reservations and decisions, as a pure function of
(view, this controller's unseen promises, request, now_s). No Ray. DESIGN §6;
docs/admission.md says what is promised.

A rank's room in window w is what its last report left uncommitted (kvfold.admission.
capacity), less the watermark and what this controller promised it since:

    room = total - committed - watermark_blocks - reserved

`reserved` holds only the admissions whose ticket the rank has not shown yet
(kvfold.tickets): a reservation is released the moment a view shows its ticket.
With `num_controllers` controllers admitting into the same ranks, each promises only
from its lease, room // num_controllers; a request larger than any lease may take a
whole rank's room where this controller has nothing unseen (the rank's own check
refuses a collision), or, with a claim desk (`claims=True`; kvfold.admission.claims),
only what a claim granted it there once the others stopped promising on that rank.

The blocks a request needs and the outcomes, in the order they are checked, are in
kvfold.admission.decision; which rank among those that fit, in kvfold.admission.routing.
"""

from __future__ import annotations

import operator
import os
import secrets
import socket

import numpy as np
import numpy.typing as npt

from kvfold.admission.capacity import CapacityIndex, ViewCapacity
from kvfold.admission.claims import Claim, ClaimHolder, ClaimNote, as_blocks
from kvfold.admission.decision import AdmissionRequest, Decision, Outcome
from kvfold.admission.reservations import ReservationBook
from kvfold.admission.routing import RankChooser, Router, RoutingWeights
from kvfold.blockindex.feed import Replica
from kvfold.checks import check_int, check_positive
from kvfold.stats import Window
from kvfold.tickets import MAX_CONTROLLER_ID_CHARS, Ticket, check_controller_id
from kvfold.view import ClusterView
from kvfold.worker.commitments import Policy, blocks_to_end, declared_end

IntArray = npt.NDArray[np.int64]

__all__ = ["AdmissionPolicy", "new_controller_id"]


def new_controller_id(name: str = "") -> str:
    """A controller id unique to this process and start: a restarted controller never
    reuses the ticket numbers its predecessor handed out."""
    base = name or f"{socket.gethostname()[:24]}-{os.getpid()}"
    return f"{base[: MAX_CONTROLLER_ID_CHARS - 9]}-{secrets.token_hex(4)}"


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
        claims: bool = False,
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
        # beyond a lease: by claims at a desk when the controllers share one
        self.claims = ClaimHolder(self.controller_id) if claims and num_controllers > 1 else None
        self.index: CapacityIndex | None = None
        self._views = ViewCapacity(self.controller_id)  # for load_view: rows of changed nodes
        self.book = ReservationBook()  # promises the ranks have not shown yet
        self.last_ticket = 0
        self.settled = 0  # reservations released because a view showed their ticket
        self.expired = 0  # reservations released by their TTL
        self.reserved: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._room: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._capacity: IntArray = np.zeros((0, 0), dtype=np.int64)
        self._min_fresh_capacity: list[int] = []
        self._committed0: IntArray = np.zeros(0, dtype=np.int64)  # first window, per rank
        self.router = router
        self.chooser = RankChooser(
            router, weights or RoutingWeights(), self.controller_id.encode(), affinity_keys
        )

    @property
    def blocks(self) -> Replica | None:
        """The replica of the cluster block index precise_prefix routes by (the
        controller keeps it up to date; None: routing without it)."""
        return self.chooser.blocks

    @blocks.setter
    def blocks(self, replica: Replica | None) -> None:
        self.chooser.blocks = replica

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
        self.load_capacity(self._views.index(view), now_s)

    def load_capacity(self, idx: CapacityIndex, now_s: float) -> None:
        """load_view for a view's capacity alone (kvfold.aggregator.capacity_delta)."""
        if self.index is not None and idx.version <= self.index.version:
            self.expire(now_s)
            return
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
        reservations: the rank's room less the watermark, split among the controllers;
        nothing on a rank another controller holds a claim on."""
        room = idx.room - self.watermark_blocks
        if self.num_controllers == 1:
            return room
        lease = room // self.num_controllers
        frozen = self.claims.frozen_mask if self.claims is not None else None
        if frozen is not None and frozen.any() and len(frozen) == idx.world_size:
            lease[:, frozen] = 0
        return lease

    # ---------------------------------------------------------------- claims

    def claim_note(self, hold_s: float, now_s: float) -> ClaimNote:
        """What the next exchange with the claim desk says (needs `claims=True`):
        a claim no decision has wanted for `hold_s` ends."""
        assert self.claims is not None
        version = self.index.version if self.index is not None else 0
        return self.claims.note(hold_s, version, self.book, now_s)

    def load_claims(self, board: tuple[Claim, ...]) -> None:
        """Take the desk's board, after the view of the same refresh: freeze the ranks
        others claim (acking what this controller promised them unseen), and see to
        its own claim."""
        assert self.claims is not None
        idx = self.index
        if idx is None:
            return
        self.claims.load(board, idx.windows, self.reserved, idx.version)
        self._recount(idx)

    def expire(self, now_s: float) -> None:
        """Drop reservations not shown by their rank within `ttl_s` (the request never
        reached it: it holds nothing there)."""
        dropped = self.book.expire(now_s - self.ttl_s)
        if dropped:
            self.expired += dropped
            if self.index is not None:
                self._recount(self.index)

    def release(self, request_id: str) -> bool:
        """Forget a request that will not reach its rank (cancelled, refused, lost with
        its rank): its promise, if one is held, and the prompt the router counts as sent
        there (so the rank is not credited with blocks it never got). True if a promise
        was held; once the rank has shown its ticket the rank counts the request itself,
        and this returns False."""
        self.chooser.release(request_id)
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
            why = "capacity_unknown" if idx is not None and idx.num_unknown else "no_fresh_capacity"
            return Decision(self.no_fresh, why, version)
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
        need_list = blocks_to_end(idx.managers, P, end)
        whole = need_list if end == full_end else blocks_to_end(idx.managers, P, full_end)
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
        fits = room[0] >= need_list[0]  # window by window: no (windows, ranks) temporaries
        for i in range(1, len(need_list)):
            fits &= room[i] >= need_list[i]
        fits &= could
        any_fits = fits.any()
        overflow = False
        if not any_fits and self.claims is not None:
            return self._by_claim(request, idx, need_list, could, now_s)
        if not any_fits and self.num_controllers > 1:
            need_col = np.array(need_list)[:, None]
            room = self._whole_room_where_no_lease_fits(idx, need_col)
            fits = could & np.all(room >= need_col, axis=0)
            any_fits = overflow = fits.any()
        if not any_fits:
            return Decision(Outcome.QUEUE, "insufficient_free_blocks", version, blocks=need)
        rank, prefix = self.chooser.choose(
            request,
            fits,
            room,
            now_s,
            idx.tokens_per_block,
            self._committed0,
            self.reserved,
            overflow,
        )
        reason = "fits_overflow" if overflow else "fits_prefix" if prefix else "fits"
        return self._admit(request, idx, rank, need_list, need, now_s, reason, prefix)

    def _admit(
        self,
        request: AdmissionRequest,
        idx: CapacityIndex,
        rank: int,
        need_list: list[int],
        need: dict[Window, int],
        now_s: float,
        reason: str,
        prefix: int,
    ) -> Decision:
        self.last_ticket += 1
        self.book.add(request.request_id, rank, self.last_ticket, need, now_s)
        for i, n in enumerate(need_list):
            self.reserved[i, rank] += n
            self._room[i, rank] -= n
        self.chooser.sent_to(request, rank, now_s)
        return Decision(
            Outcome.ADMIT,
            reason,
            idx.version,
            node=int(idx.rank_to_node[rank]),
            rank=rank,
            blocks=need,
            ticket=Ticket.trusted(self.controller_id, self.last_ticket),
            policy=self.capacity_policy,
            prefix_blocks=prefix,
        )

    def _by_claim(
        self,
        request: AdmissionRequest,
        idx: CapacityIndex,
        need_list: list[int],
        could: npt.NDArray[np.bool_],
        now_s: float,
    ) -> Decision:
        """A request larger than this controller's lease wherever it fits: promised
        under its granted claim, or a claim asked for (kvfold.admission.claims)."""
        h = self.claims
        assert h is not None
        h.want(now_s)
        need = dict(zip(idx.windows, need_list, strict=True))
        need_col = np.array(need_list, dtype=np.int64)
        whole = idx.room - self.watermark_blocks
        if h.mine is not None:
            granted = h.grant_room(idx.version, idx.windows, whole, self.reserved)
            if granted is None:  # not granted yet, not usable from this view, or in use
                return Decision(Outcome.QUEUE, "awaiting_claim", idx.version, blocks=need)
            r, room_r = granted
            if could[r] and bool((room_r >= need_col).all()):
                h.used = request.request_id
                return self._admit(request, idx, r, need_list, need, now_s, "fits_claim", 0)
            h.done = h.mine.claim_id  # the rank filled meanwhile: end it, ask anew
            h.mine = None
        if h.ask is not None:
            return Decision(Outcome.QUEUE, "awaiting_claim", idx.version, blocks=need)
        room = whole - self.reserved
        if len(h.frozen_mask) == idx.world_size:
            room[:, h.frozen_mask] = -1
        fits = could & np.all(room >= need_col[:, None], axis=0)
        if not fits.any():
            return Decision(Outcome.QUEUE, "insufficient_free_blocks", idx.version, blocks=need)
        rank, _ = self.chooser.choose(
            request, fits, room, now_s, idx.tokens_per_block, self._committed0, self.reserved
        )
        h.ask = (rank, as_blocks(idx.windows, need_list))
        return Decision(Outcome.QUEUE, "awaiting_claim", idx.version, blocks=need)

    def _whole_room_where_no_lease_fits(self, idx: CapacityIndex, need_col: IntArray) -> IntArray:
        """For a request larger than a lease: a rank's whole room, on ranks where it is
        larger than the lease and this controller has nothing unseen (-1 elsewhere).
        Another controller may promise the same blocks before the next report: the
        rank's own check refuses the collision."""
        whole = idx.room - self.watermark_blocks
        larger = np.any(self._lease(idx) < need_col, axis=0)
        mine = np.any(self.reserved != 0, axis=0)
        return np.where(larger & ~mine, whole, -1)

    def promised(self, rank: int) -> dict[Window, int]:
        """Blocks this controller has promised `rank` that the rank has not shown yet."""
        assert self.index is not None
        return {w: int(self.reserved[i, rank]) for i, w in enumerate(self.index.windows)}
