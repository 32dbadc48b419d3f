"""EngineSource: one engine data-parallel rank's KV-event stream, in order, turned into
kvfold block events keyed by content (kvfold.engines.content_keys). Pure; no Ray, no
sockets: the shell hands in the live stream's messages and the replay's answers.

    take_live(frames, now_s) -> [kvfold event, ...]     decode, order, apply
    take_batch(batch, now_s) -> [kvfold event, ...]     the same, decoded elsewhere
    wanted_replay() -> seq | None                        a gap: ask the replay socket
    take_replay([frames, ...], now_s) -> [event, ...]   what the replay answered
    replay_failed(now_s) -> [event, ...]                 it did not answer in time

The stream's sequence numbers start at 0 per engine process:

    seq == expected          applied, then whatever was kept after it
    seq >  expected          kept aside (at most MAX_KEPT batches); the replay is asked
                             for the missing ones
    seq <  expected          a batch the replay already gave (the same seq and ts):
                             a duplicate, dropped; otherwise the engine restarted:
                             everything it held is gone (AllBlocksCleared), the stream
                             starts over at this batch
    the replay cannot fill   out of sync (DESIGN §10): the source's entries leave the
    the gap                  index (AllBlocksCleared) and come back only as the engine
                             stores blocks again; `out_of_sync_since_s` says since when
    a quiet stream's tail    batches the live stream lost with nothing after them to show
                             a gap (the first ones, sent before the subscription took):
                             the shell asks the replay from `tail_from()` when the stream
                             has been quiet a while, and what it answers is applied in order

Bad engine output (kvfold.engines.vllm_wire.WireError) is refused, counted by reason,
and changes nothing. The live set (content keys held per window group, counted per
engine block, so two engine blocks with one content key are removed once both are) is
what a snapshot of this source hands the cluster index.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from kvfold.engines.content_keys import ContentKeys
from kvfold.engines.vllm_wire import (
    EngineBatch,
    EngineCleared,
    EngineRemoved,
    EngineStored,
    WireError,
    decode_live,
    decode_replay,
)
from kvfold.kvevents.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvfold.stats import Window

MAX_KEPT = 1024  # batches kept after a gap while the replay is asked


class EngineSource:
    def __init__(self, medium: str = GPU) -> None:
        self.medium = medium  # the events this source takes (a host tier's would be CPU)
        self.keys = ContentKeys()
        self.expected: int | None = None  # the next seq; None before the first batch
        self.kept: dict[int, EngineBatch] = {}
        self.live: dict[tuple[int, bytes], int] = {}  # (group, content key) -> engine blocks
        self.windows: dict[int, Window] = {}
        self.block_size = 0
        self.out_of_sync_since_s: float | None = None
        self.last_ts = 0.0  # the engine's clock on the last batch applied
        # seq -> ts of the batches the last replay gave, until the live stream passes them:
        # a replay answers up to the engine's latest batch, some still on their way live
        self.replayed: dict[int, float] = {}
        self.refused: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()  # applied, kept, gaps, restarts, out_of_sync, ...

    # ------------------------------------------------------------------ intake

    def take_live(
        self,
        frames: list[bytes],
        now_s: float,
        decode: Callable[[list[bytes]], EngineBatch] = decode_live,
    ) -> list[Event]:
        """One message of the live stream, read with `decode` (vLLM's by default); the
        kvfold events it makes (maybe none)."""
        try:
            batch = decode(frames)
        except WireError as e:
            self.refused[e.reason] += 1
            return []
        return self._take(batch, now_s)

    def take_batch(self, batch: EngineBatch, now_s: float) -> list[Event]:
        """One batch already decoded (an engine whose wire is not vLLM's ZMQ frames:
        SGLang's, TensorRT-LLM's), in the live stream's order."""
        return self._take(batch, now_s)

    def _take(self, batch: EngineBatch, now_s: float) -> list[Event]:
        out: list[Event] = []
        if self.expected is None:
            self.expected = 0  # a stream joined late: 0.. must come from the replay
        if batch.seq < self.expected and self.replayed.get(batch.seq) == batch.ts:
            self.counts["duplicates"] += 1  # the replay gave it first
            return out
        if self.replayed:
            self.replayed.clear()
        if batch.seq < self.expected:
            self.counts["restarts"] += 1
            out += self._clear()
            self.kept.clear()
            self.expected = batch.seq
            self.out_of_sync_since_s = None
        if batch.seq > self.expected:
            if not self.kept:
                self.counts["gaps"] += 1
            self.kept[batch.seq] = batch
            self.counts["kept"] += 1
            if len(self.kept) > MAX_KEPT:
                out += self._give_up(now_s)
            return out
        out += self._apply(batch)
        return out + self._drain()

    def wanted_replay(self) -> int | None:
        """The seq the replay should start from, while a gap is open."""
        return self.expected if self.kept and self.expected is not None else None

    def take_replay(
        self,
        answer: Iterable[list[bytes]],
        now_s: float,
        decode: Callable[[list[bytes]], EngineBatch | None] = decode_replay,
    ) -> list[Event]:
        """The replay socket's answer to `wanted_replay()`, every message up to its end
        marker, read with `decode` (vLLM's by default; SGLang's leaves out the topic)."""
        got: list[EngineBatch] = []
        for frames in answer:
            try:
                batch = decode(frames)
            except WireError as e:
                self.refused[e.reason] += 1
                continue
            if batch is None:
                break
            got.append(batch)
        return self.take_replay_batches(got, now_s)

    def tail_from(self) -> int | None:
        """Where a probe of a quiet stream's replay starts (the next seq expected; 0
        before any batch), or None while a gap is open (its own replay is asked)."""
        return None if self.kept else (self.expected or 0)

    def take_replay_batches(self, batches: Iterable[EngineBatch], now_s: float) -> list[Event]:
        """A replay's batches, decoded (any engine's replay): the missing ones are applied
        in order; if the replay no longer holds the first of them, the source is out of
        sync. With no gap open, the answer to a tail probe: the batches from the next
        expected on, which the live stream lost (none, usually)."""
        got = list(batches)
        if not self.kept:
            got = [b for b in got if self.expected is None or b.seq >= self.expected]
            if not got:
                return []
            if self.expected is None:
                self.expected = 0
            self.counts["tail_recovered"] += len(got)
        expected = self.expected
        if expected is None:  # a gap is open only once a batch came
            return []
        self.counts["replayed"] += len(got)
        for batch in got:
            if batch.seq >= expected:
                self.kept.setdefault(batch.seq, batch)
                self.replayed[batch.seq] = batch.ts
        if self.expected not in self.kept:
            return self._give_up(now_s)
        return self._drain()

    def replay_failed(self, now_s: float) -> list[Event]:
        """The replay did not answer: what was missed is lost."""
        return self._give_up(now_s) if self.kept else []

    def _drain(self) -> list[Event]:
        out: list[Event] = []
        while self.expected in self.kept:
            out += self._apply(self.kept.pop(self.expected))
        return out

    def _give_up(self, now_s: float) -> list[Event]:
        """A gap nothing can fill: forget what this source was said to hold (no false
        credit) and go on from the first batch kept."""
        self.counts["out_of_sync"] += 1
        if self.out_of_sync_since_s is None:
            self.out_of_sync_since_s = now_s
        out = self._clear()
        self.expected = min(self.kept)
        return out + self._drain()

    def _clear(self) -> list[Event]:
        self.keys.clear()
        self.live.clear()
        return [AllBlocksCleared()]

    # ------------------------------------------------------------------ events

    def restart(self) -> list[Event]:
        """The engine's process changed (its metrics say so before any batch of the new
        one came): what the old one held is gone; the stream starts over."""
        self.counts["restarts"] += 1
        self.kept.clear()
        self.replayed.clear()
        self.expected = None
        self.out_of_sync_since_s = None
        return self._clear()

    def _apply(self, batch: EngineBatch) -> list[Event]:
        self.expected = batch.seq + 1
        self.last_ts = batch.ts
        self.counts["applied"] += 1
        out: list[Event] = []
        gone: list[bytes] = []  # content keys removed by a run of BlockRemoved (one group)
        gone_group = 0
        for ev in batch.events:
            if type(ev) is EngineRemoved and ev.medium == self.medium:
                if gone and ev.group_idx != gone_group:
                    out.append(BlockRemoved(tuple(gone), GPU, gone_group))
                    gone = []
                gone_group = ev.group_idx
                self._removed(ev, gone)  # vLLM sends one event per evicted block
                continue
            if gone:
                out.append(BlockRemoved(tuple(gone), GPU, gone_group))
                gone = []
            if isinstance(ev, EngineCleared):
                out += self._clear()
            elif ev.medium != self.medium:
                self.counts["other_medium"] += 1
            elif isinstance(ev, EngineStored):
                out += self._stored(ev)
        if gone:
            out.append(BlockRemoved(tuple(gone), GPU, gone_group))
        return out

    def _stored(self, ev: EngineStored) -> list[Event]:
        g = ev.group_idx
        self.windows.setdefault(g, ev.sliding_window)
        self.block_size = self.block_size or ev.block_size
        new: list[bytes] = []
        live = self.live
        for key in self.keys.store(ev):
            if key is None:
                continue
            n = live.get((g, key), 0)
            live[(g, key)] = n + 1
            if n == 0:
                new.append(key)
        if not new:
            return []
        return [BlockStored(tuple(new), None, ev.block_size, GPU, g, ev.sliding_window)]

    def _removed(self, ev: EngineRemoved, gone: list[bytes]) -> None:
        """Forget an evicted block; a content key no engine block holds any more goes
        into `gone`."""
        g, live = ev.group_idx, self.live
        for h in ev.block_hashes:
            known, key = self.keys.remove(g, h)
            if not known:
                self.counts["removed_unknown"] += 1
                continue
            if key is None:
                continue
            n = live.get((g, key), 0) - 1
            if n > 0:
                live[(g, key)] = n
            else:
                live.pop((g, key), None)
                gone.append(key)

    # ------------------------------------------------------------------ reads

    def held(self) -> dict[int, list[bytes]]:
        """The content keys this source holds, per window group (a snapshot's keys)."""
        out: dict[int, list[bytes]] = {}
        for g, key in self.live:
            out.setdefault(g, []).append(key)
        return out

    @property
    def num_blocks_unkeyed(self) -> int:
        """Blocks stored that could not be keyed (counted, never credited)."""
        return self.keys.num_unkeyed


__all__ = ["EngineSource"]
