"""SentPrefixes: the prompts a controller sent in the last `ttl_s`, by request. Pure; no Ray.

The cluster block index shows what a rank holds once its events have come in (a report
interval or so); a prompt this controller sent a moment ago is not there yet. So, as
Dynamo's router does with its own decisions, `precise_prefix` counts the prompts it
sent lately as held by the rank it sent them to, until the index can show them.

A sending belongs to a request. A request that will not reach its rank (cancelled,
refused) is released: its sending is taken back, and its keys stop counting, except
the keys a later sending sent again (another request's, or this one's decided again):

    sendings, oldest first         key k1  k2  k3  k4
      a -> rank 0                      a   a   a   a
      b -> rank 1 (k1, k2 only)        b   b   a   a
      release(a)                       b   b   -   -     (k3, k4: no longer held)
      release(b)                       -   -   -   -

An older sending of a key that a released one had overwritten is not brought back (the
index shows what it left within a report interval): routing is a preference, never a
promise, and forgetting costs less than a rank credited with blocks it never got.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import compress, islice, repeat, takewhile
from operator import is_, itemgetter

from kvfold.blockindex.match import Match
from kvfold.errors import IntegrityError

Sending = tuple[int, int]  # (the rank it went to, its number): unique, compared by identity
_UNSENT: Sending = (-1, 0)  # a key no kept sending holds


class SentPrefixes:
    """Each key -> the newest kept sending of it. Adding and looking up are C-level
    passes over the keys; each key is expired once, and released at most once.
    Owned by one controller's policy (not thread-safe: the controller holds the lock)."""

    def __init__(self, ttl_s: float, max_sends: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_sends = max_sends
        self._sent: dict[bytes, Sending] = {}  # key -> its newest sending
        # every kept sending, oldest first: (made at, sending, keys, request id)
        self._sends: deque[tuple[float, Sending, Sequence[bytes], str]] = deque()
        # a request's newest sending, while it is kept and not released
        self._by_request: dict[str, tuple[Sending, Sequence[bytes]]] = {}
        self._no = 0

    def __len__(self) -> int:
        """Keys counted as held now (before the expiry the next lookup does)."""
        return len(self._sent)

    def add(self, request_id: str, keys: Sequence[bytes], rank: int, now_s: float) -> None:
        """`request_id` sent its prompt's `keys` to `rank`: the keys count as held there
        (the newest sending wins), and a later release(request_id) takes them back."""
        if not keys:
            self._by_request.pop(request_id, None)  # nothing of this decision to take back
            return
        self._no += 1
        sending = (rank, self._no)
        self._sent.update(zip(keys, repeat(sending)))
        self._sends.append((now_s, sending, keys, request_id))
        self._by_request[request_id] = (sending, keys)
        if len(self._sends) > self.max_sends:
            self._expire(float("-inf"), len(self._sends) - self.max_sends)

    def release(self, request_id: str) -> int:
        """Take back the request's newest sending: its keys stop counting as held, but
        for those sent again since. Returns how many keys stopped counting (0: nothing
        kept was sent for it, or it was released already)."""
        got = self._by_request.pop(request_id, None)
        if got is None:
            return 0
        sending, keys = got
        return _forget(self._sent, keys, sending)

    def _expire(self, cutoff: float, at_least: int = 0) -> None:
        sends, sent, by_request = self._sends, self._sent, self._by_request
        while sends and (at_least > 0 or sends[0][0] < cutoff):
            _, sending, keys, request_id = sends.popleft()
            at_least -= 1
            _forget(sent, keys, sending)
            newest = by_request.get(request_id)
            if newest is not None and newest[0] is sending:
                del by_request[request_id]

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

    def check_integrity(self) -> None:
        """Every key and every request points at a kept sending. O(keys + sendings): tests."""
        kept = {id(s) for _, s, _, _ in self._sends}
        stray_keys = sum(id(s) not in kept for s in self._sent.values())
        stray_requests = sum(id(s) not in kept for s, _ in self._by_request.values())
        if stray_keys or stray_requests or len(self._by_request) > len(self._sends):
            raise IntegrityError(
                f"SentPrefixes: {stray_keys} of {len(self._sent)} keys and {stray_requests} "
                f"of {len(self._by_request)} requests point at none of the "
                f"{len(self._sends)} kept sendings"
            )


def _forget(sent: dict[bytes, Sending], keys: Sequence[bytes], sending: Sending) -> int:
    """Drop the keys whose newest sending is still `sending` (not sent again since), and
    say how many. Found in C-level passes; a hot prefix, sent again decision after
    decision, leaves few to drop."""
    gone = dict.fromkeys(compress(keys, map(is_, map(sent.get, keys), repeat(sending))))
    for k in gone:
        del sent[k]
    return len(gone)


def _leading_run(sent: list[Sending], rank: int) -> int:
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
