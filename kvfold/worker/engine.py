"""The seam between a rank and the engine that drives its cache.

A rank actor owns one PagedKVCache and, optionally, one engine built over it by an
`EngineFactory`. kvfold's simulated engine (kvfold.workload.engine.SimEngine) is one
implementation; a real engine's adapter is another. The rank only forwards steps and
reports what the engine did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvfold.tickets import Ticket, as_ticket
from kvfold.worker.cache import PagedKVCache
from kvfold.worker.commitments import Policy, as_policy, declared_new_tokens
from kvfold.worker.sequence import SeqId


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request placed on this rank: its prompt, how many tokens it may generate, what
    its admission promised, and the admitting controller's ticket (kvfold.tickets)."""

    seq_id: SeqId
    prompt: Sequence[int] | np.ndarray
    max_new_tokens: int
    salt: str | None = None
    policy: Policy = Policy.GUARANTEED_NO_EVICT
    ticket: Ticket | None = None


def as_engine_request(admit: tuple[Any, ...] | list[Any]) -> EngineRequest:
    """An EngineRequest from an admit as it crosses Ray:
    (seq_id, prompt, max_new_tokens, salt[, policy, ticket]). max_new_tokens may be None
    (0) unless the admit is ticketed under GUARANTEED_NO_EVICT (kvfold.worker.commitments)."""
    if len(admit) == 4:
        seq_id, prompt, max_new, salt = admit
        pol, stamp = Policy.GUARANTEED_NO_EVICT, None
    elif len(admit) == 6:
        seq_id, prompt, max_new, salt, policy, ticket = admit
        pol, stamp = as_policy(policy), as_ticket(ticket)
    else:
        raise ValueError(
            "an admit is (seq_id, prompt, max_new_tokens, salt[, policy, ticket]), "
            f"got {len(admit)} fields"
        )
    new_tokens = declared_new_tokens(max_new, pol, ticketed=stamp is not None)
    return EngineRequest(seq_id, prompt, new_tokens, salt, pol, stamp)


class Prefill(NamedTuple):
    """A prompt computed in a step: how much of it was reused on the GPU, how much more
    came from the host tier, and when (trace s) its first token was out."""

    seq_id: SeqId
    prompt_tokens: int
    reused_tokens: int
    covered_tokens: int  # reused + onboarded
    first_token_s: float
    recomputed: bool = False  # a preempted sequence computed again


@dataclass(frozen=True, slots=True)
class StepResult:
    admitted: tuple[SeqId, ...]
    refused: tuple[SeqId, ...]  # would over-commit the rank: nothing changed for them
    finished: tuple[SeqId, ...]
    on_hold: tuple[SeqId, ...]  # could not grow this step
    num_running: int
    decoded_tokens: int
    preempted: tuple[SeqId, ...] = ()  # blocks released, to be recomputed when they fit
    incarnation: int = 0  # the rank's, set by the rank actor: a change means it restarted
    prefills: tuple[Prefill, ...] = ()  # prompts computed this step (timed when asked)


class Engine(Protocol):
    def step(
        self,
        admits: Sequence[EngineRequest] = (),
        decode_tokens: int = 1,
        now_s: float | None = None,
    ) -> StepResult:
        """Run one engine step at trace time `now_s` (None: untimed): decode what runs,
        finish what is done, admit `admits`."""
        ...

    def drain(self) -> None:
        """Free every sequence the engine holds."""
        ...


EngineFactory = Callable[[PagedKVCache], Engine]
"""Builds the engine over a freshly bound cache (the rank calls it on every bind)."""
