"""The door: one async Ray actor that keeps the commitments of everything kvfold sends to
engines, and decides where each request goes (DESIGN §11). Every front-door replica and
every kvfold RequestRouter in the namespace asks this one actor, so several of them share
the engines as one controller would: a promise is made in one place, in order.

    DoorActor            the shell: follows the view and the block index, wraps DoorAdmission
      admit(...)         -> Admitted (where to send it), once it fits; else NotAdmitted (why)
      started(id)        its first token came back: its engine has prefilled it
      release(id)        the request ended (finished, failed, or its client went away)
      stats()            commitments, queue, counts, the cross-check against engine gauges
      committed_between  the most committed on an engine over a time span (for checks)
    start_door / get_door

What the actor knows of the engines comes from kvfold's view, followed with the block index
(kvfold.serving.door_follow: capacity, block size, liveness, the engine's own used blocks),
and from each engine's /v1/models (its
max_model_len, asked once the engine is live in the view, in a thread:
kvfold.serving.door_limits). An engine down when the door starts is taken once it is up;
until its limit is known it gets no request. The door never calls an engine for a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import ray

from kvfold.serving.door_admission import (
    DoorAdmission,
    DoorRequest,
    EngineState,
    Placement,
    Refused,
    blocks_needed,
)
from kvfold.serving.door_answers import Admitted, NotAdmitted, QueueRefused, QueueTimeout
from kvfold.serving.door_follow import ViewFollower
from kvfold.serving.door_limits import EngineLimits
from kvfold.serving.door_view import CommittedLog, block_sizes, engine_states
from kvfold.serving.inflight import InFlight
from kvfold.serving.settings import DOOR_ACTOR_NAME, FrontDoorSettings
from kvfold.view import ClusterView
from kvfold.worker.hashing import as_token_array, block_keys

log = logging.getLogger("kvfold")

CROSS_CHECK_LOOKBACK_S = 2.0  # a gauge is compared with the most committed this far back
RELEASED_MEMORY = 10_000  # ids released before their admit arrived, refused if it does


class DoorActor:
    def __init__(self, settings: FrontDoorSettings) -> None:
        self.settings = settings
        self.adm = DoorAdmission(
            settings.policy,
            queue_limit=settings.queue_limit,
            max_running_per_engine=settings.max_running_per_engine,
            prefix_weight=settings.prefix_weight,
            decode_weight=settings.decode_weight,
            held_blocks=self._held_blocks,
        )
        self._waiting: dict[str, asyncio.Future[Placement | None]] = {}
        self._keys: dict[str, tuple[list[Any], int]] = {}  # request -> (prefix keys, tokens)
        self._inflight = InFlight()  # the prompts of what was sent and has not ended
        self._released_early: dict[str, None] = {}  # an ordered set, oldest first
        self._view_follower = ViewFollower(settings.namespace)  # the view, the index
        self._view: ClusterView | None = None
        self._log = CommittedLog(settings.engine_ranks, time.time())
        self.limits = EngineLimits()  # each engine's max_model_len, asked once it is live
        self.above_committed: dict[int, int] = {}  # reports of used > committed, per engine
        self.follow_failures = 0
        self._follower: asyncio.Task[None] | None = None

    # -- the API -------------------------------------------------------------------------

    async def ready(self, engines_live: int | None = None) -> dict[str, Any]:
        """Once a followed view shows `engines_live` engines live (None: every one), their
        max_model_len known: the engines as seen."""
        n = len(self.settings.engine_urls)
        want = n if engines_live is None else engines_live
        if type(want) is not int or not 1 <= want <= n:
            raise ValueError(f"engines_live={engines_live!r}: allowed: 1..{n}, or None (all)")
        self._ensure_following()
        while True:
            if sum(e.live for e in self._engines()) >= want:
                return self.stats()
            await asyncio.sleep(self.settings.refresh_s)

    async def admit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_tokens: int | None,
        n: int = 1,
        timeout_s: float | None = None,
        avoid: Sequence[int] = (),
    ) -> Admitted | NotAdmitted:
        """Where to send this request, once it fits (it waits in the FIFO queue until
        then, at most `timeout_s`, the settings' queue_timeout_s by default), or why not.
        `avoid`: engines it must not go to (one that just failed it)."""
        try:
            return await self._admit(request_id, prompt_ids, max_tokens, n, timeout_s, avoid)
        except QueueRefused as e:
            return NotAdmitted(e.reason, str(e), e.retry_after_s)
        except QueueTimeout as e:
            return NotAdmitted("queue_timeout", str(e), e.retry_after_s)

    async def _admit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_tokens: int | None,
        n: int,
        timeout_s: float | None,
        avoid: Sequence[int],
    ) -> Admitted:
        self._ensure_following()
        t0 = time.monotonic()
        if request_id in self._released_early:
            raise QueueRefused("released", f"request {request_id!r} was released already")
        tokens = as_token_array(prompt_ids, "prompt_ids")
        block_size = self._block_size()
        limit = self._model_limit()
        if len(tokens) >= limit:
            raise QueueRefused(
                "prompt_too_long",
                f"{len(tokens)} prompt tokens; the engines' max_model_len is {limit}",
            )
        request = DoorRequest(
            request_id,
            need_blocks=blocks_needed(len(tokens), max_tokens, n, block_size, limit),
            prompt_blocks=(len(tokens) - 1) // block_size,
            deadline=t0 + (timeout_s or self.settings.queue_timeout_s),
            avoid=frozenset(avoid),
        )
        self._keys[request_id] = (block_keys(tokens, block_size, None), len(tokens))
        try:
            placed = self.adm.submit(request)
        except Refused as e:
            self._keys.pop(request_id, None)
            raise QueueRefused(e.reason, str(e), self._retry_after_s()) from None
        if placed is None:
            future: asyncio.Future[Placement | None] = asyncio.get_running_loop().create_future()
            self._waiting[request_id] = future
            wait = max(request.deadline - time.monotonic(), 0.0)
            try:
                placed = await asyncio.wait_for(asyncio.shield(future), wait)
            except asyncio.TimeoutError:
                placed = self.adm.placement(request_id)
                if placed is None:
                    self._end(request_id)
                    raise QueueTimeout(time.monotonic() - t0, self._retry_after_s()) from None
            finally:
                self._waiting.pop(request_id, None)
            if placed is None:
                raise QueueRefused("released", f"request {request_id!r} was released")
        self._sent(request_id, placed.rank)
        self._logged(placed.rank)
        version = self._view.version if self._view is not None else 0
        return Admitted(
            placed.rank,
            self.settings.engine_urls[placed.rank],
            placed.need_blocks,
            placed.held_blocks,
            time.monotonic() - t0,
            version,
        )

    async def started(self, request_id: str) -> bool:
        """The request's first token came back (its engine prefilled it): its prefill no
        longer counts against that engine. False when it is not running here."""
        return self.started_now(request_id)

    def started_now(self, request_id: str) -> bool:
        """started(), called in the door's own event loop."""
        return self.adm.started(request_id)

    async def release(self, request_id: str) -> int | None:
        """The request ended; its blocks are free again. Returns its engine (None: it held
        none, or was still queued). Idempotent."""
        return self.release_now(request_id)

    def release_now(self, request_id: str) -> int | None:
        """release(), called in the door's own event loop."""
        held = self.adm.placement(request_id)
        if held is None and not self.adm.is_queued(request_id):
            self._released_early[request_id] = None
            if len(self._released_early) > RELEASED_MEMORY:
                del self._released_early[next(iter(self._released_early))]
        return self._end(request_id)

    def stats(self) -> dict[str, Any]:
        engines = {}
        for e in self._engines():
            r = e.rank
            engines[r] = {
                **asdict(e),
                "url": self.settings.engine_urls[r],
                "committed_blocks": self.adm.committed(r),
                "running": self.adm.running(r),
                "prefilling_blocks": self.adm.prefilling(r),
                "above_committed": self.above_committed.get(r, 0),
                "max_model_len": self.limits.known(r),  # None: not asked yet, or failed
                "max_model_len_error": self.limits.last_error.get(r),
            }
        return {
            "engines": engines,
            "queued": self.adm.queued,
            "placed": self.adm.placed,
            "expired": self.adm.expired,
            "refused": dict(self.adm.refused),
            "policy": self.adm.policy,
            "view_version": self._view.version if self._view is not None else None,
            "follow_failures": self.follow_failures,
            "max_model_len": self.limits.least(),
        }

    def committed_between(self, rank: int, t0: float, t1: float) -> int:
        """The most this door had committed on engine `rank` at any time in [t0, t1]
        (wall-clock seconds)."""
        return self._log.most_between(rank, t0, t1)

    # -- inside --------------------------------------------------------------------------

    def _sent(self, request_id: str, rank: int) -> None:
        """A request placed on `rank`: its prompt counts as held there until it ends."""
        keys = self._keys.pop(request_id, None)
        if keys is not None:
            self._inflight.add(request_id, rank, keys[0])

    def _end(self, request_id: str) -> int | None:
        self._keys.pop(request_id, None)
        self._inflight.remove(request_id)
        rank, placed = self.adm.release(request_id)
        future = self._waiting.get(request_id)
        if future is not None and not future.done():
            future.set_result(None)
        if rank is not None:
            self._logged(rank)
        self._hand_out(placed)
        return rank

    def _hand_out(self, placed: list[Placement]) -> None:
        for p in placed:
            self._sent(p.request_id, p.rank)
            self._logged(p.rank)
            future = self._waiting.get(p.request_id)
            if future is not None and not future.done():
                future.set_result(p)

    def _logged(self, rank: int) -> None:
        self._log.record(rank, time.time(), self.adm.committed(rank))

    def _held_blocks(self, request: DoorRequest) -> dict[int, int]:
        """Per engine, the prompt's blocks it holds: by the block index (what its KV events
        said), or sent there in a request still running (what they do not say yet)."""
        keys = self._keys.get(request.request_id)
        if keys is None:
            return {}
        prefix = keys[0][: request.prompt_blocks]
        held = self._inflight.match(prefix)
        replica = self._view_follower.replica
        if replica is not None and replica.index.block_size:
            m = replica.index.match(prefix, keys[1])
            for r, g in enumerate(m.gpu):
                if g > held.get(r, 0):
                    held[r] = int(g)
        return held

    def _block_size(self) -> int:
        sizes = block_sizes(self._view, self.settings.engine_ranks)
        if len(sizes) != 1:
            raise QueueRefused(
                "engines_unknown",
                f"the engines' block sizes are {sorted(sizes) or 'not known yet'}; the door "
                "needs one size, known from the view",
                self._retry_after_s(),
            )
        return sizes.pop()

    def _engines(self, seen: list[EngineState] | None = None) -> list[EngineState]:
        """The engines as the view shows them (`seen`: as already read from it); one whose
        max_model_len is not known yet is not live (the door cannot count a request's end
        there)."""
        if seen is None:
            seen = self._seen()
        known = self.limits.known
        return [s if known(s.rank) is not None else replace(s, live=False) for s in seen]

    def _seen(self) -> list[EngineState]:
        return engine_states(self._view, self.settings.engine_ranks, self.settings.watermark_blocks)

    def _model_limit(self) -> int:
        least = self.limits.least()
        if least is None:
            raise QueueRefused(
                "engines_unknown",
                "no engine's max_model_len is known yet (its /v1/models, asked once it is live)",
                self._retry_after_s(),
            )
        return least

    def _learn_limits(self, seen: list[EngineState]) -> None:
        """Ask the engines live in the view, whose max_model_len is not known, for it."""
        live = {e.rank: self.settings.engine_urls[e.rank] for e in seen if e.live}
        self.limits.learn(live, self._limit_learned)

    def _limit_learned(self) -> None:
        self._hand_out(self.adm.update_engines(self._engines()))  # it may take queued requests

    def _retry_after_s(self) -> float:
        return max(1.0, self.settings.refresh_s)

    def start_following(self) -> None:
        """Follow the view and the block index from now on (in the running event loop)."""
        self._ensure_following()

    def _ensure_following(self) -> None:
        if self._follower is None or self._follower.done():
            self._follower = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            try:
                await self._follow_once()
            except Exception as e:  # the aggregator restarting, a view not there yet; and
                # whatever else: this loop is the door's only sight of the cluster, so no
                # fault may end it (each is counted and logged, and it goes on)
                self.follow_failures += 1
                self._view_follower.forget()
                if self.follow_failures % 100 == 1:
                    log.warning("kvfold door: following the view failed: %r", e)
            gone, placed = self.adm.expire(time.monotonic())
            expired = [r.request_id for r in gone]
            for rid in expired:
                future = self._waiting.get(rid)
                if future is not None and not future.done():
                    future.set_result(None)
            self._hand_out(placed)
            await asyncio.sleep(self.settings.refresh_s)

    async def _follow_once(self) -> None:
        view = await self._view_follower.poll()
        if view is None:
            return
        self._view = view
        seen = self._seen()  # read once per view: the limits asked, the engines gated
        self._learn_limits(seen)
        states = self._engines(seen)
        now = time.time()
        for s in states:
            if s.used_blocks is not None and s.live:
                most = self.committed_between(s.rank, now - CROSS_CHECK_LOOKBACK_S, now)
                if s.used_blocks > most:
                    self.above_committed[s.rank] = self.above_committed.get(s.rank, 0) + 1
                    log.warning(
                        "kvfold door: engine %d holds %d blocks, more than the %d kvfold "
                        "committed there: traffic reaches it from elsewhere",
                        s.rank, s.used_blocks, most,
                    )  # fmt: skip
        self._hand_out(self.adm.update_engines(states))


def start_door(settings: FrontDoorSettings, detached: bool = False) -> Any:
    """The namespace's door actor: started, or the running one (get-if-exists).
    `detached`: it outlives this driver (the front door's Serve app does)."""
    cls: Any = ray.remote(DoorActor)
    return cls.options(
        num_cpus=0,
        max_restarts=0,
        max_concurrency=1000,
        name=DOOR_ACTOR_NAME,
        namespace=settings.namespace,
        get_if_exists=True,
        lifetime="detached" if detached else None,
    ).remote(settings)


def get_door(namespace: str) -> Any:
    return ray.get_actor(DOOR_ACTOR_NAME, namespace=namespace)


__all__ = ["DoorActor", "get_door", "start_door"]
