"""What a precise router counts as held because it sent it there (SentPrefixes), against
an oracle that remembers every sending and release and expires sendings by the rules.

Random sendings by a few request ids (prompts sharing prefixes, and also keys in any
order: the fast path assumes chained keys, and must stay exact when they are not), at
random times, with a small cap on how many sendings are kept, and releases of request
ids among them; then the overlay of one prompt on an index that holds some of it.
check_integrity() holds after every step.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfold.admission.sent import SentPrefixes
from kvfold.blockindex.match import Match

KEYS = [bytes([i]) * 4 for i in range(8)]
TTL_S, MAX_SENDS, WORLD = 2.0, 4, 3
REQUEST_IDS = ("a", "b", "c")

prompts = st.one_of(
    st.integers(1, len(KEYS)).map(lambda n: KEYS[:n]),  # chained: a prefix of one chain
    st.lists(st.sampled_from(KEYS), min_size=1, max_size=len(KEYS)),  # anything
)
request_ids = st.sampled_from(REQUEST_IDS)
sends = st.tuples(st.just("send"), request_ids, prompts, st.integers(0, WORLD - 1))
releases = st.tuples(st.just("release"), request_ids)
steps = st.lists(st.tuples(st.one_of(sends, releases), st.floats(0.0, 1.5)), max_size=12)


class Sending:
    def __init__(self, request_id: str, keys: list[bytes], rank: int, at_s: float) -> None:
        self.request_id, self.keys, self.rank, self.at_s = request_id, keys, rank, at_s
        self.released = False


def oracle(timeline: list[Sending], now_s: float) -> dict[bytes, int]:
    """Each key's rank by its newest kept sending, unless that sending was released.
    Kept: the last MAX_SENDS, and of those the ones no older than TTL_S; a sending
    expires only after every older one has."""
    kept = timeline[-MAX_SENDS:]
    while kept and kept[0].at_s < now_s - TTL_S:
        kept = kept[1:]
    held: dict[bytes, int | None] = {}
    for s in kept:
        held.update(dict.fromkeys(s.keys, None if s.released else s.rank))
    return {k: r for k, r in held.items() if r is not None}


@settings(max_examples=400, deadline=None)
@given(
    steps,
    prompts,
    st.floats(0.0, 4.0),
    st.lists(st.integers(0, len(KEYS)), min_size=WORLD, max_size=WORLD),
)
def test_the_overlay_counts_what_was_sent_and_is_still_kept(
    ops: list, prompt: list[bytes], later_s: float, gpu: list[int]
) -> None:
    sent = SentPrefixes(TTL_S, max_sends=MAX_SENDS)
    now = 0.0
    timeline: list[Sending] = []
    newest: dict[str, Sending] = {}  # each request id's newest sending
    for op, dt in ops:
        now += dt
        if op[0] == "send":
            _, rid, keys, rank = op
            sent.add(rid, keys, rank, now)
            newest[rid] = Sending(rid, keys, rank, now)
            timeline.append(newest[rid])
        else:
            forgot = sent.release(op[1])
            gone = newest.pop(op[1], None)
            if gone is not None:
                gone.released = True
            else:
                assert forgot == 0  # nothing to take back, nothing forgotten
        sent.check_integrity()
    now += later_s
    reusable = len(prompt) - 1
    match = Match((np.array(gpu), np.array(gpu) + 1))

    got = sent.overlay(match, prompt, reusable, now)
    sent.check_integrity()

    held = oracle(timeline, now)
    assert len(sent) == len(held)  # the overlay expired what it had to: the same keys
    want_gpu, want_total = list(gpu), [g + 1 for g in gpu]
    rank = held.get(prompt[0])
    if rank is not None:
        run = 0
        while run < reusable and held.get(prompt[run]) == rank:
            run += 1
        want_gpu[rank] = max(want_gpu[rank], run)
        want_total[rank] = max(want_total[rank], run)
    assert got.gpu.tolist() == want_gpu
    assert got.total.tolist() == want_total


def test_a_release_takes_back_only_the_keys_no_later_sending_sent() -> None:
    """The picture in kvfold/admission/sent.py, key by key."""
    k1, k2, k3, k4 = KEYS[:4]
    sent = SentPrefixes(TTL_S)
    sent.add("a", [k1, k2, k3, k4], 0, 0.0)
    sent.add("b", [k1, k2], 1, 0.1)
    assert sent.release("a") == 2  # k3, k4: k1 and k2 are b's now
    assert sent.release("a") == 0  # once only
    match = Match((np.zeros(WORLD, dtype=np.int64), np.zeros(WORLD, dtype=np.int64)))
    assert sent.overlay(match, [k1, k2, k3, k4], 3, 0.2).gpu.tolist() == [0, 2, 0]
    assert sent.release("b") == 2 and len(sent) == 0
    sent.check_integrity()
