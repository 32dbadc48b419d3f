"""Passing a request to an engine's OpenAI server and its answer back, as it comes, with
the HTTP client Ray Serve itself uses (aiohttp). No Ray, no kvfold state.

    EngineFailed        the engine did not answer, or broke off; `streamed`: bytes had gone out
    post_json           one answer, whole
    open_stream         the engine's status and headers once it starts answering, then
      .chunks()         its bytes as they come (Server-Sent Events pass through untouched)
    error_body          OpenAI's error shape
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvfold.errors import KVFoldError

# An engine's answer may take as long as it generates; a connection that cannot be opened
# fails fast, so an unstreamed request can go elsewhere.
CONNECT_TIMEOUT_S = 5.0
_PASSED_HEADERS = ("content-type", "cache-control")


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


async def post_json(
    session: aiohttp.ClientSession, rank: int, url: str, path: str, body: Mapping[str, Any]
) -> tuple[int, bytes, dict[str, str]]:
    """POST `body` to the engine; its status, body and passed-on headers."""
    try:
        async with session.post(url + path, json=body) as r:
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
    session: aiohttp.ClientSession, rank: int, url: str, path: str, body: Mapping[str, Any]
) -> EngineStream:
    """POST `body` and wait for the engine's status line; nothing of the body is read."""
    try:
        r = await session.post(url + path, json=body)
    except (aiohttp.ClientError, OSError) as e:
        raise EngineFailed(rank, url, repr(e), streamed=False) from e
    return EngineStream(rank, url, r.status, _headers(r), r)


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
    "error_body",
    "new_session",
    "open_stream",
    "post_json",
    "sse_error",
]
