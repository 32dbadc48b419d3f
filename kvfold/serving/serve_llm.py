"""kvfold inside a Ray Serve LLM application: a few lines turn a `build_openai_app`
deployment's replicas into kvfold engine ranks, routed and admitted by kvfold's door.

    plan = ServeLLMRanks.on_loopback(num_replicas)        # where each replica's rank reads
    kv = launch(n, n, engines=plan.endpoints, wait_fresh=False)
    start_door(FrontDoorSettings(engine_urls=plan.urls, model_dir=..., namespace=kv.namespace))
    config = with_kvfold(LLMConfig(...), plan, kv.namespace)   # the same LLMConfig, plus kvfold
    serve.run(build_openai_app({"llm_configs": [config],
                                "ingress_cls_config": kvfold_ingress()}))

What `with_kvfold` changes in the LLMConfig (and nothing else: the application is still
built by `build_openai_app` and serves the same OpenAI routes):
- `server_cls` = KVFoldLLMServer (kvfold.serving.serve_llm_server), Ray Serve LLM's own
  LLMServer with three additions: the replica with Serve rank i publishes its engine's KV
  events to kvfold rank i (on loopback), serves its engine's numbers page (vLLM's Prometheus
  series, and /v1/models) on loopback for that rank, and says `kvfold_rank: i` in its
  routing stats;
- `deployment_config["request_router_config"]` = kvfold's RequestRouter
  (kvfold.serving.request_router): the door decides where each request goes, and it waits in
  kvfold's queue until it fits;
- `experimental_configs["kvfold"]` = the plan, which every replica reads;
- `log_engine_metrics` = False: vLLM's own stat logger keeps its series in the replica's
  process, where the numbers page reads them at once (Ray's would send them to Ray's
  metrics agent, every 10 s by default); kvfold's Prometheus endpoint exports what the
  ranks read.

`kvfold_ingress()` keeps Ray Serve LLM's own ingress replicas on the node's address too
(Ray Serve 2.60 binds every replica's gRPC server on `[::]`; KVFoldLLMServer's replicas and
KVFoldOpenAiIngress's are kept on the node's address by kvfold.serving.serve_loopback).

Ray Serve LLM's own KVAwareRouter is plugged in the same two places (a server that
publishes KV events, a router named in request_router_config); unlike it, nothing here
binds beyond 127.0.0.1. One machine for now: a replica and its kvfold rank meet on loopback,
so the plan's ranks and the replicas must share a node (the embedded default).

`with_kvfold` imports Ray Serve LLM, which needs vLLM (kvfold.serving.serve_llm_server): it
runs where the replicas run (the engine virtualenv, `.venv-engine`). `ServeLLMRanks` needs neither.
"""

from __future__ import annotations

from typing import Any

from kvfold.serving.serve_llm_plan import PLAN_KEY, RankPorts, ServeLLMRanks

INGRESS_CLS = "kvfold.serving.serve_llm_server:KVFoldOpenAiIngress"


def with_kvfold(
    llm_config: Any,
    plan: ServeLLMRanks,
    namespace: str,
    *,
    model_dir: str | None = None,
    stats_period_s: float = 1.0,
) -> Any:
    """A copy of `llm_config` (a ray.serve.llm.LLMConfig) whose replicas are kvfold's
    ranks and whose requests kvfold's door routes and admits. `model_dir`: the tokenizer the
    door reads for text prompts (default: the model's source, when it is a directory)."""
    from kvfold.serving.request_router import kvfold_router_config

    config = llm_config.model_copy(deep=True)
    replicas = _fixed_replicas(config.deployment_config)
    if replicas is not None and replicas != len(plan.ports):
        raise ValueError(
            f"deployment_config: {replicas} replicas for a kvfold plan of {len(plan.ports)} "
            "ranks; allowed: as many replicas as ranks"
        )
    if model_dir is None:
        model_dir = config.model_loading_config.model_source
    from kvfold.serving.serve_llm_server import KVFoldLLMServer  # needs Ray Serve LLM, vLLM

    config.server_cls = KVFoldLLMServer
    config.deployment_config["request_router_config"] = kvfold_router_config(
        namespace, model_dir=model_dir, stats_period_s=stats_period_s
    )
    config.experimental_configs[PLAN_KEY] = plan.to_dict()
    # vLLM's own Prometheus series in each replica's process, where its numbers page reads
    # them (Ray's stat logger would send them to Ray's metrics agent instead, every 10 s)
    config.log_engine_metrics = False
    config.engine_kwargs["disable_log_stats"] = False
    return config


def kvfold_ingress() -> dict[str, Any]:
    """`build_openai_app`'s `ingress_cls_config`: Ray Serve LLM's own OpenAI ingress, kept off
    every interface (kvfold.serving.serve_llm_server.KVFoldOpenAiIngress). Ray Serve 2.60
    binds each replica's gRPC server on `[::]`, hard-coded; importing the class makes its
    replica bind the node's address instead (127.0.0.1 on the embedded default)."""
    return {"ingress_cls": INGRESS_CLS}


def _fixed_replicas(deployment: dict[str, Any]) -> int | None:
    if "num_replicas" in deployment and isinstance(deployment["num_replicas"], int):
        return int(deployment["num_replicas"])
    auto = deployment.get("autoscaling_config") or {}
    lo, hi = auto.get("min_replicas"), auto.get("max_replicas")
    if lo is not None and lo == hi:
        return int(lo)
    return None


__all__ = ["PLAN_KEY", "RankPorts", "ServeLLMRanks", "kvfold_ingress", "with_kvfold"]
