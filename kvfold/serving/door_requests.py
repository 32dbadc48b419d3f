"""One request through kvfold's door, whatever serves its HTTP: Ray Serve's proxy and the
FrontDoor deployment (kvfold.serving.front_door), or the door answering HTTP itself
(kvfold.serving.door_http). No web framework here: a request comes in as its raw body and
goes out as an Answer, which each shell turns into its own response.

    DoorOf        the door as an ingress calls it: in this process, or the namespace's actor
    Answer        status, headers, and a body or a stream of chunks
    DoorRequests  serve(body, path) / models() / health() / stats() / committed(...)

Per request: its token ids (kvfold.serving.prompt_tokens: as the engine computes them), its
declared end (prompt + max_tokens, or the model's limit), the door's decision (which
engine, once it fits; kvfold.serving.door_actor), the body forwarded unchanged to that
engine, and the door told when the answer ends, fails, or its client goes away (the
stream's generator is closed). An engine that fails before a byte was streamed back is
left for another (once); after, the stream ends with an error event naming the engine.

HTTP statuses of the door's own: 400 (a body it cannot count, a prompt no engine can hold),
429 with Retry-After (kvfold's queue is full, or the request waited its whole deadline),
502 (the engine failed; the message names it), 503 (no door, or no engine fresh).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import ray

from kvfold.serving.door_actor import DoorActor, get_door
from kvfold.serving.door_answers import Admitted, NotAdmitted
from kvfold.serving.forward import (
    EngineFailed,
    error_body,
    new_session,
    open_stream,
    post_json,
    relayed,
)
from kvfold.serving.openai_body import BadRequest, OpenAIRequest, parse_chat, parse_completion
from kvfold.serving.prompt_tokens import PromptTokenizer
from kvfold.serving.settings import FrontDoorSettings

log = logging.getLogger("kvfold")

JSON = "application/json"
PARSERS: dict[str, Callable[[object], OpenAIRequest]] = {
    "/v1/completions": parse_completion,
    "/v1/chat/completions": parse_chat,
}


@dataclass
class Answer:
    status: int
    body: bytes = b""
    headers: dict[str, str] | None = None
    chunks: AsyncIterator[bytes] | None = None  # a stream: its body, chunk by chunk
    media_type: str = JSON


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> Answer:
    return Answer(status, error_body(message, kind, status), headers)


def _retry_after(seconds: float | None) -> dict[str, str]:
    return {"Retry-After": str(max(1, round(seconds or 1)))}


def _kvfold(headers: dict[str, str], a: Admitted) -> dict[str, str]:
    """The engine's headers, and where kvfold sent it and why (for clients and benchmarks)."""
    return {
        **{k: v for k, v in headers.items() if k.lower() != "content-type"},
        "x-kvfold-engine": str(a.rank),
        "x-kvfold-held-blocks": str(a.held_blocks),
        "x-kvfold-committed-blocks": str(a.need_blocks),
        "x-kvfold-waited-ms": f"{a.waited_s * 1e3:.1f}",
    }


class DoorOf:
    """The door as an ingress calls it: in this process (shared_door=False: no Ray call
    on a request's path) or the namespace's door actor (shared_door=True)."""

    def __init__(self, settings: FrontDoorSettings) -> None:
        self.local: DoorActor | None = None if settings.shared_door else DoorActor(settings)
        self.actor: Any = get_door(settings.namespace) if settings.shared_door else None

    async def admit(self, *args: Any) -> Admitted | NotAdmitted:
        if self.local is not None:
            return await self.local.admit(*args)
        answer: Admitted | NotAdmitted = await self.actor.admit.remote(*args)
        return answer

    def started(self, request_id: str) -> None:
        if self.local is not None:
            self.local.started_now(request_id)
        else:
            self.actor.started.remote(request_id)  # answered in order, before the release

    def release(self, request_id: str) -> None:
        if self.local is not None:
            self.local.release_now(request_id)
        else:
            self.actor.release.remote(request_id)  # answered in order with the admit

    async def stats(self) -> dict[str, Any]:
        if self.local is not None:
            self.local.start_following()
            return self.local.stats()
        stats: dict[str, Any] = await self.actor.stats.remote()
        return stats

    async def committed_between(self, engine: int, t0: float, t1: float) -> int:
        if self.local is not None:
            return self.local.committed_between(engine, t0, t1)
        most: int = await self.actor.committed_between.remote(engine, t0, t1)
        return most


class DoorRequests:
    """What every door ingress does with a request (in an event loop of its own)."""

    def __init__(self, settings: FrontDoorSettings) -> None:
        self.settings = settings
        self.tokenizer = PromptTokenizer(settings.model_dir)
        self.door = DoorOf(settings)
        self._session: Any = None

    def _http(self) -> Any:
        if self._session is None:
            self._session = new_session()
        return self._session

    async def models(self) -> Answer:
        for url in self.settings.engine_urls:
            try:
                async with self._http().get(url + "/v1/models") as r:
                    return Answer(r.status, await r.read())
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):  # down: ask the next
                continue
        return _error(503, "no engine answered /v1/models", "unavailable")

    async def health(self) -> Answer:
        try:
            stats = await self.door.stats()
        except ray.exceptions.RayError as e:  # the door actor died, or is not up yet
            return _error(503, f"the door does not answer: {e!r}", "unavailable")
        live = [r for r, e in stats["engines"].items() if e["live"]]
        body = json.dumps({"live_engines": live, "queued": stats["queued"]}).encode()
        return Answer(200 if live else 503, body)

    async def stats(self) -> Answer:
        return Answer(200, json.dumps(await self.door.stats()).encode())

    async def committed(self, query: dict[str, str]) -> Answer:
        """The most the door committed on `engine` at any time in [t0, t1] (wall clock)."""
        try:
            engine, t0, t1 = int(query["engine"]), float(query["t0"]), float(query["t1"])
        except (KeyError, ValueError) as e:
            return _error(400, f"query {query!r}: {e!r}: allowed: engine=INT&t0=S&t1=S",
                          "invalid_request_error")  # fmt: skip
        most = await self.door.committed_between(engine, t0, t1)
        return Answer(200, json.dumps({"engine": engine, "committed_blocks": most}).encode())

    async def serve(self, raw: bytes, path: str) -> Answer:
        """One completion or chat request: its answer, or a stream of it."""
        try:
            return await self._serve_one(raw, path)
        except Exception as e:  # the request's boundary: a fault of kvfold's own, whatever
            # it is, is answered as a 500 that names it (a framework's own would say nothing)
            log.exception("kvfold front door: %s failed", path)
            return _error(500, f"kvfold front door: {e!r}", "internal_error")

    async def _serve_one(self, raw: bytes, path: str) -> Answer:
        try:
            body = json.loads(raw)
        except ValueError as e:  # not JSON, or not UTF-8 (both ValueErrors)
            return _error(400, f"body: not JSON ({e})", "invalid_request_error")
        try:
            req = PARSERS[path](body)
            ids = self.tokenizer.ids(req)
        except BadRequest as e:
            return Answer(400, error_body(str(e), "invalid_request_error", 400, e.param))
        rid = f"door-{uuid.uuid4().hex}"
        avoid: list[int] = []
        for attempt in (0, 1):
            try:
                admitted = await self.door.admit(rid, ids, req.max_tokens, req.n, None, avoid)
            except BaseException:
                self.door.release(rid)  # cancelled while queued (its client went away), or worse
                raise
            if isinstance(admitted, NotAdmitted):
                status = admitted.http_status
                headers = _retry_after(admitted.retry_after_s) if status == 429 else None
                return _error(status, admitted.message, admitted.reason, headers)
            try:
                if req.stream:
                    return await self._stream(rid, admitted, path, raw)
                status, data, headers = await post_json(
                    self._http(), admitted.rank, admitted.url, path, raw
                )
                self.door.release(rid)
                return Answer(status, data, _kvfold(headers, admitted))
            except EngineFailed as e:
                self.door.release(rid)
                if not e.streamed and attempt == 0 and self.settings.retry_unstreamed:
                    avoid.append(e.rank)
                    rid = f"door-{uuid.uuid4().hex}"
                    continue
                return _error(502, str(e), "engine_failed")
            except BaseException:
                self.door.release(rid)
                raise
        raise AssertionError("unreachable")

    async def _stream(self, rid: str, admitted: Admitted, path: str, raw: bytes) -> Answer:
        """The engine's stream of `raw` (the client's body, unchanged), as it comes."""
        stream = await open_stream(self._http(), admitted.rank, admitted.url, path, raw)
        if stream.status != 200:
            data = await stream.body()
            self.door.release(rid)
            return Answer(stream.status, data, _kvfold(stream.headers, admitted))
        chunks = relayed(
            stream, self.settings.stream_interval,
            on_end=lambda: self.door.release(rid), on_first=lambda: self.door.started(rid),
        )  # fmt: skip
        return Answer(
            200, b"", _kvfold(stream.headers, admitted), chunks,
            stream.headers.get("Content-Type", "text/event-stream"),
        )  # fmt: skip


__all__ = ["JSON", "PARSERS", "Answer", "DoorOf", "DoorRequests"]
