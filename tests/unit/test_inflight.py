"""The door's picture of what each engine is still running, by content (kvfold.serving.
inflight), against a recount from the requests themselves: random adds and removes, every
match the longest prefix sent to that engine and not ended."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfold.serving.inflight import InFlight
from kvfold.worker.hashing import block_keys

B = 4


def _keys(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, B)


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove"]),
        st.integers(0, 7),  # request
        st.integers(0, 2),  # engine
        st.lists(st.integers(0, 2), min_size=0, max_size=16),  # its prompt's tokens
    ),
    max_size=40,
)


@given(ops, st.lists(st.integers(0, 2), min_size=0, max_size=20))
def test_match_is_the_longest_prefix_of_what_is_running_on_each_engine(
    steps: list[tuple[str, int, int, list[int]]], probe: list[int]
) -> None:
    inflight = InFlight()
    running: dict[str, tuple[int, list[int]]] = {}
    for op, r, engine, tokens in steps:
        rid = f"r{r}"
        if op == "add":
            inflight.add(rid, engine, _keys(tokens))
            running[rid] = (engine, tokens)
        else:
            inflight.remove(rid)
            running.pop(rid, None)
    want: dict[int, int] = {}
    for engine, tokens in running.values():
        n = 0
        while (n + 1) * B <= min(len(tokens), len(probe)) and tokens[: (n + 1) * B] == probe[
            : (n + 1) * B
        ]:
            n += 1
        if n:
            want[engine] = max(want.get(engine, 0), n)
    assert inflight.match(_keys(probe)) == want
    assert len(inflight) == len(running)
