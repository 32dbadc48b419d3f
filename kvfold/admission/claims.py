"""Claims: how a controller takes more of a rank than its lease without another
controller promising the same blocks. Pure; no Ray. docs/admission.md, "Claims".

With leases, each of k controllers promises from room // k of every rank. A request
larger than every lease needs one controller to have more of one rank, which is safe
only once the others have stopped promising there. So it asks the claim desk (in the
aggregator; every controller exchanges a note with it at each refresh):

    ask       controller A's note: rank r, the blocks it needs there
    freeze    every other controller's next board shows A's claim on r: from the moment
              it loads that board it promises nothing more on r, and records what it has
              promised r that its view did not show yet (its ack), at its view's version
    ack       its next note carries that ack
    grant     once every live controller but A has acked, A's board shows the claim
              granted, with the acks summed and the newest version they were taken at
    use       A, holding a view at least that new, may promise r up to
                  room(r) - watermark - acked - A's own unseen promises on r
              which every promise the others have made there already fits beside
    done      A's note ends the claim once the rank has shown that promise, so no other
              controller takes r back before the view it loads with the board shows
              what A placed; or once no decision of A's has wanted it for its hold_s
              (granted or not): a grant waits for the request that asked, which a
              scheduler decides again at its own pace, never for a count of boards

A controller is live while it exchanged within its `hold_s` (the longest it decides on
one view: it QUEUEs past that without a new view, so a silent one cannot be promising
on a view without the claim) and LAPSE_MARGIN_S; a claim whose owner lapses ends. One
claim per rank and per controller at a time. Lost with the desk (an aggregator
restart): then the rank's own check refuses what collides, as it does without claims.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvfold.stats import Window

IntArray = npt.NDArray[np.int64]

__all__ = ["LAPSE_MARGIN_S", "Blocks", "Claim", "ClaimDesk", "ClaimHolder", "ClaimNote"]

Blocks = tuple[tuple[Window, int], ...]  # blocks per window, in the sender's order
LAPSE_MARGIN_S = 1.0  # beyond a controller's hold_s before the desk forgets it


@dataclass(frozen=True, slots=True)
class ClaimNote:
    """What a controller sends at each refresh. `version`: of the view it holds;
    `acks`: (claim id, what it had promised the claimed rank unseen when it froze it,
    the version of its view then) for every claim of others on its board."""

    hold_s: float
    version: int = 0
    ask: tuple[int, Blocks] | None = None
    acks: tuple[tuple[int, Blocks, int], ...] = ()
    done: int | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim as boards show it. `acked`: the others' acks summed per window;
    `ack_version`: the newest view version among them (the owner uses the grant only
    from a view at least that new)."""

    claim_id: int
    rank: int
    owner: str
    need: Blocks
    granted: bool = False
    acked: Blocks = ()
    ack_version: int = 0


@dataclass(slots=True)
class _Open:
    claim_id: int
    rank: int
    owner: str
    need: Blocks
    acks: dict[str, tuple[Blocks, int]] = field(default_factory=dict)
    granted: bool = False


def _check_blocks(what: str, blocks: object) -> Blocks:
    if not isinstance(blocks, tuple) or not all(
        isinstance(p, tuple)
        and len(p) == 2
        and (p[0] is None or (isinstance(p[0], int) and not isinstance(p[0], bool)))
        and isinstance(p[1], int)
        and not isinstance(p[1], bool)
        and p[1] >= 0
        for p in blocks
    ):
        raise ValueError(f"{what} must be a tuple of (window, blocks >= 0) pairs, got {blocks!r}")
    return blocks


def check_note(note: object) -> ClaimNote:
    """The note, or ValueError/TypeError naming what is wrong with it."""
    if not isinstance(note, ClaimNote):
        raise TypeError(f"a claim note must be a ClaimNote, got {type(note).__name__}")
    if not (
        isinstance(note.hold_s, (int, float)) and math.isfinite(note.hold_s) and note.hold_s > 0
    ):
        raise ValueError(f"hold_s must be a finite number > 0, got {note.hold_s!r}")
    if not isinstance(note.version, int) or note.version < 0:
        raise ValueError(f"version must be an int >= 0, got {note.version!r}")
    if note.ask is not None:
        if not (isinstance(note.ask, tuple) and len(note.ask) == 2):
            raise ValueError(f"ask must be (rank, blocks), got {note.ask!r}")
        rank, need = note.ask
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"the asked rank must be an int >= 0, got {rank!r}")
        _check_blocks("the asked blocks", need)
    if not isinstance(note.acks, tuple):
        raise ValueError(f"acks must be a tuple, got {note.acks!r}")
    for ack in note.acks:
        if not (isinstance(ack, tuple) and len(ack) == 3 and isinstance(ack[0], int)):
            raise ValueError(f"an ack must be (claim id, blocks, version), got {ack!r}")
        _check_blocks("an ack's blocks", ack[1])
        if not isinstance(ack[2], int) or ack[2] < 0:
            raise ValueError(f"an ack's version must be an int >= 0, got {ack[2]!r}")
    if note.done is not None and not isinstance(note.done, int):
        raise ValueError(f"done must be a claim id or None, got {note.done!r}")
    return note


class ClaimDesk:
    """The desk, in the aggregator. `exchange(controller_id, note, now_s)` takes a
    controller's note and answers the board: every open claim, granted or not."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}  # controller -> (last exchange, hold)
        self._open: dict[int, _Open] = {}  # by rank
        self._next_id = 1
        self.granted_total = 0
        self.ended_total = 0

    @property
    def controllers(self) -> list[str]:
        """The controllers it counts live, by id."""
        return sorted(self._last)

    def board(self) -> tuple[Claim, ...]:
        """Every open claim, as the next exchange would answer (for display and tests)."""
        return tuple(self._board(c) for c in self._open.values())

    def exchange(self, controller_id: str, note: ClaimNote, now_s: float) -> tuple[Claim, ...]:
        check_note(note)  # before anything changes
        self._last[controller_id] = (now_s, float(note.hold_s))
        self._forget_lapsed(now_s)
        if note.done is not None:
            for rank, c in list(self._open.items()):
                if c.claim_id == note.done and c.owner == controller_id:
                    self._end(rank)
        by_id = {c.claim_id: c for c in self._open.values()}
        for claim_id, blocks, version in note.acks:
            acked = by_id.get(claim_id)
            if acked is not None and acked.owner != controller_id:
                acked.acks[controller_id] = (blocks, version)
        if note.ask is not None:
            rank, need = note.ask
            mine = any(c.owner == controller_id for c in self._open.values())
            if not mine and rank not in self._open:
                self._open[rank] = _Open(self._next_id, rank, controller_id, need)
                self._next_id += 1
        for c in self._open.values():
            if not c.granted and all(o in c.acks for o in self._last if o != c.owner):
                c.granted = True
                self.granted_total += 1
        return self.board()

    def _forget_lapsed(self, now_s: float) -> None:
        gone = [o for o, (t, hold) in self._last.items() if now_s > t + hold + LAPSE_MARGIN_S]
        for o in gone:
            del self._last[o]
        if gone:
            for rank in [r for r, c in self._open.items() if c.owner in gone]:
                self._end(rank)

    def _end(self, rank: int) -> None:
        del self._open[rank]
        self.ended_total += 1

    @staticmethod
    def _board(c: _Open) -> Claim:
        if not c.granted:
            return Claim(c.claim_id, c.rank, c.owner, c.need)
        summed: dict[Window, int] = {}
        for blocks, _ in c.acks.values():
            for w, n in blocks:
                summed[w] = summed.get(w, 0) + n
        version = max((v for _, v in c.acks.values()), default=0)
        return Claim(c.claim_id, c.rank, c.owner, c.need, True, tuple(summed.items()), version)


def as_blocks(windows: tuple[Window, ...], column: IntArray | list[int]) -> Blocks:
    """Blocks per window from a column of counts in `windows`' order."""
    return tuple((w, int(column[i])) for i, w in enumerate(windows))


def in_order(windows: tuple[Window, ...], blocks: Blocks) -> IntArray:
    """`blocks` as a column in `windows`' order (a window it does not name: 0)."""
    of: Mapping[Window, int] = dict(blocks)
    return np.array([of.get(w, 0) for w in windows], dtype=np.int64)


class ClaimHolder:
    """A controller's side of the desk: the ranks others hold claims on (frozen for
    this controller's leases), its own claim, and what its next note says. Every note
    says again what the desk may have missed (acks, done, the ask), so a lost exchange
    costs a round, never a wrong board. Driven by AdmissionPolicy under its lock."""

    def __init__(self, controller_id: str) -> None:
        self.controller_id = controller_id
        self.frozen: dict[int, int] = {}  # rank -> the claim of another's on it
        self.acks: dict[int, tuple[Blocks, int]] = {}  # claim id -> ack (taken at freeze)
        self.mine: Claim | None = None
        self.ask: tuple[int, Blocks] | None = None  # to send; cleared by the next board
        self.asked = False  # the ask went out in a note whose board has not come yet
        self.used: str | None = None  # the request promised under the grant
        self.wanted_s = -math.inf  # the last decision that wanted more than a lease
        self.done: int | None = None  # the claim to end, until a board no longer has it
        self.frozen_mask: npt.NDArray[np.bool_] = np.zeros(0, dtype=bool)

    def want(self, now_s: float) -> None:
        """A decision wanted more than this controller's lease (its claim, or a new one)."""
        self.wanted_s = max(self.wanted_s, now_s)

    def note(self, hold_s: float, version: int, unseen: Container[str], now_s: float) -> ClaimNote:
        """The note for the next exchange. `unseen`: the requests whose promise no
        view has shown yet (the reservation book); `now_s`: on the clock of want()."""
        mine = self.mine
        if mine is not None and self.done is None:
            if self.used is not None and self.used not in unseen:
                self.done = mine.claim_id  # its rank shows it (or it was released)
            elif self.used is None and now_s - self.wanted_s > hold_s:
                self.done = mine.claim_id  # no decision has wanted it for a hold
        acks = tuple((cid, b, v) for cid, (b, v) in self.acks.items())
        ask = self.ask if mine is None else None
        self.asked = ask is not None
        return ClaimNote(hold_s, version, ask, acks, self.done)

    def load(
        self,
        board: tuple[Claim, ...],
        windows: tuple[Window, ...],
        reserved: IntArray,
        version: int,
    ) -> None:
        """Take a board, with `reserved` (per window and rank: this controller's unseen
        promises, at the view of `version`) for the acks of claims new to it."""
        frozen: dict[int, int] = {}
        mine: Claim | None = None
        for c in board:
            if c.owner == self.controller_id:
                mine = c
                continue
            frozen[c.rank] = c.claim_id
            if c.claim_id not in self.acks:
                column = reserved[:, c.rank] if c.rank < reserved.shape[1] else [0] * len(windows)
                self.acks[c.claim_id] = (as_blocks(windows, column), version)
        live = set(frozen.values())
        self.acks = {cid: a for cid, a in self.acks.items() if cid in live}
        self.frozen = frozen
        if mine is None or (self.mine is not None and mine.claim_id != self.mine.claim_id):
            self.used = None
        if self.done is not None and (mine is None or mine.claim_id != self.done):
            self.done = None
        if mine is not None and mine.claim_id == self.done:
            mine = None  # ending: never promised on again
        self.mine = mine
        if mine is not None or self.asked:
            self.ask = None  # taken, or refused (the rank is another's): ask anew later
        self.asked = False
        mask = np.zeros(reserved.shape[1], dtype=bool)
        ranks = [r for r in frozen if r < len(mask)]
        mask[ranks] = True
        self.frozen_mask = mask

    def grant_room(
        self, version: int, windows: tuple[Window, ...], room: IntArray, reserved: IntArray
    ) -> tuple[int, IntArray] | None:
        """(rank, per window what this controller may promise there under its grant),
        or None when it holds no grant usable from the view of `version`. `room`: the
        view's room less the watermark, per window and rank."""
        mine = self.mine
        if mine is None or not mine.granted or self.used is not None or version < mine.ack_version:
            return None
        r = mine.rank
        if r >= room.shape[1]:
            return None
        return r, room[:, r] - in_order(windows, mine.acked) - reserved[:, r]
