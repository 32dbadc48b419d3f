"""What a scheduler asks admission about, what it answers, and the blocks a request is
promised. Plain data; no Ray. DESIGN §6; docs/admission.md says what is promised.

Blocks needed per window (B tokens per block, F the declared end):

    GUARANTEED_NO_EVICT: F = prompt + max_new_tokens (it runs to the end without eviction)
    MAX_UTILIZATION:     F = prompt + min(max_new_tokens, B)  (the prompt and one block)

    full attention:  ceil(F / B)
    window W:        the most blocks the window holds at once from the prompt to F,
                     at most min(ceil(F / B), ceil(W / B) + 1) (kvfold.worker.windows)

Outcomes, checked in this order (kvfold.admission.policy decides):
    QUEUE  no_fresh_capacity        no fresh rank at all (never an admit onto stale numbers)
    QUEUE  capacity_unknown         fresh ranks, but none publishes its commitments (engines)
    REJECT exceeds_rank_capacity    no fresh rank could hold it at its full length, empty
                                    (total - watermark_blocks; under either policy: a
                                    request that can never finish is never admitted)
    ADMIT  fits | fits_prefix       on the rank the router picks among those that fit
                                    (kvfold.admission.routing; fits_prefix: it holds some
                                    of the prompt, as far as the router knows)
    ADMIT  fits_overflow            larger than this controller's lease anywhere: a rank's
                                    whole room, where it has nothing unseen (another
                                    controller may collide there: the rank refuses);
                                    without a claim desk only
    ADMIT  fits_claim               larger than this controller's lease anywhere: on the
                                    rank its granted claim froze for it
                                    (kvfold.admission.claims)
    QUEUE  awaiting_claim           larger than its lease anywhere; its claim is asked
                                    for, not granted yet, or in use
    QUEUE  insufficient_free_blocks fits a rank's total, not its room now
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfold.checks import check_int
from kvfold.stats import Window
from kvfold.tickets import Ticket
from kvfold.worker.commitments import Policy, declared_end
from kvfold.worker.windows import window_manager

__all__ = ["AdmissionRequest", "Decision", "Outcome", "Policy", "blocks_needed"]


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
