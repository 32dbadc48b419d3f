"""kvfold's front door: an OpenAI-compatible application in front of engine ranks
(DESIGN §11, docs/serving.md), on Ray Serve or answering HTTP itself.

    FrontDoor            the Serve ingress: /v1/completions, /v1/chat/completions (streamed
                         as the engine streams), /v1/models, /health, /kvfold/stats
    serve_front_door     start the ingress the settings name (on loopback unless told):
                         Serve and the FrontDoor app, or the door's own HTTP actor
                         (kvfold.serving.door_http); returns a FrontDoorApp with its URL
                         once every engine is fresh

What a request goes through is kvfold.serving.door_requests, the same for both ingresses.
"""

import json
import logging
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve

from kvfold.serving.door_actor import start_door
from kvfold.serving.door_requests import Answer, DoorRequests
from kvfold.serving.serve_loopback import keep_replica_grpc_on_node_address
from kvfold.serving.settings import FrontDoorSettings

log = logging.getLogger("kvfold")
keep_replica_grpc_on_node_address()  # imported with the deployment, before its replica serves

app = FastAPI(title="kvfold front door")


def _response(a: Answer) -> Response:
    if a.chunks is not None:
        return StreamingResponse(a.chunks, a.status, headers=a.headers, media_type=a.media_type)
    return Response(a.body, status_code=a.status, headers=a.headers, media_type=a.media_type)


@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class FrontDoor:
    def __init__(self, settings: FrontDoorSettings) -> None:
        self.settings = settings
        self.requests = DoorRequests(settings)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return _response(await self.requests.serve(await request.body(), "/v1/completions"))

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return _response(await self.requests.serve(await request.body(), "/v1/chat/completions"))

    @app.get("/v1/models")
    async def models(self) -> Response:
        return _response(await self.requests.models())

    @app.get("/health")
    async def health(self) -> Response:
        return _response(await self.requests.health())

    @app.get("/kvfold/stats")
    async def stats(self) -> Response:
        return _response(await self.requests.stats())

    @app.get("/kvfold/committed")
    async def committed(self, request: Request) -> Response:
        """The most the door committed on `engine` at any time in [t0, t1] (wall clock)."""
        return _response(await self.requests.committed(dict(request.query_params)))


@dataclass
class FrontDoorApp:
    """A running front door: its URL (and its door actor, when shared); shutdown() takes
    the app down."""

    settings: FrontDoorSettings
    url: str
    door: Any = None
    server: Any = None  # ingress="door": the door's HTTP actor

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
        if self.server is not None:
            try:
                ray.get(self.server.stop.remote(), timeout=30)
            finally:
                ray.kill(self.server)
            return
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
    door = server = None
    if settings.ingress == "door":
        from kvfold.serving.door_http import start_door_server

        server = start_door_server(settings)
    else:
        start_serve(settings.http_host, settings.http_port)
    if settings.shared_door:
        door = start_door(settings)
        try:
            ray.get(door.ready.remote(want), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"the door saw fewer than {want} engines live in {timeout_s} s: "
                f"{ray.get(door.stats.remote())['engines']}"
            ) from e
    if server is None:
        deployment: Any = FrontDoor.options(num_replicas=settings.num_replicas)  # type: ignore[attr-defined]
        serve.run(
            deployment.bind(settings), name=settings.app_name, route_prefix=settings.route_prefix
        )
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
    return FrontDoorApp(settings, url, door, server)


__all__ = ["FrontDoor", "FrontDoorApp", "serve_front_door", "start_serve"]
