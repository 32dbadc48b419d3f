"""What a rank has promised: each sequence's declared length, and the blocks per window
its sequences hold plus those they may still need to reach it (DESIGN §6).

    GUARANTEED_NO_EVICT: a sequence is declared to reach prompt + max_new_tokens
    MAX_UTILIZATION:     prompt + one block of growth (at most max_new_tokens);
                         past that it grows while the rank has room, else it waits

    committed[w] = used[w] + sum(blocks each sequence has still to take)   full attention
                 = sum(most blocks each sequence holds at once, to its end) sliding window

The cache refuses an add, or a growth past a sequence's declared end, that would
make committed exceed total in some window; so a sequence growing within its
declared end always finds its blocks (kvfold.worker.windows has the arithmetic).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvfold.checks import check_int
from kvfold.worker.windows import WindowManager


class Policy(enum.Enum):
    """What admitting a request promises (TensorRT-LLM's CapacitySchedulerPolicy)."""

    GUARANTEED_NO_EVICT = "guaranteed_no_evict"  # it runs to its declared length
    MAX_UTILIZATION = "max_utilization"  # its prompt and one block; growth may wait


def declared_end(
    prompt_tokens: int, max_new_tokens: int, policy: Policy, tokens_per_block: int
) -> int:
    """The length a sequence is promised it can reach without eviction."""
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, got {policy!r}")
    check_int("max_new_tokens", max_new_tokens, 0)
    if policy is Policy.GUARANTEED_NO_EVICT:
        return prompt_tokens + max_new_tokens
    return prompt_tokens + min(max_new_tokens, tokens_per_block)


def declared_new_tokens(max_new_tokens: int | None, policy: Policy, ticketed: bool) -> int:
    """The tokens a placement declares it may generate (`None`: not declared).

    A placement made under an admission decision (`ticketed`: it carries the admitting
    controller's ticket) with GUARANTEED_NO_EVICT promises prompt + max_new_tokens, so
    it must declare them: omitting them is an error, never a promise of nothing. Any
    other placement may omit them, which declares 0 (the prompt alone).
    """
    if max_new_tokens is None:
        if ticketed and policy is Policy.GUARANTEED_NO_EVICT:
            raise ValueError(
                f"max_new_tokens is required with policy {policy.value!r} and a ticket (the "
                "rank promises prompt + max_new_tokens), got None; pass an int >= 0"
            )
        return 0
    check_int("max_new_tokens", max_new_tokens, 0)
    return max_new_tokens


def as_policy(value: Policy | str) -> Policy:
    """A Policy from itself or its value ("guaranteed_no_evict", "max_utilization")."""
    if isinstance(value, Policy):
        return value
    try:
        return Policy(value)
    except ValueError:
        names = [p.value for p in Policy]
        raise ValueError(f"policy must be one of {names}, got {value!r}") from None


def blocks_to_end(
    managers: Sequence[WindowManager], prompt_tokens: int, end_tokens: int, sequences: int = 1
) -> list[int]:
    """The blocks a request may need per window group (in `managers`' order) while each of
    its `sequences` grows from its prompt to its declared end: each window's peak, every
    sequence counted (a shared prompt counted per sequence: never too few). What both
    admission cores promise from: the controllers' (kvfold.admission.policy, a promise is
    kept where each window's room holds it) and the front door's onto engines
    (kvfold.serving.door_admission, committed + need <= capacity)."""
    return [sequences * m.peak_blocks(prompt_tokens, end_tokens) for m in managers]
