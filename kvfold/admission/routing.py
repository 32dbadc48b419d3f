"""Which rank an admitted request goes to, among the ranks that have room for it.

    round_robin     the next rank that fits, in turn
    least_loaded    the most room in the tightest window
    approx_prefix   the rank this controller last *sent* the prompt's longest known
                    prefix to (what routers without engine data do), else least loaded
    precise_prefix  the lowest cost by what the ranks actually hold (the cluster block
                    index, kvfold.blockindex), as Dynamo's KV router scores workers:

        cost(r) = overlap_weight x prefill_blocks(r) + active_blocks(r)
        prefill_blocks(r) = prompt blocks - gpu(r) - (1 - onboard_cost) x host(r)
        active_blocks(r)  = blocks committed or promised on r, plus the blocks the
                            request would add there (prompt blocks - gpu(r): what it
                            shares is not held twice)

    gpu(r): the prompt's blocks on r's GPU, from the first; host(r): those its node's
    host tier could onboard after them (each costs `onboard_cost` of computing it:
    a copy over the host link instead of prefill). Ties go to the most room.

    The index shows what a rank holds once its events have come in (a report interval
    or so); a prompt this controller sent a moment ago is not there yet. So, as
    Dynamo's router does with its own decisions, the controller also counts the
    prompts it sent in the last `sent_ttl_s` as held by the rank it sent them to
    (`SentPrefixes`), until the index can show them.

Only the choice among ranks that fit is made here; whether a request fits, and what is
promised, is the admission policy's (kvfold.admission.policy), whatever the router.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice, repeat, takewhile
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from kvfold.blockindex.match import Match
from kvfold.checks import check_positive

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class Router(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    APPROX_PREFIX = "approx_prefix"
    PRECISE_PREFIX = "precise_prefix"


def as_router(value: Router | str) -> Router:
    if isinstance(value, Router):
        return value
    try:
        return Router(value)
    except ValueError:
        names = [r.value for r in Router]
        raise ValueError(f"router must be one of {names}, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    """overlap_weight: a block to compute weighs this many resident blocks. Dynamo's
    default is 1.0; on the Mooncake trace (all 3,993 requests, docs/routing.md) 4.0 reused
    42.8% of prompt blocks with TTFT p90 11 s where 1.0 reused 35.1% with 231 s: a
    prefill block costs time, a resident block only memory.
    onboard_cost: an onboarded host block's cost relative to computing it; the default is
    the simulated engine's own ratio (kvfold.workload.timing: 128 KiB a token over 25 GB/s
    against 12,000 tokens/s)."""

    overlap_weight: float = 4.0
    onboard_cost: float = 0.06
    sent_ttl_s: float = 2.0  # how long a sent prompt counts as held, before the index shows it

    def __post_init__(self) -> None:
        check_positive("overlap_weight", self.overlap_weight)
        check_positive("sent_ttl_s", self.sent_ttl_s)
        if not 0.0 <= self.onboard_cost <= 1.0:
            raise ValueError(f"onboard_cost must be in [0, 1], got {self.onboard_cost!r}")


def precise_cost(
    match: Match, prompt_blocks: int, weights: RoutingWeights, *load_blocks: IntArray
) -> npt.NDArray[np.float64]:
    """cost(r) per rank (lower is better), `load_blocks` summed for active blocks; see the
    module's docstring. Written out:
    (w + 1) P + load - (w + 1 - w (1 - c)) gpu - w (1 - c) total."""
    w, c = weights.overlap_weight, weights.onboard_cost
    host_w = w * (1.0 - c)
    cost = match.weighted(host_w - w - 1.0, -host_w)  # in place from here: one array
    for load in load_blocks:
        cost += load
    cost += (w + 1.0) * prompt_blocks
    return cost


def lowest(cost: npt.NDArray[np.float64], fits: BoolArray, room: IntArray) -> int:
    """The rank that fits with the lowest cost; ties to the most room in the tightest
    window (`room`: per window and rank, looked at only when there is a tie). `cost` is
    overwritten where a rank does not fit."""
    np.copyto(cost, np.inf, where=~fits)
    best = int(cost.argmin())
    tied = cost == cost[best]
    if np.count_nonzero(tied) == 1:
        return best
    ties = np.flatnonzero(tied)
    return int(ties[np.argmax(room[:, ties].min(axis=0))])


class SentPrefixes:
    """Prompts this controller sent in the last `ttl_s`: each key -> (the rank it was
    sent to, the sending), the newest sending winning. A prompt's reusable blocks (all
    but the last token's) count as held by that rank. Adding and looking up are C-level
    passes over the keys; each key is expired once."""

    def __init__(self, ttl_s: float, max_sends: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_sends = max_sends
        self._sent: dict[bytes, tuple[int, int]] = {}  # key -> (rank, sending no.)
        self._sends: deque[tuple[float, tuple[int, int], Sequence[bytes]]] = deque()
        self._no = 0

    def add(self, keys: Sequence[bytes], rank: int, now_s: float) -> None:
        if not keys:
            return
        self._no += 1
        sending = (rank, self._no)
        self._sent.update(zip(keys, repeat(sending)))
        self._sends.append((now_s, sending, keys))
        if len(self._sends) > self.max_sends:
            self._expire(float("-inf"), len(self._sends) - self.max_sends)

    def _expire(self, cutoff: float, at_least: int = 0) -> None:
        sends, sent = self._sends, self._sent
        while sends and (at_least > 0 or sends[0][0] < cutoff):
            _, sending, keys = sends.popleft()
            at_least -= 1
            for k in keys:
                if sent.get(k) is sending:  # not sent again since
                    del sent[k]

    def overlay(self, match: Match, keys: Sequence[bytes], reusable: int, now_s: float) -> Match:
        """`match`, with the rank the prompt's first block was sent to holding at least the
        run sent there (capped at the `reusable` blocks: all but the last token's)."""
        self._expire(now_s - self.ttl_s)
        if not self._sent or not keys or reusable <= 0:
            return match
        first = self._sent.get(keys[0])
        if first is None:
            return match
        rank = first[0]
        gpu = match.of(rank)[0]
        if gpu >= reusable:
            return match
        run = _leading_run(list(map(self._sent.get, keys[:reusable], repeat(_UNSENT))), rank)
        if run <= gpu:
            return match
        return match.with_held(rank, run, run)


_UNSENT = (-1, 0)  # a key no kept sending holds


def _leading_run(sent: list[tuple[int, int]], rank: int) -> int:
    """How many leading entries are sendings to `rank`. A prompt's keys are chained, so
    the newest sending's keys usually come in a row from the first: counted at C speed.
    Otherwise (or past it) one C-level pass compares ranks; linear either way."""
    first = sent[0] if sent else _UNSENT
    if first[0] != rank:
        return 0
    n = sent.count(first)
    if sent[:n].count(first) != n:  # not all in a row: walk from the start
        n = 0
    return n + len(list(takewhile(rank.__eq__, map(itemgetter(0), islice(sent, n, None)))))
