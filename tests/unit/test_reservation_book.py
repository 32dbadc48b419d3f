"""ReservationBook against a plain dict: adds, removes, settles and expiries in any
order, through growth and compaction of its arrays (a tiny capacity forces both)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfold.admission.reservations import ReservationBook

WORLD = 4
WINDOWS = (None, 8)

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 30), st.integers(0, WORLD - 1), st.integers(0, 5)),
    st.tuples(st.just("remove"), st.integers(0, 30)),
    st.tuples(st.just("settle"), st.lists(st.integers(0, 40), min_size=WORLD, max_size=WORLD)),
    st.tuples(st.just("expire"), st.integers(0, 40)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=80))
def test_the_book_matches_a_plain_dict(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    book = ReservationBook(capacity=2)
    model: dict[str, tuple[int, int, dict, float]] = {}  # id -> (rank, ticket, blocks, made)
    ticket = 0
    for step, o in enumerate(ops):
        if o[0] == "add":
            rid = f"r{o[1]}"
            if rid in model:
                continue
            ticket += 1
            blocks = {None: o[3], 8: o[3] + 1} if o[3] % 2 else {None: o[3]}
            book.add(rid, o[2], ticket, blocks, float(step))
            model[rid] = (o[2], ticket, blocks, float(step))
        elif o[0] == "remove":
            rid = f"r{o[1]}"
            got = book.remove(rid)
            want = model.pop(rid, None)
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert got[0] == want[0]
                assert {w: n for w, n in got[1].items() if n} == {
                    w: n for w, n in want[2].items() if n
                }
        elif o[0] == "settle":
            seen = np.asarray(o[1], dtype=np.int64)
            gone = [r for r, (rank, t, _, _) in model.items() if t <= seen[rank]]
            assert book.settle(seen) == len(gone)
            for r in gone:
                del model[r]
        else:
            gone = [r for r, (_, _, _, made) in model.items() if made <= o[1]]
            assert book.expire(float(o[1])) == len(gone)
            for r in gone:
                del model[r]
        assert len(book) == len(model)
        assert book.request_ids() == sorted(model, key=lambda r: model[r][1])  # oldest first
        assert all(r in book for r in model) and "absent" not in book
        want = np.zeros((len(WINDOWS), WORLD), dtype=np.int64)
        for rank, _, blocks, _ in model.values():
            for i, w in enumerate(WINDOWS):
                want[i, rank] += blocks.get(w, 0)
        assert np.array_equal(book.reserved(WINDOWS, WORLD), want)
