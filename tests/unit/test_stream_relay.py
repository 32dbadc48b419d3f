"""A stream passed on by the front door (kvfold.serving.forward.coalesced and relayed): each
chunk at once up to the first that carries a token, later ones joined per interval, every
byte once and in order, an engine's failure after what it sent, and the end told once
however the stream ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfold.serving.forward import EngineFailed, EngineStream, FirstToken, coalesced, relayed

LONG_S = 60.0  # an interval no test waits out: what comes before it came without it


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def gated(chunks: list[bytes], gate: asyncio.Event, after: int) -> AsyncIterator[bytes]:
    """`chunks`, holding back those after the first `after` until `gate` is set."""
    for i, c in enumerate(chunks):
        if i == after:
            await gate.wait()
        yield c


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def text(t: str) -> bytes:  # a /v1/completions event
    return sse({"choices": [{"index": 0, "text": t, "finish_reason": None}]})


def delta(**d: Any) -> bytes:  # a /v1/chat/completions event
    return sse({"choices": [{"index": 0, "delta": d, "finish_reason": None}]})


def test_the_first_token_comes_before_the_interval_and_the_rest_together() -> None:
    async def go() -> list[bytes]:
        gate = asyncio.Event()
        chunks = [text("a"), text("b"), text("c"), text("d")]
        out = coalesced(gated(chunks, gate, after=1), LONG_S)
        first = await asyncio.wait_for(out.__anext__(), 10)  # long before LONG_S
        assert first == text("a")
        gate.set()
        return [first] + [c async for c in out]

    got = run(go())
    # b, c, d came within one interval: one piece, passed on as soon as the engine ended
    assert got == [text("a"), text("b") + text("c") + text("d")]


@pytest.mark.parametrize(
    "before",
    [
        [text("")],  # a token whose text the detokenizer holds back
        [delta(role="assistant", content="")],  # a chat's first event
        [b": keep-alive\n\n", delta(role="assistant")],
        [text("")[:7], text("")[7:]],  # an event cut in two
    ],
)
def test_events_without_a_token_go_at_once_up_to_the_first_token(before: list[bytes]) -> None:
    chat = b"delta" in before[-1]
    token = delta(content="hi") if chat else text("hi")
    later = delta(content="!") if chat else text("!")

    async def go() -> list[bytes]:
        gates = [asyncio.Event() for _ in before]  # the client has event i
        has_token = asyncio.Event()

        async def src() -> AsyncIterator[bytes]:
            for c, gate in zip(before, gates, strict=True):
                yield c
                await gate.wait()  # the next comes only once the client has this one
            yield token
            await has_token.wait()
            yield later

        out = coalesced(src(), LONG_S)
        got = []
        for gate in [*gates, has_token]:
            got.append(await asyncio.wait_for(out.__anext__(), 10))  # not after LONG_S
            gate.set()
        return got + [c async for c in out]

    got = run(go())
    assert got == [*before, token, later]


EVENTS = {
    "token": text("x"),
    "chat token": delta(content="x"),
    "tool call": delta(tool_calls=[{"index": 0}]),
    "empty text": text(""),
    "role": delta(role="assistant"),
    "comment": b": ping\n\n",
    "error": sse({"error": {"message": "engine rank 1 failed"}}),
    "done": b"data: [DONE]\n\n",
}
CARRIES = {"token", "chat token", "tool call", "error", "done"}  # from there on: coalesce


@settings(max_examples=150, deadline=None)
@given(
    names=st.lists(st.sampled_from(sorted(EVENTS)), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=10),
)
def test_first_token_is_seen_once_its_line_has_come_however_the_bytes_are_cut(
    names: list[str], cuts: list[int]
) -> None:
    stream = b"".join(EVENTS[n] for n in names)
    # the oracle: where the first event that carries a token ends its data line
    ends, at = [], 0
    for n in names:
        ends.append((at + EVENTS[n].index(b"\n") + 1, n in CARRIES))
        at += len(EVENTS[n])
    seen_from = min((end for end, carries in ends if carries), default=None)
    first = FirstToken()
    points = sorted({min(c, len(stream)) for c in cuts} | {len(stream)})
    fed = 0
    for p in points:
        first.feed(stream[fed:p])
        fed = p
        assert first.seen == (seen_from is not None and p >= seen_from), (names, p)


def test_interval_zero_passes_every_chunk_as_it_comes() -> None:
    async def go() -> list[bytes]:
        async def src() -> AsyncIterator[bytes]:
            for c in (b"x", b"y", b"z"):
                yield c

        return [c async for c in coalesced(src(), 0)]

    assert run(go()) == [b"x", b"y", b"z"]


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=1, max_size=5), max_size=30),
    pauses=st.lists(st.integers(0, 3), max_size=30),
    interval_s=st.sampled_from([0.0, 1e-4, 1e-3, LONG_S]),
)
def test_every_byte_once_and_in_order(
    chunks: list[bytes], pauses: list[int], interval_s: float
) -> None:
    async def go() -> list[bytes]:
        async def src() -> AsyncIterator[bytes]:
            for i, c in enumerate(chunks):
                for _ in range(pauses[i] if i < len(pauses) else 0):
                    await asyncio.sleep(0)  # other tasks run: the reader, the consumer
                yield c

        return [c async for c in coalesced(src(), interval_s)]

    got = run(go())
    assert b"".join(got) == b"".join(chunks)
    assert len(got) <= len(chunks)
    assert all(got)  # never an empty piece


def test_a_failure_comes_after_the_bytes_sent_before_it() -> None:
    async def go() -> tuple[list[bytes], BaseException | None]:
        async def src() -> AsyncIterator[bytes]:
            yield b"one"
            yield b"two"
            raise EngineFailed(2, "http://127.0.0.1:1", "reset", streamed=True)

        got: list[bytes] = []
        try:
            async for c in coalesced(src(), LONG_S):
                got.append(c)
        except EngineFailed as e:
            return got, e
        return got, None

    got, error = run(go())
    assert b"".join(got) == b"onetwo"
    assert isinstance(error, EngineFailed) and error.rank == 2


def test_a_client_going_away_stops_reading_the_engine() -> None:
    async def go() -> bool:
        stopped = asyncio.Event()

        async def src() -> AsyncIterator[bytes]:
            try:
                yield b"first"
                await asyncio.Event().wait()  # an engine that never sends more
                yield b"never"
            finally:
                stopped.set()

        out = coalesced(src(), LONG_S)
        assert await out.__anext__() == b"first"
        await out.aclose()  # the client went away
        await asyncio.wait_for(stopped.wait(), 10)
        return stopped.is_set()

    assert run(go())


class FakeResponse:
    """aiohttp's response as EngineStream reads it: content.iter_any(), release, close."""

    def __init__(self, chunks: list[bytes], fail: bool) -> None:
        self.content = self
        self._chunks = chunks
        self._fail = fail
        self.closed = 0

    async def iter_any(self) -> AsyncIterator[bytes]:
        for c in self._chunks:
            yield c
        if self._fail:
            raise ConnectionResetError("the engine went away")

    def release(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("fail", [False, True])
def test_relayed_ends_once_and_names_a_failed_engine(fail: bool) -> None:
    ended: list[int] = []

    async def go() -> tuple[bytes, FakeResponse]:
        response = FakeResponse([b"data: 1\n\n", b"data: 2\n\n"], fail)
        stream = EngineStream(1, "http://127.0.0.1:9", 200, {}, response)  # type: ignore[arg-type]
        got = [c async for c in relayed(stream, 1e-3, lambda: ended.append(1))]
        return b"".join(got), response

    body, response = run(go())
    assert body.startswith(b"data: 1\n\ndata: 2\n\n")
    assert (b"engine_failed" in body and b"engine rank 1" in body) == fail
    assert ended == [1] and response.closed == 1
