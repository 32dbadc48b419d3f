"""kvfold's Ray Serve RequestRouter: engines already deployed as Serve replicas gain kvfold's
admission and routing by naming it in their deployment's RequestRouterConfig.

    KVFoldRequestRouter    choose_replicas asks the namespace's door actor where the request
                           goes (it waits there until it fits); on_request_completed frees it
    kvfold_router_config(namespace, ...)   the RequestRouterConfig to deploy with

The door (kvfold.serving.door_actor) must be running in that namespace: `start_door(settings)`
or `serve_front_door(settings)` starts it. Each replica must say which engine rank it fronts
in its routing stats (`record_routing_stats() -> {"kvfold_rank": i}`), as
kvfold.serving.engine_replica.EngineReplica does.

What the router reads of a request: the first argument of the handle call, or the second
when the first is a path string (EngineReplica.generate(path, body)), an OpenAI body with a
token-id `prompt` (a text prompt or chat needs `model_dir` for the tokenizer). Through
Serve's HTTP proxy the body is not readable at routing time (Ray Serve 2.60): route through
a deployment handle. A request the door refuses (queue full, its deadline passed, larger
than any engine) fails the handle call with DoorRefused, which says why.

Serve copies this module, by value, into every process that routes (RequestRouterConfig
registers it with cloudpickle), so a class defined here would be a different class there:
DoorRefused lives in kvfold.errors, and `except DoorRefused` catches it in any caller.
"""

import logging
import uuid
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvfold.errors import DoorRefused  # defined apart: Serve pickles this module by value
from kvfold.serving.door_actor import get_door
from kvfold.serving.door_answers import Admitted, NotAdmitted
from kvfold.serving.openai_body import BadRequest, OpenAIRequest, parse_chat, parse_completion

log = logging.getLogger("kvfold")


class KVFoldRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._namespace: str = kwargs["namespace"]
        self._model_dir: str | None = kwargs.get("model_dir")
        self._tokenizer: Any = None
        self._door: Any = None
        self._admitted: dict[str, tuple[str, Admitted]] = {}  # Serve's id -> door's id, where
        self.refused = 0

    def _the_door(self) -> Any:
        if self._door is None:
            self._door = get_door(self._namespace)
        return self._door

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None:  # Serve probing: any replica will do
            return [candidate_replicas]
        key = pending_request.metadata.internal_request_id
        held = self._admitted.get(key)
        if pending_request.future.done():  # refused, or its caller went away: route no more
            if held is not None:
                self.on_request_completed(None, key)
            return [candidate_replicas]  # Serve sees the future done and stops asking
        if held is None:
            try:
                req = _request_of(pending_request)
                ids = self._ids(req)
            except BadRequest as e:
                bad = DoorRefused(str(e), http_status=400)
                return self._refuse(pending_request, bad, candidate_replicas)
            rid = f"router-{uuid.uuid4().hex}"
            try:
                door = self._the_door()
            except ValueError:
                no_door = DoorRefused(
                    f"no kvfold door in namespace {self._namespace!r}: start one with "
                    "kvfold.serving.door_actor.start_door(settings)"
                )
                return self._refuse(pending_request, no_door, candidate_replicas)
            admitted = await door.admit.remote(rid, ids, req.max_tokens, req.n)
            if isinstance(admitted, NotAdmitted) and admitted.reason == "engines_unknown":
                return _later(pending_request)  # the door has not seen the engines yet
            if isinstance(admitted, NotAdmitted):
                refused = DoorRefused(admitted.message, admitted.http_status,
                                      admitted.retry_after_s)  # fmt: skip
                return self._refuse(pending_request, refused, candidate_replicas)
            held = self._admitted[key] = (rid, admitted)
        rank = held[1].rank
        chosen = [r for r in candidate_replicas if r.routing_stats.get("kvfold_rank") == rank]
        if chosen:
            return [chosen]
        # its rank has no replica now (not seen yet, or it died): the promise is given back
        # and the request placed anew after a backoff, by then the door may know better
        self.on_request_completed(None, key)
        return _later(pending_request)

    def _refuse(
        self, pending: PendingRequest, error: Exception, candidates: list[RunningReplica]
    ) -> list[list[RunningReplica]]:
        """Fail the handle call (Serve's router only logs what choose_replicas raises).
        Candidates are returned so that Serve looks again, sees the future done and stops:
        an empty answer without backoff has it ask again at once, forever."""
        self.refused += 1
        if not pending.future.done():
            pending.future.set_exception(error)
        return [candidates] if candidates else []

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        held = self._admitted.pop(internal_request_id, None)
        if held is not None:
            self._the_door().release.remote(held[0])

    def _ids(self, req: OpenAIRequest) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if self._model_dir is None:
            raise BadRequest(
                "prompt", "a text prompt or chat needs the router's model_dir (tokenizer)"
            )
        if self._tokenizer is None:
            from kvfold.serving.prompt_tokens import PromptTokenizer

            self._tokenizer = PromptTokenizer(self._model_dir)
        ids: list[int] = self._tokenizer.ids(req)
        return ids


def _later(pending: PendingRequest) -> list[list[RunningReplica]]:
    """Nothing yet: Serve backs off before asking again (without should_backoff it asks
    again at once, in a loop that holds its event loop)."""
    pending.routing_context.should_backoff = True
    return []


def _request_of(pending: PendingRequest) -> OpenAIRequest:
    args = list(pending.args)
    path = "/v1/completions"
    if args and isinstance(args[0], str):
        path = args.pop(0)
    body: Any = args[0] if args else pending.kwargs.get("body")
    if hasattr(body, "model_dump"):  # Ray Serve LLM's ingress passes its pydantic request
        body = body.model_dump(exclude_unset=True)
    if path.endswith("/chat/completions"):
        return parse_chat(body)
    return parse_completion(body)


def kvfold_router_config(
    namespace: str, model_dir: str | None = None, stats_period_s: float = 1.0
) -> RequestRouterConfig:
    """The RequestRouterConfig that puts kvfold's router in front of a deployment's replicas
    (the door in `namespace` decides; `model_dir`: the tokenizer, for text prompts)."""
    options: dict[str, Any] = {  # checked by the config's own (pydantic) validation
        "request_router_class": KVFoldRequestRouter,
        "request_router_kwargs": {"namespace": namespace, "model_dir": model_dir},
        "request_routing_stats_period_s": stats_period_s,
    }
    return RequestRouterConfig(**options)


__all__ = ["DoorRefused", "KVFoldRequestRouter", "kvfold_router_config"]
