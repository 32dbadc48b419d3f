"""Engines deployed as Ray Serve replicas, the way Ray Serve users already run them: replica
i of `EngineReplica` fronts engine i (its OpenAI server). With Serve's default router this
is the baseline `kvfold bench-serve` measures kvfold against; with kvfold's RequestRouter
(kvfold.serving.request_router) the same deployment gains kvfold's admission and routing.

    EngineReplica              the deployment: HTTP routes (/v1/completions, ...) and, for
                               deployment handles, generate(path, body)
    engine_deployment(urls, router_config=None)   the deployment, bound, one replica per engine

Each replica says which engine it fronts in its routing stats ({"kvfold_rank": i, "url"}),
which is how kvfold's RequestRouter finds the replica of the engine the door chose.
"""

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve

from kvfold.serving.forward import (
    EngineFailed,
    error_body,
    new_session,
    open_stream,
    post_json,
    relayed,
)
from kvfold.serving.serve_loopback import keep_replica_grpc_on_node_address
from kvfold.serving.settings import STREAM_INTERVAL_S

keep_replica_grpc_on_node_address()  # imported with the deployment, before its replica serves

engine_app = FastAPI(title="engines as Serve replicas")


@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(engine_app)
class EngineReplica:
    def __init__(
        self, engine_urls: list[str], stream_interval_s: float = STREAM_INTERVAL_S
    ) -> None:
        rank: Any = serve.get_replica_context().rank  # a ReplicaRank (an int before Ray 2.50)
        self.rank = int(getattr(rank, "rank", rank))
        if not 0 <= self.rank < len(engine_urls):
            raise ValueError(
                f"replica rank {self.rank}: allowed: 0..{len(engine_urls) - 1}, one replica "
                "per engine (num_replicas = len(engine_urls))"
            )
        self.url = engine_urls[self.rank]
        self._which = {"x-kvfold-engine": str(self.rank)}  # which engine answered, as kvfold's
        self.stream_interval_s = stream_interval_s
        self._session: Any = None

    def _http(self) -> Any:
        if self._session is None:
            self._session = new_session()
        return self._session

    def record_routing_stats(self) -> dict[str, Any]:
        return {"kvfold_rank": self.rank, "url": self.url}

    @engine_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._pass(request, "/v1/completions")

    @engine_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._pass(request, "/v1/chat/completions")

    async def generate(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """For a deployment handle: the engine's JSON answer to `body` at `path`, with
        `kvfold_rank` added (which engine answered)."""
        status, data, _ = await post_json(self._http(), self.rank, self.url, path, body)
        answer: dict[str, Any] = json.loads(data)
        if status != 200:
            raise EngineFailed(self.rank, self.url, f"HTTP {status}: {data[:300]!r}", False)
        answer["kvfold_rank"] = self.rank
        return answer

    async def _pass(self, request: Request, path: str) -> Response:
        body = await request.json()
        try:
            if not body.get("stream"):
                status, data, headers = await post_json(
                    self._http(), self.rank, self.url, path, body
                )
                return Response(data, status_code=status, headers={**headers, **self._which})
            stream = await open_stream(self._http(), self.rank, self.url, path, body)
        except EngineFailed as e:
            return Response(error_body(str(e), "engine_failed", 502), 502,
                            media_type="application/json", headers=self._which)  # fmt: skip
        if stream.status != 200:
            return Response(await stream.body(), stream.status,
                            headers={**stream.headers, **self._which})  # fmt: skip

        chunks = relayed(stream, self.stream_interval_s)
        return StreamingResponse(chunks, media_type="text/event-stream", headers=self._which)


def engine_deployment(
    engine_urls: list[str], router_config: Any = None, stream_interval_s: float = STREAM_INTERVAL_S
) -> Any:
    """EngineReplica bound to `engine_urls`, one replica per engine; `router_config`: a
    ray.serve.config.RequestRouterConfig (None: Serve's default router); streams passed on
    as the front door passes them (kvfold.serving.forward.coalesced)."""
    options: dict[str, Any] = {"num_replicas": len(engine_urls)}
    if router_config is not None:
        options["request_router_config"] = router_config
    return EngineReplica.options(**options).bind(list(engine_urls), stream_interval_s)  # type: ignore[attr-defined]


__all__ = ["EngineReplica", "engine_deployment"]
