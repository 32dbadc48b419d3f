"""Admission and routing onto engines that know nothing of kvfold (DESIGN §11). Pure; no
Ray, no clock of its own (callers pass `now`).

    DoorAdmission   the front door's commitments per engine, its FIFO queue, its routing
    EngineState     what the view says of one engine rank (capacity, liveness, its own gauge)
    DoorRequest     one request as counted: its blocks up to its declared end
    Placement       where a request went and why

An engine cannot refuse what would over-commit it, so the front door keeps the commitments
itself: for each request it sent and has not seen finish, the blocks the request may need
up to its declared end, `n x ceil(min(prompt + max_tokens, max_model_len) / B)`; an
engine's committed blocks are their sum (a prefix shared by several requests counts once
per request: never less than the engine can need). A request is placed only where
`committed + need <= capacity`, so under GUARANTEED_NO_EVICT the engine never runs out of
blocks for what kvfold sent it, and never preempts.

What fits nowhere now waits here, in one strict FIFO queue (no request overtakes an earlier
one, as in vLLM's and TensorRT-LLM's FCFS schedulers), bounded (`QueueFull` beyond
`queue_limit`) and with a deadline per request; it goes to whichever engine frees first.

Routing, among the live engines where the request fits:
  precise_prefix  least cost, cost = prefix_weight x prompt blocks the engine does not
                  hold (by the block index, and the prompts of requests still running
                  there) + blocks it still has to prefill for requests sent there whose
                  first token has not come back + decode_weight x its committed blocks:
                  Dynamo's KV router scores the same things (prefill blocks, the new
                  request's and the worker's active ones, and decode blocks), and marks a
                  request's prefill done at its first token as `started()` does here
  least_loaded    least committed fraction of capacity
Ties go to the lower rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvfold.errors import KVFoldError
from kvfold.worker.commitments import blocks_to_end
from kvfold.worker.windows import window_manager

PRECISE_PREFIX = "precise_prefix"
LEAST_LOADED = "least_loaded"
POLICIES = (PRECISE_PREFIX, LEAST_LOADED)
# precise_prefix's cost weights, in blocks of prefill queued on the engine (docs/serving.md)
PREFIX_WEIGHT = 4.0  # a block of the prompt the engine does not hold
DECODE_WEIGHT = 0.0625  # a block committed to a running request


class Refused(KVFoldError, RuntimeError):
    """A request the front door will not queue. `reason`: exceeds_engine_capacity (it can
    never fit an engine), queue_full, duplicate_request_id."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")


@dataclass(frozen=True, slots=True)
class EngineState:
    rank: int
    capacity_blocks: int  # blocks it can hold tokens in, less the watermark
    live: bool  # fresh in the view: new requests may go there
    used_blocks: int | None = None  # the engine's own gauge, at the view's time


@dataclass(frozen=True, slots=True)
class DoorRequest:
    request_id: str
    need_blocks: int  # up to its declared end, every sequence of it
    prompt_blocks: int  # the prompt's full blocks (what a held prefix can save)
    deadline: float  # the latest `now` it may still be placed at
    avoid: frozenset[int] = frozenset()  # engines it must not go to (one that just failed it)


@dataclass(frozen=True, slots=True)
class Placement:
    request_id: str
    rank: int
    need_blocks: int
    held_blocks: int  # of its prompt, on that engine by the index, when placed
    waited: bool  # it was queued first
    prefill_blocks: int = 0  # of its prompt, to compute there: not held when placed


HeldBlocks = Callable[[DoorRequest], Mapping[int, int]]


def _no_index(_: DoorRequest) -> Mapping[int, int]:
    return {}


class DoorAdmission:
    """Commitments per engine, the queue, and the choice of engine. Not thread-safe: one
    event loop owns it (kvfold.serving.door_actor)."""

    def __init__(
        self,
        policy: str = PRECISE_PREFIX,
        *,
        queue_limit: int = 256,
        max_running_per_engine: int | None = None,
        prefix_weight: float = PREFIX_WEIGHT,
        decode_weight: float = DECODE_WEIGHT,
        held_blocks: HeldBlocks = _no_index,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: allowed: {', '.join(POLICIES)}")
        if type(queue_limit) is not int or queue_limit < 0:
            raise ValueError(f"queue_limit={queue_limit!r}: allowed: an int >= 0")
        if max_running_per_engine is not None and (
            type(max_running_per_engine) is not int or max_running_per_engine <= 0
        ):
            raise ValueError(
                f"max_running_per_engine={max_running_per_engine!r}: allowed: a positive "
                "int (the engine's max_num_seqs) or None"
            )
        if not prefix_weight >= 0:
            raise ValueError(f"prefix_weight={prefix_weight!r}: allowed: >= 0")
        if not decode_weight >= 0:
            raise ValueError(f"decode_weight={decode_weight!r}: allowed: >= 0")
        self.policy = policy
        self.queue_limit = queue_limit
        self.max_running_per_engine = max_running_per_engine
        self.prefix_weight = prefix_weight
        self.decode_weight = decode_weight
        self._held_blocks = held_blocks
        self.engines: dict[int, EngineState] = {}
        self._running: dict[str, Placement] = {}  # sent, not seen finish
        self._committed: dict[int, int] = {}
        self._count: dict[int, int] = {}
        self._prefilling: dict[int, int] = {}  # engine -> prefill blocks not yet started
        self._not_started: set[str] = set()  # placed, first token not seen
        self._queue: OrderedDict[str, DoorRequest] = OrderedDict()
        self.placed = 0
        self.expired = 0
        self.refused: dict[str, int] = {}

    # -- reads ---------------------------------------------------------------------------

    def committed(self, rank: int) -> int:
        return self._committed.get(rank, 0)

    def running(self, rank: int) -> int:
        return self._count.get(rank, 0)

    def prefilling(self, rank: int) -> int:
        """Prompt blocks the engine still has to compute for requests sent there whose
        first token has not come back (a request not streamed counts until it ends)."""
        return self._prefilling.get(rank, 0)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def placement(self, request_id: str) -> Placement | None:
        return self._running.get(request_id)

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queue

    # -- changes -------------------------------------------------------------------------

    def update_engines(self, states: Iterable[EngineState]) -> list[Placement]:
        """The engines as a new view shows them; then whatever of the queue now fits."""
        self.engines = {s.rank: s for s in states}
        return self._drain()

    def submit(self, request: DoorRequest) -> Placement | None:
        """Place `request` now (a Placement), or queue it (None). Raises Refused when it
        can never fit an engine, when the queue is full, or when its id is in use."""
        rid = request.request_id
        if rid in self._running or rid in self._queue:
            self._count_refused("duplicate_request_id")
            raise Refused("duplicate_request_id", f"request {rid!r} is already here")
        largest = max((e.capacity_blocks for e in self.engines.values()), default=None)
        if largest is not None and request.need_blocks > largest:
            self._count_refused("exceeds_engine_capacity")
            raise Refused(
                "exceeds_engine_capacity",
                f"it may need {request.need_blocks} blocks up to its declared end; the "
                f"largest engine holds {largest}",
            )
        if not self._queue:
            placed = self._place(request, waited=False)
            if placed is not None:
                return placed
        if len(self._queue) >= self.queue_limit:
            self._count_refused("queue_full")
            raise Refused("queue_full", f"{len(self._queue)} requests already wait")
        self._queue[rid] = request
        return None

    def started(self, request_id: str) -> bool:
        """The request's first token came back: its engine has prefilled it. False when it
        is not running here or was marked already."""
        if request_id not in self._not_started:
            return False
        self._not_started.discard(request_id)
        placed = self._running[request_id]
        self._prefilling[placed.rank] -= placed.prefill_blocks
        return True

    def release(self, request_id: str) -> tuple[int | None, list[Placement]]:
        """The request finished, failed, or its client went away: its blocks are free
        again. Returns the engine it held (None: it held none) and what of the queue now
        fits. A queued request is dropped from the queue."""
        if self._queue.pop(request_id, None) is not None:
            return None, self._drain()  # it may have been the head
        self.started(request_id)
        placed = self._running.pop(request_id, None)
        if placed is None:
            return None, []
        self._committed[placed.rank] -= placed.need_blocks
        self._count[placed.rank] -= 1
        return placed.rank, self._drain()

    def expire(self, now: float) -> tuple[list[DoorRequest], list[Placement]]:
        """Drop the queued requests whose deadline passed; then what now fits (the head
        may have been one of them)."""
        gone = [r for r in self._queue.values() if r.deadline < now]
        for r in gone:
            del self._queue[r.request_id]
        self.expired += len(gone)
        return gone, self._drain() if gone else []

    # -- inside --------------------------------------------------------------------------

    def _drain(self) -> list[Placement]:
        out: list[Placement] = []
        while self._queue:
            head = next(iter(self._queue.values()))
            placed = self._place(head, waited=True)
            if placed is None:
                break
            del self._queue[head.request_id]
            out.append(placed)
        return out

    def _place(self, request: DoorRequest, waited: bool) -> Placement | None:
        fits = [
            e
            for e in self.engines.values()
            if e.live
            and e.rank not in request.avoid
            and self.committed(e.rank) + request.need_blocks <= e.capacity_blocks
            and (
                self.max_running_per_engine is None
                or self.running(e.rank) < self.max_running_per_engine
            )
        ]
        if not fits:
            return None
        held = self._held_blocks(request) if self.policy == PRECISE_PREFIX else {}

        def to_prefill(rank: int) -> int:
            return max(request.prompt_blocks - held.get(rank, 0), 0)

        if self.policy == PRECISE_PREFIX:
            best = min(
                fits,
                key=lambda e: (
                    self.prefix_weight * to_prefill(e.rank)
                    + self.prefilling(e.rank)
                    + self.decode_weight * self.committed(e.rank),
                    e.rank,
                ),
            )
        else:
            best = min(fits, key=lambda e: (self.committed(e.rank) / e.capacity_blocks, e.rank))
        rank = best.rank
        placed = Placement(
            request.request_id, rank, request.need_blocks, held.get(rank, 0), waited,
            to_prefill(rank),
        )  # fmt: skip
        self._running[request.request_id] = placed
        self._committed[rank] = self.committed(rank) + request.need_blocks
        self._count[rank] = self.running(rank) + 1
        self._prefilling[rank] = self.prefilling(rank) + placed.prefill_blocks
        self._not_started.add(request.request_id)
        self.placed += 1
        return placed

    def _count_refused(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


def blocks_needed(
    prompt_tokens: int,
    max_tokens: int | None,
    n: int,
    block_size: int,
    max_model_len: int,
) -> int:
    """Blocks a request may need up to its declared end: each of its `n` sequences grows to
    prompt + max_tokens tokens (the model's limit when max_tokens is absent, and never past
    it), every block counted (a shared prompt counted per sequence: never too few)."""
    if block_size <= 0 or max_model_len <= 0 or n <= 0 or prompt_tokens <= 0:
        raise ValueError(
            f"blocks_needed({prompt_tokens}, {max_tokens}, {n}, {block_size}, "
            f"{max_model_len}): allowed: positive sizes"
        )
    end = max_model_len if max_tokens is None else min(prompt_tokens + max_tokens, max_model_len)
    (need,) = blocks_to_end((window_manager(None, block_size),), prompt_tokens, end, n)
    return need  # engines behind the door: one full-attention group


__all__ = [
    "DECODE_WEIGHT",
    "LEAST_LOADED",
    "POLICIES",
    "PRECISE_PREFIX",
    "PREFIX_WEIGHT",
    "DoorAdmission",
    "DoorRequest",
    "EngineState",
    "Placement",
    "Refused",
    "blocks_needed",
]
