"""Passing a request to an engine's OpenAI server and its answer back, as it comes, with
the HTTP client Ray Serve itself uses (aiohttp). No Ray, no kvfold state.

    EngineFailed        the engine did not answer, or broke off; `streamed`: bytes had gone out
    post_json           one answer, whole
    open_stream         the engine's status and headers once it starts answering, then
      .chunks()         its bytes as they come (Server-Sent Events pass through untouched)
    coalesced           a stream's bytes at once up to its first token, then what came in
                        each interval, joined
    FirstToken          whether an OpenAI stream's events have carried a token yet
    relayed             what a client gets of a stream: coalesced, an engine failure as a
                        last error event, and a callback when it ends, fails or is dropped
    error_body          OpenAI's error shape
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvfold.errors import KVFoldError

# An engine's answer may take as long as it generates; a connection that cannot be opened
# fails fast, so an unstreamed request can go elsewhere.
CONNECT_TIMEOUT_S = 5.0
_PASSED_HEADERS = ("content-type", "cache-control")
_SSE_NOT_DATA = (b":", b"event:", b"id:", b"retry:")  # a comment, or a field other than data
_TOKEN_FIELDS = ("content", "reasoning_content", "tool_calls")  # of a chat's delta


class EngineFailed(KVFoldError, ConnectionError):
    """The engine at `url` failed the request: could not be reached, or broke off."""

    def __init__(self, rank: int, url: str, detail: str, streamed: bool) -> None:
        self.rank = rank
        self.url = url
        self.streamed = streamed
        super().__init__(f"engine rank {rank} at {url} failed: {detail}")


def new_session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


def _payload(body: Mapping[str, Any] | bytes) -> dict[str, Any]:
    """aiohttp's arguments for a JSON body: bytes as they came (the client's own, passed on
    unchanged without encoding it again), or an object to encode."""
    if isinstance(body, bytes):
        return {"data": body, "headers": {"Content-Type": "application/json"}}
    return {"json": body}


async def post_json(
    session: aiohttp.ClientSession,
    rank: int,
    url: str,
    path: str,
    body: Mapping[str, Any] | bytes,
) -> tuple[int, bytes, dict[str, str]]:
    """POST `body` to the engine; its status, body and passed-on headers."""
    try:
        async with session.post(url + path, **_payload(body)) as r:
            data = await r.read()
            return r.status, data, _headers(r)
    except (aiohttp.ClientError, OSError) as e:
        raise EngineFailed(rank, url, repr(e), streamed=False) from e


@dataclass
class EngineStream:
    rank: int
    url: str
    status: int
    headers: dict[str, str]
    response: aiohttp.ClientResponse

    async def chunks(self) -> AsyncIterator[bytes]:
        """The engine's bytes as they come; EngineFailed if it breaks off."""
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError) as e:
            raise EngineFailed(self.rank, self.url, repr(e), streamed=True) from e
        finally:
            self.response.release()

    async def body(self) -> bytes:
        try:
            return await self.response.read()
        except (aiohttp.ClientError, OSError) as e:
            raise EngineFailed(self.rank, self.url, repr(e), streamed=False) from e
        finally:
            self.response.release()

    def close(self) -> None:
        self.response.close()


async def open_stream(
    session: aiohttp.ClientSession,
    rank: int,
    url: str,
    path: str,
    body: Mapping[str, Any] | bytes,
) -> EngineStream:
    """POST `body` and wait for the engine's status line; nothing of the body is read."""
    try:
        r = await session.post(url + path, **_payload(body))
    except (aiohttp.ClientError, OSError) as e:
        raise EngineFailed(rank, url, repr(e), streamed=False) from e
    return EngineStream(rank, url, r.status, _headers(r), r)


async def coalesced(chunks: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """`chunks` as a client gets them: each at once until one carries a token (time to
    first token is untouched, though an engine's first event may carry none: a chat's role,
    a token whose text the detokenizer holds back), then everything that came in each
    `interval_s`, joined, and the last as soon as the engine ends. One pass through Ray
    Serve's proxy per interval instead of one per token: Ray Serve LLM batches its streams
    the same way (every 50 ms by default). `interval_s` 0: each chunk as it comes. An
    exception of `chunks` is raised after the bytes that came before it."""
    if interval_s <= 0:
        async for chunk in chunks:
            yield chunk
        return
    came: list[bytes] = []
    arrived = asyncio.Event()
    ended = asyncio.Event()

    async def read() -> None:
        try:
            async for chunk in chunks:
                came.append(chunk)
                arrived.set()
        finally:
            ended.set()
            arrived.set()

    reader = asyncio.get_running_loop().create_task(read())
    reader.add_done_callback(_retrieved)
    first = FirstToken()
    try:
        while True:
            if not first.seen:
                await arrived.wait()  # before the first token: each chunk as it comes
            arrived.clear()  # before taking: what comes while the client reads sets it again
            if came:
                out = b"".join(came)
                came.clear()
                first.feed(out)
                yield out
            if ended.is_set() and not came:
                break
            if first.seen:
                with contextlib.suppress(asyncio.TimeoutError):  # the interval passed
                    await asyncio.wait_for(ended.wait(), interval_s)
        reader.result()  # the engine's failure, after what it sent
    finally:
        reader.cancel()  # the client went away: stop reading the engine


class FirstToken:
    """Whether an OpenAI stream's Server-Sent Events have carried a token yet: a choice's
    `text`, or its `delta`'s `content`, `reasoning_content` or `tool_calls`, not empty; or
    anything that is not such an event (an error, `[DONE]`, bytes of another shape): from
    there on a stream may be coalesced. Fed the stream's bytes in order, however they are
    cut; reads nothing once it has seen one."""

    def __init__(self) -> None:
        self.seen = False
        self._line = b""  # the last line, not yet ended

    def feed(self, data: bytes) -> None:
        if self.seen:
            return
        *lines, self._line = (self._line + data).split(b"\n")
        self.seen = any(_carries_token(line.strip()) for line in lines)


def _carries_token(line: bytes) -> bool:
    if not line or line.startswith(_SSE_NOT_DATA):
        return False
    if not line.startswith(b"data:"):
        return True  # not an event stream: nothing to wait for
    try:
        event = json.loads(line[5:])
    except ValueError:
        return True  # [DONE], or not JSON
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(choices, list) or not choices:
        return True  # an error, or a usage summary: nothing more to wait for
    for choice in choices:
        if not isinstance(choice, dict):
            return True
        delta = choice.get("delta")  # a chat's; a completion's choice has text
        if choice.get("text") or (
            isinstance(delta, dict) and any(delta.get(k) for k in _TOKEN_FIELDS)
        ):
            return True
    return False


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # raised to the consumer, or dropped with it: never "unretrieved"


async def relayed(
    stream: EngineStream,
    interval_s: float,
    on_end: Callable[[], None] | None = None,
    on_first: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """The engine's stream as its client gets it: coalesced every `interval_s`, an engine
    failure as a last error event naming the engine, `on_first()` when its first bytes come
    (an OpenAI server streams nothing before the first token: the prompt is prefilled),
    and `on_end()` once it ends, fails or the client goes away (the generator is closed)."""
    try:
        async for chunk in coalesced(stream.chunks(), interval_s):
            if on_first is not None:
                on_first()
                on_first = None
            yield chunk
    except EngineFailed as e:
        yield sse_error(str(e), "engine_failed", 502)
    finally:
        stream.close()
        if on_end is not None:
            on_end()


def error_body(message: str, kind: str, code: int, param: str | None = None) -> bytes:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}
    ).encode()


def sse_error(message: str, kind: str, code: int) -> bytes:
    """An error as the last Server-Sent Event of a stream that already began."""
    return b"data: " + error_body(message, kind, code) + b"\n\n"


def _headers(r: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower() in _PASSED_HEADERS}


__all__ = [
    "EngineFailed",
    "EngineStream",
    "FirstToken",
    "coalesced",
    "error_body",
    "new_session",
    "open_stream",
    "post_json",
    "relayed",
    "sse_error",
]
