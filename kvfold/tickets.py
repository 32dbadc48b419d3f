"""Tickets: how a rank tells each admission controller which of its promises it holds.

A controller stamps every request it admits with a ticket (its id, a number that
grows with every admission). The rank records, per controller, the highest ticket
it has taken in (placed or refused) and reports the table with its gauges, in one
snapshot: a controller's reservation whose ticket is at or below the rank's entry
is in the rank's `committed` blocks (or was refused), so it is released exactly then.

A controller places its admissions on a rank in ticket order (waiting for each, or in
one engine step: the rank actor is threaded, so calls sent without waiting may run in
either order); a ticket that arrives after a higher one was seen is late: the rank's
own check still holds it to its capacity. A rank's table starts
empty in each incarnation; a restarted controller takes a new id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfold.checks import check_int

MAX_CONTROLLER_ID_CHARS = 64
MAX_CONTROLLERS = 64  # entries a rank keeps (and reports): the most recently stamped
MAX_TICKET = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Ticket:
    controller: str
    number: int

    @classmethod
    def trusted(cls, controller: str, number: int) -> Ticket:
        """A ticket from parts already checked (a controller's own id and counter)."""
        t = object.__new__(cls)
        object.__setattr__(t, "controller", controller)
        object.__setattr__(t, "number", number)
        return t

    def __post_init__(self) -> None:
        check_controller_id(self.controller)
        check_int("ticket number", self.number, 1)
        if self.number > MAX_TICKET:
            raise ValueError(f"ticket number must be <= {MAX_TICKET}, got {self.number}")


TicketLike = Ticket | tuple[str, int] | list[Any] | None
"""A ticket as callers pass it: itself, a (controller id, number) pair, or none."""


def as_ticket(value: TicketLike) -> Ticket | None:
    """A Ticket from itself, None, or a (controller id, number) pair."""
    if value is None or isinstance(value, Ticket):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Ticket(value[0], value[1])
    raise TypeError(f"ticket must be a Ticket or (controller id, number), got {value!r}")


def check_controller_id(controller: object) -> str:
    if (
        not isinstance(controller, str)
        or not controller
        or len(controller) > MAX_CONTROLLER_ID_CHARS
    ):
        raise ValueError(
            f"controller id must be a non-empty str of at most {MAX_CONTROLLER_ID_CHARS} "
            f"chars, got {controller!r}"
        )
    return controller


class TicketBook:
    """Per controller, the highest ticket taken in; the most recent MAX_CONTROLLERS kept."""

    def __init__(self, max_controllers: int = MAX_CONTROLLERS) -> None:
        self.highest: OrderedDict[str, int] = OrderedDict()
        self.max_controllers = max_controllers
        self.late = 0  # tickets that arrived after a higher one of their controller

    def take(self, ticket: Ticket | None) -> None:
        if ticket is None:
            return
        seen = self.highest.get(ticket.controller, 0)
        if ticket.number <= seen:
            self.late += 1
            return
        self.highest[ticket.controller] = ticket.number
        self.highest.move_to_end(ticket.controller)
        while len(self.highest) > self.max_controllers:
            self.highest.popitem(last=False)

    def snapshot(self) -> Mapping[str, int]:
        return dict(self.highest)
