"""What a precise router counts as held because it sent it there (SentPrefixes), against
an oracle that remembers every sending and expires it by the rules.

Random sendings (prompts sharing prefixes, and also keys in any order: the fast path
assumes chained keys, and must stay exact when they are not), at random times, with
a small cap on how many sendings are kept; then the overlay of one prompt on an index
that holds some of it.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfold.admission.routing import SentPrefixes
from kvfold.blockindex.match import Match

KEYS = [bytes([i]) * 4 for i in range(8)]
TTL_S, MAX_SENDS, WORLD = 2.0, 4, 3

prompts = st.one_of(
    st.integers(1, len(KEYS)).map(lambda n: KEYS[:n]),  # chained: a prefix of one chain
    st.lists(st.sampled_from(KEYS), min_size=1, max_size=len(KEYS)),  # anything
)
sendings = st.lists(st.tuples(prompts, st.integers(0, WORLD - 1), st.floats(0.0, 1.5)), max_size=10)


def oracle(sends: list[tuple[list[bytes], int, float]], now_s: float) -> dict[bytes, int]:
    """Each key's rank by the newest sending still kept: the last MAX_SENDS, and of those
    the ones no older than TTL_S; a sending expires only after every older one has."""
    kept = sends[-MAX_SENDS:]
    while kept and kept[0][2] < now_s - TTL_S:
        kept = kept[1:]
    held: dict[bytes, int] = {}
    for keys, rank, _ in kept:
        held.update(dict.fromkeys(keys, rank))
    return held


@settings(max_examples=300, deadline=None)
@given(
    sendings,
    prompts,
    st.floats(0.0, 4.0),
    st.lists(st.integers(0, len(KEYS)), min_size=WORLD, max_size=WORLD),
)
def test_the_overlay_counts_what_was_sent_and_is_still_kept(
    sends: list, prompt: list[bytes], later_s: float, gpu: list[int]
) -> None:
    sent = SentPrefixes(TTL_S, max_sends=MAX_SENDS)
    now = 0.0
    timeline = []
    for keys, rank, dt in sends:
        now += dt
        sent.add(keys, rank, now)
        timeline.append((keys, rank, now))
    now += later_s
    reusable = len(prompt) - 1
    match = Match((np.array(gpu), np.array(gpu) + 1))

    got = sent.overlay(match, prompt, reusable, now)

    held = oracle(timeline, now)
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
