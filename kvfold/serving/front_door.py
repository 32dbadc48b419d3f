"""kvfold's front door: an OpenAI-compatible Ray Serve application in front of engine ranks
(DESIGN §11, docs/serving.md).

    FrontDoor            the Serve ingress: /v1/completions, /v1/chat/completions (streamed
                         as the engine streams), /v1/models, /health, /kvfold/stats
    serve_front_door     start Serve (on loopback unless told), the door actor and the app;
                         returns a FrontDoorApp with its URL once every engine is fresh

Per request: its token ids (kvfold.serving.prompt_tokens: as the engine computes them), its
declared end (prompt + max_tokens, or the model's limit), the door's decision (which
engine, once it fits; kvfold.serving.door_actor), the body forwarded unchanged to that
engine, and the door told when the answer ends, fails, or its client goes away. An engine
that fails before a byte was streamed back is left for another (once); after, the stream
ends with an error event naming the engine.

HTTP statuses of the door's own: 400 (a body it cannot count, a prompt no engine can hold),
429 with Retry-After (kvfold's queue is full, or the request waited its whole deadline),
502 (the engine failed; the message names it), 503 (no door, or no engine fresh).
"""

import asyncio
import json
import logging
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from kvfold.serving.door_actor import DoorActor, get_door, start_door
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
from kvfold.serving.serve_loopback import keep_replica_grpc_on_node_address
from kvfold.serving.settings import FrontDoorSettings

log = logging.getLogger("kvfold")
keep_replica_grpc_on_node_address()  # imported with the deployment, before its replica serves

app = FastAPI(title="kvfold front door")


def _json(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


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
    """The door as the front door calls it: in this replica (shared_door=False: no Ray call
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


@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class FrontDoor:
    def __init__(self, settings: FrontDoorSettings) -> None:
        self.settings = settings
        self.tokenizer = PromptTokenizer(settings.model_dir)
        self.door = DoorOf(settings)
        self._session: Any = None

    def _http(self) -> Any:
        if self._session is None:
            self._session = new_session()
        return self._session

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/completions", parse_completion)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "/v1/chat/completions", parse_chat)

    @app.get("/v1/models")
    async def models(self) -> Response:
        for url in self.settings.engine_urls:
            try:
                async with self._http().get(url + "/v1/models") as r:
                    return _json(r.status, await r.read())
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):  # down: ask the next
                continue
        return _json(503, error_body("no engine answered /v1/models", "unavailable", 503))

    @app.get("/health")
    async def health(self) -> Response:
        try:
            stats = await self.door.stats()
        except ray.exceptions.RayError as e:  # the door actor died, or is not up yet
            return _json(503, error_body(f"the door does not answer: {e!r}", "unavailable", 503))
        live = [r for r, e in stats["engines"].items() if e["live"]]
        status = 200 if live else 503
        return JSONResponse({"live_engines": live, "queued": stats["queued"]}, status)

    @app.get("/kvfold/stats")
    async def stats(self) -> Response:
        return JSONResponse(await self.door.stats())

    @app.get("/kvfold/committed")
    async def committed(self, engine: int, t0: float, t1: float) -> Response:
        """The most the door committed on `engine` at any time in [t0, t1] (wall clock)."""
        most = await self.door.committed_between(engine, t0, t1)
        return JSONResponse({"engine": engine, "committed_blocks": most})

    # -- one request ---------------------------------------------------------------------

    async def _serve(
        self, request: Request, path: str, parse: Callable[[object], OpenAIRequest]
    ) -> Response:
        try:
            return await self._serve_one(request, path, parse)
        except Exception as e:  # the request's boundary: a fault of kvfold's own, whatever
            # it is, is answered as a 500 that names it (Serve's own would say nothing)
            log.exception("kvfold front door: %s failed", path)
            return _json(500, error_body(f"kvfold front door: {e!r}", "internal_error", 500))

    async def _serve_one(
        self, request: Request, path: str, parse: Callable[[object], OpenAIRequest]
    ) -> Response:
        try:
            body = await request.json()
        except ValueError as e:  # not JSON, or not UTF-8 (both ValueErrors)
            return _json(400, error_body(f"body: not JSON ({e})", "invalid_request_error", 400))
        try:
            req = parse(body)
            ids = self.tokenizer.ids(req)
        except BadRequest as e:
            return _json(400, error_body(str(e), "invalid_request_error", 400, e.param))
        rid = f"door-{uuid.uuid4().hex}"
        avoid: list[int] = []
        for attempt in (0, 1):
            try:
                admitted = await self.door.admit(rid, ids, req.max_tokens, req.n, None, avoid)
            except BaseException:
                self._release(rid)  # cancelled while queued (its client went away), or worse
                raise
            if isinstance(admitted, NotAdmitted):
                status = admitted.http_status
                headers = _retry_after(admitted.retry_after_s) if status == 429 else None
                return _json(status, error_body(admitted.message, admitted.reason, status), headers)
            try:
                if req.stream:
                    return await self._stream(rid, admitted, path, req)
                status, data, headers = await post_json(
                    self._http(), admitted.rank, admitted.url, path, req.body
                )
                self._release(rid)
                return Response(data, status_code=status, headers=_kvfold(headers, admitted))
            except EngineFailed as e:
                self._release(rid)
                if not e.streamed and attempt == 0 and self.settings.retry_unstreamed:
                    avoid.append(e.rank)
                    rid = f"door-{uuid.uuid4().hex}"
                    continue
                return _json(502, error_body(str(e), "engine_failed", 502))
            except BaseException:
                self._release(rid)
                raise
        raise AssertionError("unreachable")

    async def _stream(
        self, rid: str, admitted: Admitted, path: str, req: OpenAIRequest
    ) -> Response:
        stream = await open_stream(self._http(), admitted.rank, admitted.url, path, req.body)
        if stream.status != 200:
            data = await stream.body()
            self._release(rid)
            return Response(data, stream.status, headers=_kvfold(stream.headers, admitted))

        chunks = relayed(
            stream, self.settings.stream_interval_s,
            on_end=lambda: self._release(rid), on_first=lambda: self.door.started(rid),
        )  # fmt: skip
        return StreamingResponse(
            chunks, status_code=200, headers=_kvfold(stream.headers, admitted),
            media_type=stream.headers.get("Content-Type", "text/event-stream"),
        )  # fmt: skip

    def _release(self, rid: str) -> None:
        self.door.release(rid)  # nothing to wait on


@dataclass
class FrontDoorApp:
    """A running front door: its URL (and its door actor, when shared); shutdown() takes
    the app down."""

    settings: FrontDoorSettings
    url: str
    door: Any = None

    def stats(self) -> dict[str, Any]:
        """The door's commitments, queue and counts (GET /kvfold/stats); engines by rank."""
        stats: dict[str, Any] = _get_json(self.url + "/kvfold/stats")
        stats["engines"] = {int(r): e for r, e in stats["engines"].items()}
        return stats

    def committed_between(self, engine: int, t0: float, t1: float) -> int:
        """The most the door committed on `engine` at any time in [t0, t1] (wall clock)."""
        q = f"/kvfold/committed?engine={engine}&t0={t0!r}&t1={t1!r}"
        return int(_get_json(self.url + q)["committed_blocks"])

    def shutdown(self) -> None:
        serve.delete(self.settings.app_name)
        if self.door is not None:
            ray.kill(self.door)


def _get_json(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def start_serve(http_host: str = "127.0.0.1", http_port: int = 8000) -> None:
    """Start Ray Serve's controller and HTTP proxy on `http_host:http_port` (loopback unless
    asked), or keep the running ones."""
    serve.start(http_options={"host": http_host, "port": http_port})


def serve_front_door(
    settings: FrontDoorSettings, timeout_s: float = 120.0, engines_live: int | None = None
) -> FrontDoorApp:
    """Start the door actor and the front door's Serve app on the Ray cluster this process
    is connected to (kvfold launched there with the engines as ranks). Returns once the app
    answers and `engines_live` engines (None: every one) are fresh in the view with their
    max_model_len known. An engine not up yet is taken when it is."""
    want = len(settings.engine_urls) if engines_live is None else engines_live
    if type(want) is not int or not 1 <= want <= len(settings.engine_urls):
        raise ValueError(
            f"engines_live={engines_live!r}: allowed: 1..{len(settings.engine_urls)} (the "
            "engines to wait for), or None for every one"
        )
    if not settings.on_loopback:
        log.warning("kvfold front door: serving HTTP on %s, beyond loopback, as asked",
                    settings.http_host)  # fmt: skip
    start_serve(settings.http_host, settings.http_port)
    door = None
    if settings.shared_door:
        door = start_door(settings)
        try:
            ray.get(door.ready.remote(want), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"the door saw fewer than {want} engines live in {timeout_s} s: "
                f"{ray.get(door.stats.remote())['engines']}"
            ) from e
    deployment: Any = FrontDoor.options(num_replicas=settings.num_replicas)  # type: ignore[attr-defined]
    serve.run(deployment.bind(settings), name=settings.app_name, route_prefix=settings.route_prefix)
    host = "127.0.0.1" if settings.http_host in ("0.0.0.0", "::") else settings.http_host
    url = f"http://{host}:{settings.http_port}{settings.route_prefix.rstrip('/')}"
    deadline = time.monotonic() + timeout_s
    while True:  # `want` engines live, as the door sees the view
        try:
            health = _get_json(url + "/health", timeout_s=10)
            if len(health["live_engines"]) >= want:
                break
        except (OSError, ValueError, KeyError):  # 503 until an engine is fresh
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the front door at {url} saw fewer than {want} engines fresh in {timeout_s} s"
            )
        time.sleep(0.1)
    return FrontDoorApp(settings, url, door)


__all__ = ["FrontDoor", "FrontDoorApp", "serve_front_door", "start_serve"]
