"""with_kvfold on a Ray Serve LLM LLMConfig, without starting anything: what it changes (the
server class, the router, the plan, vLLM's metrics kept in the replica), what it leaves
alone (the user's config is not modified), and a replica count that does not match the
plan refused by name."""

from __future__ import annotations

import pathlib

import pytest
from ray.serve.llm import LLMConfig

from kvfold.serving.serve_llm import PLAN_KEY, ServeLLMRanks, kvfold_ingress, with_kvfold

MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "models" / "small-llama")


def _config(replicas: int) -> LLMConfig:
    return LLMConfig(
        model_loading_config={"model_id": "tiny-llama", "model_source": MODEL},
        engine_kwargs={"block_size": 32, "max_model_len": 1024},
        deployment_config={
            "autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}
        },
        accelerator_config={"kind": "cpu"},
    )


def test_with_kvfold_changes_the_server_the_router_and_the_metrics_only() -> None:
    from kvfold.serving.request_router import KVFoldRequestRouter
    from kvfold.serving.serve_llm_server import KVFoldLLMServer, KVFoldOpenAiIngress

    plan = ServeLLMRanks.on_loopback(2)
    mine = _config(2)
    config = with_kvfold(mine, plan, "ns-1")
    assert config.server_cls is KVFoldLLMServer
    router = config.deployment_config["request_router_config"]
    assert router.request_router_class.endswith(KVFoldRequestRouter.__name__)
    assert router.request_router_kwargs == {"namespace": "ns-1", "model_dir": MODEL}
    assert ServeLLMRanks.from_dict(config.experimental_configs[PLAN_KEY]) == plan
    assert config.log_engine_metrics is False and config.engine_kwargs["disable_log_stats"] is False
    assert config.engine_kwargs["block_size"] == 32
    # the user's own config is left as it was
    assert mine.server_cls is None and "request_router_config" not in mine.deployment_config
    assert PLAN_KEY not in mine.experimental_configs and mine.log_engine_metrics is True
    ingress = kvfold_ingress()["ingress_cls"]
    assert ingress.endswith(":" + KVFoldOpenAiIngress.__name__)


def test_a_replica_count_unlike_the_plan_is_refused() -> None:
    with pytest.raises(ValueError, match="3 replicas for a kvfold plan of 2 ranks"):
        with_kvfold(_config(3), ServeLLMRanks.on_loopback(2), "ns-1")
