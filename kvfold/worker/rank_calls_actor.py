"""RankCalls: the calls an engine (or a driver) makes on a rank, over Ray.

Each takes the rank's lock and forwards to its cache or its engine in a line or two;
arguments are checked before anything changes, and a call that changed the cache
wakes the rank's reporter when asked (`report=True`). RankWorker
(kvfold.worker.rank_actor) is this class plus the rank's lifecycle and reports; the
state declared here is set by its __init__.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvfold.ray_actor import BackgroundLoop
from kvfold.stats import IterationStats, KVStats, SequenceStatus, Window
from kvfold.tickets import TicketBook, TicketLike, as_ticket
from kvfold.worker.cache import PagedKVCache
from kvfold.worker.commitments import Policy, as_policy, declared_new_tokens
from kvfold.worker.engine import Engine, StepResult, as_engine_request
from kvfold.worker.sequence import SeqId


class RankCalls:
    """The engine-facing methods of a rank actor (RankWorker's base)."""

    rank: int
    incarnation: int
    lock: threading.RLock  # the cache, the engine and the tickets change under it
    cache: PagedKVCache | None
    engine: Engine | None
    tickets: TicketBook  # per controller, the highest ticket taken in
    loop: BackgroundLoop  # the reporter's: woken after a change when asked
    urgent: bool  # a change was asked to be reported: the next report is pushed on at once

    def _cache(self) -> PagedKVCache:
        if self.cache is None:
            raise ValueError(f"rank {self.rank} has no KV cache bound; call bind(config) first")
        return self.cache

    def _changed(self, report: bool) -> None:
        if report:
            with self.lock:  # read and cleared under it by the reporter's tick
                self.urgent = True
            self.loop.wake()

    def add_sequence(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        salt: str | None = None,
        report: bool = False,
        *,
        max_new_tokens: int | None = None,
        policy: Policy | str = Policy.GUARANTEED_NO_EVICT,
        ticket: TicketLike = None,
    ) -> bool:
        """Place a request: its prompt, the tokens it may generate, what its admission
        promised, and the admitting controller's ticket. False: it would over-commit
        the rank (nothing changed; counted). The ticket is recorded either way.

        `max_new_tokens` is required with a ticket under GUARANTEED_NO_EVICT (the
        promise is prompt + max_new_tokens): omitted there, a ValueError, and nothing
        changes (the ticket is not taken in). Elsewhere None declares the prompt alone.
        """
        stamp, pol = as_ticket(ticket), as_policy(policy)
        new_tokens = declared_new_tokens(max_new_tokens, pol, ticketed=stamp is not None)
        with self.lock:
            ok = self._cache().add_sequence(
                seq_id, token_ids, salt=salt, max_new_tokens=new_tokens, policy=pol
            )
            self.tickets.take(stamp)
        self._changed(report)
        return ok

    def append_tokens(self, seq_id: SeqId, token_ids: Sequence[int], report: bool = False) -> bool:
        with self.lock:
            ok = self._cache().append_tokens(seq_id, token_ids)
        self._changed(report)
        return ok

    def set_status(self, seq_id: SeqId, status: int | str, report: bool = False) -> None:
        try:
            s = SequenceStatus[status] if isinstance(status, str) else SequenceStatus(status)
        except (KeyError, ValueError):
            names = [m.name for m in SequenceStatus]
            raise ValueError(
                f"status must be one of {names} (or its value), got {status!r}"
            ) from None
        with self.lock:
            self._cache().set_status(seq_id, s)
        self._changed(report)

    def free_sequence(self, seq_id: SeqId, report: bool = False) -> None:
        with self.lock:
            self._cache().free_sequence(seq_id)
        self._changed(report)

    def block_table(self, seq_id: SeqId, window: Window = None) -> list[int]:
        with self.lock:
            return self._cache().block_table(seq_id, window)

    def stats(self) -> KVStats | None:
        with self.lock:
            return None if self.cache is None else self.cache.stats()

    def trtllm_stats(self) -> dict[str, Any] | None:
        """TensorRT-LLM's kvCacheStats shape (None while no cache is bound)."""
        with self.lock:
            return None if self.cache is None else self.cache.trtllm_stats()

    def cumulative(self) -> IterationStats | None:
        with self.lock:
            return None if self.cache is None else self.cache.cumulative()

    def check_integrity(self) -> None:
        with self.lock:
            self._cache().check_integrity()

    def write_kv(
        self, seq_id: SeqId, layer: int, positions: list[int], k: np.ndarray, v: np.ndarray
    ) -> None:
        import torch  # here, not at import: a CPU rank starts without it

        with self.lock:
            self._cache().write_kv(
                seq_id, layer, positions, torch.from_numpy(k), torch.from_numpy(v)
            )

    def gather_kv(self, seq_id: SeqId, layer: int) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            k, v = self._cache().gather_kv(seq_id, layer)
        return k.cpu().numpy(), v.cpu().numpy()

    def engine_step(
        self,
        admits: list[tuple[Any, ...]],
        decode_tokens: int = 1,
        report: bool = True,
        drain_first: bool = False,
        now_s: float | None = None,
    ) -> StepResult:
        """One step of this rank's engine (kvfold.worker.engine; the simulated one by
        default). Each admit: (seq_id, prompt, max_new_tokens, salt[, policy, ticket]).
        `drain_first`: free everything the engine holds before the step, in the same call
        (a driver that gave the rank's work up; separate calls to this threaded actor
        could run in either order). `now_s`: the step's trace time, for the engine's
        timing (kvfold.workload.timing)."""
        requests = [as_engine_request(a) for a in admits]
        with self.lock:
            self._cache()
            if self.engine is None:
                raise ValueError(f"rank {self.rank} has no engine (launch with an engine_factory)")
            if drain_first:
                self.engine.drain()
            result = replace(
                self.engine.step(requests, decode_tokens, now_s), incarnation=self.incarnation
            )
            for req in requests:  # placed or refused: the rank has seen it
                self.tickets.take(req.ticket)
        self._changed(report and bool(result.admitted or result.finished))
        return result

    def engine_drain(self) -> None:
        with self.lock:
            if self.engine is not None:
                self.engine.drain()
        self._changed(True)
