"""Claims beyond a lease (kvfold.admission.claims): the desk's rules, and two controllers
taking a claim through a desk from freeze to end. The model test with three
controllers and stale views is in test_admission_model.py."""

from __future__ import annotations

import pytest

from kvfold.admission import AdmissionController, AdmissionRequest, Outcome
from kvfold.admission.claims import LAPSE_MARGIN_S, Claim, ClaimDesk, ClaimHolder, ClaimNote
from kvfold.topology import Topology
from tests.unit.test_admission import make_view

NEED = ((None, 30),)


def test_a_claim_is_granted_once_every_other_live_controller_acked() -> None:
    desk = ClaimDesk()
    for c in ("a", "b", "c"):
        desk.exchange(c, ClaimNote(1.0), 0.0)
    (claim,) = desk.exchange("a", ClaimNote(1.0, ask=(2, NEED)), 0.1)
    assert (claim.rank, claim.owner, claim.granted) == (2, "a", False)
    desk.exchange("b", ClaimNote(1.0, 7, acks=((claim.claim_id, ((None, 5),), 7),)), 0.2)
    (still,) = desk.exchange("a", ClaimNote(1.0), 0.3)
    assert not still.granted  # c has not acked
    (done,) = desk.exchange("c", ClaimNote(1.0, 9, acks=((claim.claim_id, ((None, 4),), 9),)), 0.4)
    assert done.granted and dict(done.acked) == {None: 9} and done.ack_version == 9
    assert desk.granted_total == 1


def test_one_claim_per_rank_and_per_controller_and_only_its_owner_ends_it() -> None:
    desk = ClaimDesk()
    desk.exchange("a", ClaimNote(1.0, ask=(0, NEED)), 0.0)
    board = desk.exchange("b", ClaimNote(1.0, ask=(0, NEED)), 0.0)  # rank 0 is a's
    assert [(c.rank, c.owner) for c in board] == [(0, "a")]
    board = desk.exchange("a", ClaimNote(1.0, ask=(1, NEED)), 0.0)  # a holds one already
    assert [(c.rank, c.owner) for c in board] == [(0, "a")]
    board = desk.exchange("b", ClaimNote(1.0, done=board[0].claim_id), 0.0)
    assert [c.owner for c in board] == ["a"]  # b cannot end a's claim
    assert desk.exchange("a", ClaimNote(1.0, done=board[0].claim_id), 0.0) == ()


def test_a_lapsed_controller_no_longer_holds_grants_back_and_its_claim_ends() -> None:
    desk = ClaimDesk()
    desk.exchange("silent", ClaimNote(0.5), 0.0)
    (claim,) = desk.exchange("a", ClaimNote(0.5, ask=(3, NEED)), 0.1)
    assert not claim.granted
    # `silent` may still decide on its last view until 0.5 s after it: not yet
    (claim,) = desk.exchange("a", ClaimNote(0.5), 0.5 + LAPSE_MARGIN_S - 0.01)
    assert not claim.granted
    (claim,) = desk.exchange("a", ClaimNote(0.5), 0.5 + LAPSE_MARGIN_S + 0.01)
    assert claim.granted and desk.controllers == ["a"]
    # and an owner that falls silent loses its claim
    board = desk.exchange("b", ClaimNote(0.5), 10.0)
    assert board == () and desk.controllers == ["b"]


@pytest.mark.parametrize(
    ("note", "why"),
    [
        (ClaimNote(0.0), "hold_s"),
        (ClaimNote(float("nan")), "hold_s"),
        (ClaimNote(1.0, version=-1), "version"),
        (ClaimNote(1.0, ask=(-1, NEED)), "rank"),
        (ClaimNote(1.0, ask=(0, ((None, -3),))), "blocks"),
        (ClaimNote(1.0, ask=(0, [(None, 3)])), "blocks"),  # type: ignore[arg-type]
        (ClaimNote(1.0, acks=((1, NEED),)), "ack"),  # type: ignore[arg-type]
        (ClaimNote(1.0, done="x"), "done"),  # type: ignore[arg-type]
        ("a note", "ClaimNote"),
    ],
)
def test_a_bad_note_is_refused_by_name_and_changes_nothing(note: object, why: str) -> None:
    desk = ClaimDesk()
    desk.exchange("a", ClaimNote(1.0, ask=(0, NEED)), 0.0)
    with pytest.raises((ValueError, TypeError), match=why):
        desk.exchange("b", note, 0.0)  # type: ignore[arg-type]
    assert desk.controllers == ["a"]  # b was not taken in
    (claim,) = desk.exchange("a", ClaimNote(1.0), 0.0)
    assert claim.granted  # nobody else is live: granted at once


def test_a_grant_is_used_only_from_a_view_at_least_as_new_as_its_acks() -> None:
    import numpy as np

    holder = ClaimHolder("a")
    granted = Claim(1, 0, "a", NEED, True, ((None, 4),), ack_version=7)
    reserved = np.zeros((1, 2), dtype=np.int64)
    holder.load((granted,), (None,), reserved, 6)
    room = np.array([[50, 50]], dtype=np.int64)
    assert holder.grant_room(6, (None,), room, reserved) is None
    r, free = holder.grant_room(7, (None,), room, reserved)  # type: ignore[misc]
    assert r == 0 and free.tolist() == [46]


def test_two_controllers_take_a_claim_from_freeze_to_end() -> None:
    """A request larger than its lease waits for a claim; the other controller stops
    promising on the claimed rank and acks what it promised there; the grant leaves
    room for that; the claim ends once the rank shows the claimed promise."""
    topo = Topology(2, 2)
    desk = ClaimDesk()
    views = {"now": make_view(topo, total=100, version=1)}

    def exchange(cid: str, note: ClaimNote) -> tuple[Claim, ...]:
        return desk.exchange(cid, note, 0.0)

    a, b = (
        AdmissionController(
            lambda: views["now"], num_controllers=2, refresh_interval_s=1e9, claim_source=exchange
        )
        for _ in range(2)
    )
    for c in (a, b):
        c.refresh(force=True)
    small = b.decide(AdmissionRequest("small", 40, 0))  # 10 blocks, within b's lease of 50
    assert small.outcome is Outcome.ADMIT
    r_small = small.rank
    big = AdmissionRequest("big", 240, 0)  # 60 blocks: larger than any lease of 50
    d = a.decide(big)
    assert (d.outcome, d.reason) == (Outcome.QUEUE, "awaiting_claim")
    a.refresh(force=True)  # the ask goes out
    (claim,) = desk.board()
    assert claim.owner == a.controller_id and not claim.granted
    r = claim.rank
    b.refresh(force=True)  # b freezes r: nothing more of b's goes there
    assert (b.policy.room()[:, r] <= 0).all()
    assert a.decide(big).reason == "awaiting_claim"
    b.refresh(force=True)  # its ack
    a.refresh(force=True)  # the grant
    d = a.decide(big)
    assert (d.outcome, d.reason, d.rank) == (Outcome.ADMIT, "fits_claim", r)
    # what b had promised r unseen was kept beside it
    held_by_b = 10 if r_small == r else 0
    assert d.blocks[None] <= 100 - held_by_b
    # the rank shows the big one: a ends the claim, b takes r back on that view
    views["now"] = make_view(
        topo,
        used={r: 60 + held_by_b},
        total=100,
        version=2,
        tickets={r: {a.controller_id: d.ticket.number}},  # type: ignore[union-attr]
    )
    a.refresh(force=True)  # its view shows the promise (the note went before it)
    assert len(desk.board()) == 1
    a.refresh(force=True)  # done
    b.refresh(force=True)
    assert desk.board() == ()
    assert b.policy.claims is not None and not b.policy.claims.frozen


def test_a_grant_waits_for_a_scheduler_that_decides_again_at_its_own_pace() -> None:
    """The stall of several controllers on a small pool: a grant used to end after two
    boards unused, so a scheduler deciding again less often than every two refreshes
    never found it. A claim now lasts while a decision has wanted it within its
    controller's hold_s, however many boards pass, and ends once none has."""
    topo = Topology(2, 2)
    desk = ClaimDesk()
    clock = {"now": 0.0}
    view = make_view(topo, total=100, version=1)

    def exchange(cid: str, note: ClaimNote) -> tuple[Claim, ...]:
        return desk.exchange(cid, note, clock["now"])

    a, b = (
        AdmissionController(
            lambda: view,
            num_controllers=2,
            refresh_interval_s=0.05,
            view_timeout_s=1.0,  # hold_s: a claim no decision wants for 1 s ends
            clock=lambda: clock["now"],
            claim_source=exchange,
        )
        for _ in range(2)
    )

    def rounds(n: int) -> None:  # n refresh intervals, every controller refreshing in each
        for _ in range(n):
            clock["now"] += 0.05
            for c in (a, b):
                c.refresh(force=True)

    for c in (a, b):
        c.refresh(force=True)
    big = AdmissionRequest("big", 240, 0)  # 60 blocks: larger than either lease of 50
    assert a.decide(big).reason == "awaiting_claim"
    rounds(15)  # 0.75 s of boards: granted after 3, then 12 unused, still within the hold
    (claim,) = desk.board()
    assert claim.granted and claim.owner == a.controller_id
    d = a.decide(big)
    assert (d.outcome, d.reason, d.rank) == (Outcome.ADMIT, "fits_claim", claim.rank)
    assert a.release("big")  # the scheduler could not place it: the claim ends
    rounds(2)
    assert desk.board() == ()

    # asked for, then never wanted again: it ends a hold after the last wanting decision
    assert a.decide(AdmissionRequest("big2", 240, 0)).reason == "awaiting_claim"
    rounds(19)  # 0.95 s
    (claim,) = desk.board()
    assert claim.granted and b.policy.claims is not None and b.policy.claims.frozen
    rounds(3)  # past 1 s: a's note ends it, and b takes the rank back
    assert desk.board() == ()
    assert b.policy.claims.frozen == {} and (b.policy.room()[:, claim.rank] == 50).all()
