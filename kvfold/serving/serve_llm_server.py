"""KVFoldLLMServer: Ray Serve LLM's LLMServer as one kvfold engine rank (kvfold.serving.
serve_llm says how an application gets it). Imported where the replicas run: it subclasses
Ray Serve LLM's server, which needs vLLM.

The replica with Serve rank i (`serve.get_replica_context().rank.rank`):
- starts its engine with KV events published to kvfold rank i's socket on 127.0.0.1 (the
  rank binds it; vLLM's publisher connects) and a replay socket bound on 127.0.0.1;
- serves its engine's numbers page on 127.0.0.1: /metrics, vLLM's own Prometheus series
  from this process, read from the registry vLLM's own /metrics reads (its
  PrometheusStatLogger writes there), and /v1/models with the engine's max_model_len
  (what kvfold's door asks);
- says `kvfold_rank: i` in its routing stats, beside Ray Serve LLM's own, so kvfold's
  RequestRouter sends rank i's requests to it.

Its Serve replica's gRPC server binds the node's address, not every interface
(kvfold.serving.serve_loopback), as kvfold's own deployments do.

A replica Serve restarts takes the same rank: its engine's sequence numbers start over,
and kvfold's rank sees a new incarnation (its old blocks leave the index).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.llm.deployment import LLMServer
from ray.serve.llm.ingress import OpenAiIngress

from kvfold.errors import DoorRefused
from kvfold.serving.forward import error_body, sse_error
from kvfold.serving.serve_llm_plan import LOOPBACK, PLAN_KEY, ServeLLMRanks
from kvfold.serving.serve_loopback import keep_replica_grpc_on_node_address

log = logging.getLogger("kvfold")

keep_replica_grpc_on_node_address()  # imported with the deployment, before its replica serves


class KVFoldLLMServer(LLMServer):
    # Ray Serve LLM's servers start in an async constructor (Serve awaits it)
    async def __init__(self, llm_config: Any, **kwargs: Any) -> None:  # type: ignore[misc]
        plan = ServeLLMRanks.from_dict(llm_config.experimental_configs[PLAN_KEY])
        self._kvfold_rank = int(serve.get_replica_context().rank.rank)
        ports = plan.of(self._kvfold_rank)
        llm_config = llm_config.model_copy(deep=True)
        llm_config.update_engine_kwargs(kv_events_config=plan.kv_events_config(self._kvfold_rank))
        self._kvfold_page: Any = None
        await super().__init__(llm_config, **kwargs)
        self._kvfold_page = await serve_numbers_page(ports.numbers, llm_config)

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = dict(await super().record_routing_stats())
        stats["kvfold_rank"] = self._kvfold_rank
        return stats


class KVFoldOpenAiIngress(OpenAiIngress):
    """Ray Serve LLM's OpenAI ingress, with three changes:
    - its replica's gRPC server binds the node's address, not every interface (this
      module's import);
    - a request kvfold's door refuses gets the door's answer, in OpenAI's error shape (429
      with Retry-After when its queue is full or its deadline passed, 400 when no engine
      can take it, 503 when no engine is known yet), not a 500;
    - a request whose replica dies: before anything reached the client, it is sent once
      more (kvfold's router places it anew; the dead replica's promise was freed when Serve
      saw its call end), and a second death is answered 502 `engine_failed`; after its
      stream began, the stream ends with an `engine_failed` error event naming the failure,
      where Ray Serve LLM's own ingress would cut it off with no word."""

    async def _process_llm_request(
        self, body: Any, call_method: str, raw_request: Any = None
    ) -> Any:
        from fastapi.responses import StreamingResponse

        for attempt in range(REPLICA_DEATH_TRIES):
            try:
                response = await super()._process_llm_request(body, call_method, raw_request)
            except DoorRefused as e:
                return refused_response(e)
            except RayActorError as e:  # its replica died before its first answer
                if attempt + 1 < REPLICA_DEATH_TRIES:
                    log.warning("kvfold: a replica died before answering; sent again: %s",
                                _first_line(e))  # fmt: skip
                    continue
                return engine_failed_response(e)
            if isinstance(response, StreamingResponse):
                response.body_iterator = ends_with_error_event(response.body_iterator)
            return response
        raise AssertionError("unreachable")  # pragma: no cover


REPLICA_DEATH_TRIES = 2  # a request is sent at most twice when its replica dies


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def engine_failed_message(e: BaseException) -> str:
    return f"the engine replica serving this request failed: {_first_line(e)}"


def engine_failed_response(e: BaseException) -> Any:
    from fastapi.responses import Response

    body = error_body(engine_failed_message(e), "engine_failed", 502)
    return Response(body, status_code=502, media_type="application/json")


async def ends_with_error_event(chunks: AsyncIterable[Any]) -> AsyncIterator[Any]:
    """The stream as it comes; if its replica dies part way, one last Server-Sent Event,
    `engine_failed`, that names the failure (its client would otherwise see the stream end
    with no [DONE] and no reason)."""
    try:
        async for chunk in chunks:
            yield chunk
    except RayActorError as e:
        yield sse_error(engine_failed_message(e), "engine_failed", 502)


def refused_response(e: DoorRefused) -> Any:
    from fastapi.responses import JSONResponse

    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    error = {"message": str(e), "type": "kvfold_refused", "code": e.http_status}
    return JSONResponse({"error": error}, status_code=e.http_status, headers=headers)


async def serve_numbers_page(port: int, llm_config: Any) -> Any:
    """/metrics (vLLM's Prometheus registry in this process) and /v1/models on
    127.0.0.1:`port`."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    registry = get_prometheus_registry()  # as vLLM's own /metrics: multiprocess where it is

    card = {
        "id": llm_config.model_id,
        "object": "model",
        "max_model_len": llm_config.engine_kwargs.get("max_model_len"),
    }

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def models(_: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps({"object": "list", "data": [card]}), content_type="application/json"
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, port).start()
    return runner


__all__ = [
    "KVFoldLLMServer",
    "KVFoldOpenAiIngress",
    "ends_with_error_event",
    "engine_failed_response",
    "refused_response",
    "serve_numbers_page",
]
