"""ControllerSettings: how one AdmissionController is set up, as one plain value. Pure; no
Ray. The hand-off to controllers in processes of their own (kvfold.replay.
scheduler_actor.start_controllers): every argument is checked here, before any Ray call,
and each controller builds itself from its settings in its own process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvfold.admission.controller import AdmissionController
from kvfold.admission.decision import Policy
from kvfold.admission.routing import Router, RoutingWeights, as_router
from kvfold.checks import check_bool, check_int, check_positive
from kvfold.tickets import check_controller_id

SENT_TTL_S = RoutingWeights().sent_ttl_s


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    """router: a Router's name (None: precise_prefix where the view source serves the
    cluster block index, else approx_prefix); sent_ttl_s: how long precise_prefix counts
    a prompt it sent as held by its rank before the index shows it; controller_id: None
    for a new one in the controller's process (new_controller_id), or one that no
    controller has used with these ranks before (the ranks remember its tickets);
    refresh_in_background: refresh in a thread of the controller's own
    (AdmissionController); claims: with several controllers, a request larger than
    every lease waits for a claim at the aggregator's desk (False: the overflow rule;
    docs/admission.md)."""

    policy: Policy = Policy.GUARANTEED_NO_EVICT
    num_controllers: int = 1
    watermark_blocks: int = 0
    refresh_interval_s: float = 0.05
    router: str | None = None
    sent_ttl_s: float = SENT_TTL_S
    controller_id: str | None = None
    refresh_in_background: bool = False
    claims: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a Policy, got {self.policy!r}")
        check_int("num_controllers", self.num_controllers, 1)
        check_int("watermark_blocks", self.watermark_blocks, 0)
        r = self.refresh_interval_s
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise TypeError(f"refresh_interval_s must be a number, got {r!r}")
        if not (math.isfinite(r) and r >= 0):
            raise ValueError(f"refresh_interval_s must be a finite number >= 0, got {r!r}")
        if self.router is not None:  # a Router or its name; kept as the name
            object.__setattr__(self, "router", as_router(self.router).value)
        check_positive("sent_ttl_s", self.sent_ttl_s)
        if self.controller_id is not None:
            check_controller_id(self.controller_id)
        check_bool("refresh_in_background", self.refresh_in_background)
        check_bool("claims", self.claims)
        if self.refresh_in_background:
            check_positive("refresh_interval_s", self.refresh_interval_s)

    def build(self, view_source: Any | Callable[[], Any]) -> AdmissionController:
        """The controller these settings describe, on `view_source` (AdmissionController's)."""
        return AdmissionController(
            view_source,
            policy=self.policy,
            watermark_blocks=self.watermark_blocks,
            refresh_interval_s=self.refresh_interval_s,
            controller_id=self.controller_id,
            num_controllers=self.num_controllers,
            router=self.router,
            weights=RoutingWeights(sent_ttl_s=self.sent_ttl_s),
            refresh_in_background=self.refresh_in_background,
            claims=self.claims,
        )


def settings_for_controllers(
    n: int,
    policy: Policy = Policy.GUARANTEED_NO_EVICT,
    *,
    router: Router | str | None = None,
    sent_ttl_s: float = SENT_TTL_S,
    controller_ids: Sequence[str] | None = None,
    watermark_blocks: int = 0,
    refresh_interval_s: float = 0.05,
    refresh_in_background: bool = False,
    claims: bool = True,
) -> list[ControllerSettings]:
    """One ControllerSettings per controller of `n` sharing the ranks (each told there
    are `n`); `controller_ids`: None (each makes its own), or `n` distinct ids."""
    check_int("n", n, 1)
    if controller_ids is None:
        ids: list[str | None] = [None] * n
    else:
        if isinstance(controller_ids, str) or not isinstance(controller_ids, Sequence):
            raise TypeError(f"controller_ids must be a sequence of {n} str, got {controller_ids!r}")
        ids = list(controller_ids)
        if len(ids) != n or len(set(ids)) != n:
            raise ValueError(
                f"controller_ids must be {n} distinct ids (one per controller), got {ids!r}"
            )
    return [
        ControllerSettings(
            policy,
            n,
            watermark_blocks,
            refresh_interval_s,
            router.value if isinstance(router, Router) else router,
            sent_ttl_s,
            cid,
            refresh_in_background,
            claims,
        )
        for cid in ids
    ]
