"""EngineIntake: one engine rank's events as they come in, from whichever thread reads
them. Pure (a lock, no sockets, no Ray): the readers (kvfold.engines.engine_readers) hand
in ZMQ messages, replay answers or HTTP pages; the rank's report loop drains the kvfold
events they made.

    take_live(frames, now_s) -> seq | None      a ZMQ message (vLLM, SGLang); a gap: the
                                                seq the replay should start from
    take_replay(answer, now_s) / replay_failed(now_s)
    set_tokens_per_block(n); take_page(body, now_s) -> bool
                                                a /kv_cache_events answer (TensorRT-LLM):
                                                read once the engine's block size is known
    restart(started_s)                          the engine's process changed
    drain() -> [kvfold event, ...]              what came in since the last drain

Owns the rank's EngineSource (order, gaps, the live set), the events made and not yet
published, and TensorRT-LLM's translator; `lock` guards them all (the rank's report loop
takes it too). TensorRT-LLM's events say nothing of the block size a full block has: until
the engine's stats (or the user) say it, pages are not asked for, so they wait in the
engine's own event buffer (one that overflows meanwhile is a gap: out of sync).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvfold.engines.endpoints import EngineEndpoints
from kvfold.engines.engine_source import EngineSource
from kvfold.engines.kinds import EngineKind
from kvfold.engines.trtllm_events import TRTLLMTranslator, feed_page
from kvfold.kvevents.events import Event

_EMPTY_PAGES = (b"[]", "[]")


class EngineIntake:
    def __init__(self, kind: EngineKind, endpoints: EngineEndpoints) -> None:
        self.kind = kind
        self.lock = threading.RLock()
        self.source = EngineSource()
        self.pending: list[Event] = []
        self.translator: TRTLLMTranslator | None = None
        self._attention_dp_rank = 0 if kind.zmq else int(endpoints.engine)
        self._lose = 0  # messages to drop on arrival (`lose_next`)
        if not kind.zmq and endpoints.tokens_per_block is not None:
            self.set_tokens_per_block(endpoints.tokens_per_block)

    # ------------------------------------------------------------------ ZMQ kinds

    def take_live(self, frames: list[bytes], now_s: float) -> int | None:
        """One live message; returns the seq to replay from when it opened a gap."""
        take = self.kind.take_live
        if take is None:
            raise TypeError(f"kind {self.kind.name!r} takes pages, not ZMQ messages")
        with self.lock:
            if self._lose > 0:  # fault injection (tests): lost in transit
                self._lose -= 1
                return None
            self.pending += take(self.source, frames, now_s)
            return self.source.wanted_replay()

    def take_replay(self, answer: Iterable[list[bytes]], now_s: float) -> None:
        """The replay's whole answer, up to its end marker."""
        take = self.kind.take_replay
        if take is None:
            raise TypeError(f"kind {self.kind.name!r} has no replay")
        with self.lock:
            self.pending += take(self.source, answer, now_s)

    def tail_from(self) -> int | None:
        """Where a probe of a quiet stream's replay starts, or None (a gap is open, or
        the kind has no replay)."""
        if self.kind.take_replay is None:
            return None
        with self.lock:
            return self.source.tail_from()

    def replay_failed(self, now_s: float) -> None:
        """No replay, or it did not answer in time: what was missed is lost."""
        with self.lock:
            self.pending += self.source.replay_failed(now_s)

    # ------------------------------------------------------------------ HTTP pages

    def set_tokens_per_block(self, tokens_per_block: int) -> None:
        """The engine's block size, once known (its first answer keeps it)."""
        with self.lock:
            if self.translator is None:
                self.translator = TRTLLMTranslator(tokens_per_block, self._attention_dp_rank)

    @property
    def can_take_pages(self) -> bool:
        return self.translator is not None

    def take_page(self, body: bytes | str, now_s: float) -> bool:
        """One /kv_cache_events answer; False (nothing read) before the block size is
        known. A gap in its event ids puts the source out of sync (there is no replay)."""
        with self.lock:
            if self.translator is None:
                return False
            if self._lose > 0 and body not in _EMPTY_PAGES:
                self._lose -= 1
                return True
            self.pending += feed_page(self.source, self.translator, body, now_s)
            return True

    # ------------------------------------------------------------------ both

    def restart(self, started_s: float) -> None:
        """The engine's process changed (its numbers page says so, started at
        `started_s`): if nothing of the new one was applied yet, what the old one held
        is gone now, not when the new one first stores."""
        with self.lock:
            if self.source.last_ts < started_s:
                self.pending += self.source.restart()

    def drain(self) -> list[Event]:
        with self.lock:
            out, self.pending = self.pending, []
            return out

    def lose_next(self, n: int) -> None:
        """Fault injection: drop the next `n` live messages (pages holding events), as if
        lost in transit."""
        if type(n) is not int or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        with self.lock:
            self._lose = n


__all__ = ["EngineIntake"]
