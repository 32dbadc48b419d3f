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
    (kvfold.admission.sent), until the index can show them; a released request's
    sending stops counting at once.

Only the choice among ranks that fit is made here; whether a request fits, and what is
promised, is the admission policy's (kvfold.admission.policy), whatever the router.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvfold.admission.decision import AdmissionRequest
from kvfold.admission.sent import SentPrefixes
from kvfold.blockindex.feed import Replica
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


def cheapest(
    match: Match,
    fits: BoolArray,
    room: IntArray,
    weights: RoutingWeights,
    committed: IntArray,
    reserved: IntArray,
) -> int:
    """The rank that fits with the lowest cost(r) (the module's docstring), written out as
    (w + 1) P + load - (w + 1) gpu - w (1 - c) (total - gpu) with load = `committed` +
    `reserved` per rank; ties to the most room in the tightest window (`room`: per window
    and rank, read only on a tie), then to the lower rank. The term (w + 1) P is the
    same for every rank and left out: one float array, made from the load where a rank
    fits (infinite elsewhere), with the match added class by class. Costs within a
    billionth of the lowest tie: the host term's weight is seldom exact in binary, and a
    rounding must not decide what the room should."""
    w, c = weights.overlap_weight, weights.onboard_cost
    cost = np.where(fits, committed + reserved, np.inf)
    match.add_weighted(cost, -(w + 1.0), -w * (1.0 - c))
    best = int(cost.argmin())
    tied = cost <= cost[best] + 1e-9 * (1.0 + abs(cost[best]))
    if np.count_nonzero(tied) == 1:
        return best
    ties = np.flatnonzero(tied)
    return int(ties[np.argmax(room[:, ties].min(axis=0))])


class RankChooser:
    """One controller's router: what it remembers of where it sent prompts, and the choice
    among the ranks that fit. Owned by AdmissionPolicy, which decides what fits and
    holds the lock (through its controller); this only ever picks among `fits`."""

    def __init__(
        self,
        router: Router,
        weights: RoutingWeights,
        seed: Sequence[int],
        affinity_keys: int = 200_000,
    ) -> None:
        self.router = router
        self.weights = weights
        self.blocks: Replica | None = None  # the cluster block index, for precise_prefix
        # precise_prefix: prompts this controller sent that the index may not show yet
        self.sent = SentPrefixes(weights.sent_ttl_s)
        # approx_prefix, LRU: key -> (rank, the request that sent it there last)
        self._key_to_rank: OrderedDict[bytes, tuple[int, str]] = OrderedDict()
        self._request_keys: OrderedDict[str, tuple[bytes, ...]] = OrderedDict()
        self._affinity_keys = affinity_keys
        self._rng = np.random.default_rng(list(seed))
        self._turn = -1  # round_robin: the last rank chosen

    def choose(
        self,
        request: AdmissionRequest,
        fits: BoolArray,
        room: IntArray,
        now_s: float,
        tokens_per_block: int,
        committed: IntArray,
        reserved: IntArray,
        overflow: bool = False,
    ) -> tuple[int, int]:
        """The rank among those that fit, and the prompt blocks it holds as far as the
        router knows. `room`: per window and rank (ties, least_loaded); precise_prefix's
        active blocks are the first window's `committed` (per rank) and `reserved` (per
        window and rank: what this controller promised since). Beyond a lease
        (`overflow`), any rank that fits, at random: controllers that all overflow at
        once would otherwise all pick the same rank."""
        if overflow:
            return int(self._rng.choice(np.flatnonzero(fits))), 0
        router = self.router
        blocks = self.blocks
        keys = request.prefix_keys
        if (
            router is Router.PRECISE_PREFIX
            and blocks is not None
            and keys
            and blocks.index.world_size == len(fits)
        ):
            P, B = request.prompt_tokens, tokens_per_block
            match = blocks.index.match(keys, P)
            match = self.sent.overlay(match, keys, (P - 1) // B, now_s)
            rank = cheapest(match, fits, room, self.weights, committed, reserved[0])
            return rank, match.of(rank)[1]
        if router is Router.APPROX_PREFIX and keys:
            best, best_len = -1, 0
            for i, key in enumerate(keys):
                held = self._key_to_rank.get(key)
                if held is None:
                    break
                r = held[0]
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

    def sent_to(self, request: AdmissionRequest, rank: int, now_s: float) -> None:
        """The request was admitted to `rank`: remember where its prompt went."""
        if self.router is Router.APPROX_PREFIX:
            table, rid = self._key_to_rank, request.request_id
            for k in request.prefix_keys:
                table[k] = (rank, rid)
                table.move_to_end(k)
            while len(table) > self._affinity_keys:
                table.popitem(last=False)
            sent = self._request_keys
            sent[rid] = tuple(request.prefix_keys)
            sent.move_to_end(rid)
            while len(sent) > self._affinity_keys // 8 + 1:  # bounded: the oldest forgotten
                sent.popitem(last=False)
        elif self.router is Router.PRECISE_PREFIX:
            self.sent.add(request.request_id, request.prefix_keys, rank, now_s)

    def release(self, request_id: str) -> None:
        """The request will not reach its rank: its prompt no longer counts as sent there
        (for approx_prefix, the keys whose last sending was this request's)."""
        if self.router is Router.PRECISE_PREFIX:
            self.sent.release(request_id)
        elif self.router is Router.APPROX_PREFIX:
            table = self._key_to_rank
            for k in self._request_keys.pop(request_id, ()):
                held = table.get(k)
                if held is not None and held[1] == request_id:
                    del table[k]
