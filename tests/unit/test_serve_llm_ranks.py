"""The plan that makes Ray Serve LLM's replicas kvfold's ranks (kvfold.serving.serve_llm):
every port on loopback, each replica rank its own, read back as written, and a replica rank
the plan does not hold refused by name."""

import pytest

from kvfold.serving.serve_llm_plan import ServeLLMRanks


def test_a_plan_gives_each_replica_its_own_loopback_ports() -> None:
    plan = ServeLLMRanks.on_loopback(3)
    ports = [port for p in plan.ports for port in (p.events, p.replay, p.numbers)]
    assert len(set(ports)) == 9
    for e in plan.endpoints:
        assert e.events.startswith("tcp://127.0.0.1:") and e.metrics.startswith("http://127.0.0.1:")
        assert e.replay is not None and e.replay.startswith("tcp://127.0.0.1:")
    assert plan.urls == [e.metrics.removesuffix("/metrics") for e in plan.endpoints]
    assert ServeLLMRanks.from_dict(plan.to_dict()) == plan
    events = plan.kv_events_config(1)
    assert events["endpoint"] == plan.endpoints[1].events and events["topic"] == ""
    assert events["replay_endpoint"] == plan.endpoints[1].replay


def test_a_bad_plan_or_rank_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="num_replicas=0"):
        ServeLLMRanks.on_loopback(0)
    plan = ServeLLMRanks.on_loopback(2)
    with pytest.raises(ValueError, match="Serve replica rank 2"):
        plan.kv_events_config(2)
    with pytest.raises(ValueError, match="not a kvfold plan"):
        ServeLLMRanks.from_dict({"ports": [{"events": 1}]})
