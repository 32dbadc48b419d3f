"""The door answering HTTP itself (`FrontDoorSettings(ingress="door")`): one async Ray actor
that serves kvfold's OpenAI routes with aiohttp on `http_host:http_port` and decides each
request in its own process, with no proxy and no Ray call on a request's path. The same
routes, statuses and headers as the Serve ingress (kvfold.serving.door_requests).

    DoorServer   the actor: start() binds and serves; stop() closes
    start_door_server(settings) -> the actor, serving once start() returns

Why: Ray Serve's Python proxy and a deployment handle cost a request 6-7 ms here (two
hops, one pickle each way); an engine's own server, a Rust router, or this actor cost
under a millisecond or two. One process holds the door's state and the HTTP loop, as
vllm-router and llm-d's gateway do; it scales up, not out (shared_door is for the Serve
ingress's replicas).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray

from kvfold.serving.door_requests import PARSERS, Answer, DoorRequests
from kvfold.serving.settings import FrontDoorSettings

log = logging.getLogger("kvfold")


class DoorServer:
    def __init__(self, settings: FrontDoorSettings) -> None:
        self.settings = settings
        self.requests = DoorRequests(settings)
        self._runner: Any = None

    async def start(self) -> str:
        """Bind and serve; the URL it serves at (refuses a port already taken)."""
        from aiohttp import web

        if self._runner is not None:
            return self._url()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        prefix = self.settings.route_prefix.rstrip("/")
        for path in PARSERS:
            app.router.add_post(prefix + path, self._completion)
        app.router.add_get(prefix + "/v1/models", self._plain(self.requests.models))
        app.router.add_get(prefix + "/health", self._plain(self.requests.health))
        app.router.add_get(prefix + "/kvfold/stats", self._plain(self.requests.stats))
        app.router.add_get(prefix + "/kvfold/committed", self._committed)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(
            runner, self.settings.http_host, self.settings.http_port, reuse_address=True
        )
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        if self.requests.door.local is not None:
            self.requests.door.local.start_following()
        return self._url()

    def _url(self) -> str:
        host = self.settings.http_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://{host}:{self.settings.http_port}{self.settings.route_prefix.rstrip('/')}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- aiohttp's side ------------------------------------------------------------------

    async def _completion(self, request: Any) -> Any:
        path = request.match_info.route.resource.canonical
        path = path[len(self.settings.route_prefix.rstrip("/")) :]
        answer = await self.requests.serve(await request.read(), path)
        return await _respond(request, answer)

    def _plain(self, fn: Any) -> Any:
        async def handler(request: Any) -> Any:
            return await _respond(request, await fn())

        return handler

    async def _committed(self, request: Any) -> Any:
        return await _respond(request, await self.requests.committed(dict(request.query)))


async def _respond(request: Any, a: Answer) -> Any:
    """An Answer as aiohttp's response; a stream written chunk by chunk as it comes. A
    client gone mid-stream closes the stream's generator (the door's release)."""
    from aiohttp import web

    if a.chunks is None:
        return web.Response(body=a.body, status=a.status, headers=a.headers,
                            content_type=a.media_type)  # fmt: skip
    resp = web.StreamResponse(status=a.status, headers=a.headers)
    resp.content_type = a.media_type
    try:
        await resp.prepare(request)
        async for chunk in a.chunks:
            await resp.write(chunk)
        await resp.write_eof()
    finally:
        with contextlib.suppress(Exception):  # closing an ended generator: nothing to do
            await a.chunks.aclose()  # type: ignore[attr-defined]
    return resp


def start_door_server(settings: FrontDoorSettings) -> Any:
    """The door's HTTP actor in kvfold's namespace, serving once this returns."""
    actor: Any = (
        ray.remote(DoorServer)
        .options(
            name=f"{settings.app_name}-http",
            namespace=settings.namespace,
            num_cpus=0,
            max_concurrency=10_000,
        )
        .remote(settings)
    )
    ray.get(actor.start.remote())
    return actor


__all__ = ["DoorServer", "start_door_server"]
