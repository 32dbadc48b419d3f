"""SimEngine: a simple engine model over one rank's PagedKVCache.

Each `step(admits)`:
  1. every running sequence decodes one token (a sequence with no room to grow
     is put ON_HOLD, keeping its blocks, and retried next step); when no running
     sequence could move at all, the newest one held is preempted: its blocks are
     released (QUEUEING) and it is recomputed, prompt and tokens so far, as soon as
     it fits again (vLLM's recompute preemption; only MAX_UTILIZATION gets here);
  2. sequences that produced their last token are freed;
  3. admitted requests are added (prefill) with their declared length; one that
     would over-commit the rank is refused (kvfold.worker.commitments).

A prefilled sequence starts decoding at the next step. The engine owns no
policy: which request goes to which rank is the scheduler's decision. Given the
step's trace time, it charges its work on its own clock (kvfold.workload.timing) and
says when each prompt's first token was out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from kvfold.checks import check_int
from kvfold.stats import SequenceStatus
from kvfold.worker.cache import PagedKVCache
from kvfold.worker.engine import EngineRequest, Prefill, StepResult
from kvfold.worker.sequence import SeqId
from kvfold.workload.timing import EngineTiming

VOCAB = 32_000


class SimEngine:
    def __init__(self, cache: PagedKVCache, timing: EngineTiming | None = None) -> None:
        self.cache = cache
        self.timing = timing or EngineTiming()
        self.busy_until = 0.0  # trace s: when the work charged so far is done
        self._prefills: list[Prefill] = []
        self.remaining: dict[SeqId, int] = {}  # new tokens still to produce
        self.requests: dict[SeqId, EngineRequest] = {}  # what each running one was placed as
        self.preempted: deque[tuple[EngineRequest, int, int]] = deque()  # (req, length, left)
        self._clock: float | None = None  # the step's running trace time, when timed

    def step(
        self,
        admits: Sequence[EngineRequest] = (),
        decode_tokens: int = 1,
        now_s: float | None = None,
    ) -> StepResult:
        """One engine step; each running sequence decodes up to `decode_tokens` tokens
        (a coarse step stands for several engine iterations when time is compressed).
        `now_s`: the step's trace time (None: nothing is timed)."""
        check_int("decode_tokens", decode_tokens, 1)
        for req in admits:  # every request checked before the step changes anything
            if req.max_new_tokens < 1:
                raise ValueError(
                    f"max_new_tokens must be >= 1, got {req.max_new_tokens} ({req.seq_id!r})"
                )
        self._prefills = []
        self._clock = None if now_s is None else max(now_s, self.busy_until)
        if self._clock is not None and self.remaining:
            self._clock += decode_tokens * self.timing.decode_step_s
        finished, on_hold, decoded = self._decode(decode_tokens)
        preempted = self._preempt(on_hold) if on_hold and not (decoded or finished) else []
        if not preempted:  # the others move first: resuming now would undo the preemption
            self._resume()
        admitted, refused = self._admit(admits)
        if self._clock is not None:
            self.busy_until = self._clock
        return StepResult(
            admitted=tuple(admitted),
            refused=tuple(refused),
            finished=tuple(finished),
            on_hold=tuple(on_hold),
            num_running=len(self.remaining),
            decoded_tokens=decoded,
            preempted=tuple(preempted),
            prefills=tuple(self._prefills),
        )

    def _preempt(self, on_hold: list[SeqId]) -> list[SeqId]:
        """Nothing could move: release the newest held sequence's blocks, to recompute."""
        sid = on_hold[-1]
        length = self.cache.num_tokens(sid)
        self.cache.set_status(sid, SequenceStatus.QUEUEING)
        self.preempted.append((self.requests.pop(sid), length, self.remaining.pop(sid)))
        return [sid]

    def _resume(self) -> None:
        """Recompute preempted sequences, oldest first, while they fit."""
        while self.preempted:
            req, length, left = self.preempted[0]
            start = len(req.prompt)
            redo = np.concatenate(
                [
                    np.asarray(req.prompt, dtype=np.int64),
                    (np.arange(start, length, dtype=np.int64) * 7919) % VOCAB,
                ]
            )
            if not self.cache.add_sequence(
                req.seq_id,
                redo,
                salt=req.salt,
                max_new_tokens=left,
                policy=req.policy,
                count_refusal=False,
            ):
                return
            self.preempted.popleft()
            self._prefilled(req.seq_id, recomputed=True)
            self.remaining[req.seq_id] = left
            self.requests[req.seq_id] = req

    def _decode(self, decode_tokens: int) -> tuple[list[SeqId], list[SeqId], int]:
        """Every running sequence takes its step; returns (finished, on hold, tokens)."""
        cache = self.cache
        finished: list[SeqId] = []
        on_hold: list[SeqId] = []
        decoded = 0
        for sid, left in list(self.remaining.items()):
            status = cache.status_of(sid)
            n = min(decode_tokens, left)
            if status is SequenceStatus.IN_PREFILL:
                cache.set_status(sid, SequenceStatus.PREFILLED)
                left -= 1  # prefill produces the first token
            elif cache.append_tokens(sid, self._next_tokens(sid, n)):
                if status is not SequenceStatus.IN_DECODE:
                    cache.set_status(sid, SequenceStatus.IN_DECODE)
                decoded += n
                left -= n
            else:
                cache.set_status(sid, SequenceStatus.ON_HOLD)
                on_hold.append(sid)
            if left <= 0:
                cache.free_sequence(sid)
                del self.remaining[sid]
                del self.requests[sid]
                finished.append(sid)
            else:
                self.remaining[sid] = left
        return finished, on_hold, decoded

    def _admit(self, admits: Sequence[EngineRequest]) -> tuple[list[SeqId], list[SeqId]]:
        admitted: list[SeqId] = []
        refused: list[SeqId] = []
        for req in admits:
            ok = self.cache.add_sequence(
                req.seq_id,
                req.prompt,
                salt=req.salt,
                max_new_tokens=req.max_new_tokens,
                policy=req.policy,
            )
            if ok:
                self._prefilled(req.seq_id)
                self.remaining[req.seq_id] = req.max_new_tokens
                self.requests[req.seq_id] = req
                admitted.append(req.seq_id)
            else:
                refused.append(req.seq_id)
        return admitted, refused

    def _prefilled(self, sid: SeqId, recomputed: bool = False) -> None:
        """Charge a prompt just placed: what it computed, what it onboarded."""
        length = self.cache.num_tokens(sid)
        reused, covered = self.cache.prompt_reuse(sid)
        first = float("nan")
        if self._clock is not None:
            self._clock += self.timing.prefill_s(length - covered, covered - reused)
            first = self._clock
        self._prefills.append(Prefill(sid, length, reused, covered, first, recomputed))

    def _next_tokens(self, sid: SeqId, n: int) -> np.ndarray:
        start = self.cache.num_tokens(sid)
        return (np.arange(start, start + n, dtype=np.int64) * 7919) % VOCAB

    def drain(self) -> None:
        """Free every sequence the engine holds."""
        for sid in list(self.remaining):
            self.cache.free_sequence(sid)
        for req, _, _ in self.preempted:
            self.cache.free_sequence(req.seq_id)
        self.remaining.clear()
        self.requests.clear()
        self.preempted.clear()
