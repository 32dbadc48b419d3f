"""Where each replica of a Ray Serve LLM application meets its kvfold rank, on loopback: the
plan that kvfold.serving.serve_llm puts in the LLMConfig and every replica reads
(kvfold.serving.serve_llm_server). Pure; no Ray, no vLLM.

    ServeLLMRanks.on_loopback(num_replicas)
      .endpoints   kvfold's ranks' EngineEndpoints, in replica-rank order (for launch)
      .urls        each replica's numbers page (for the door's engine_urls)
      .kv_events_config(rank)   the engine's KV events for Serve replica `rank`
      .to_dict() / from_dict()  as it travels in LLMConfig.experimental_configs
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvfold.engines.endpoints import EngineEndpoints

LOOPBACK = "127.0.0.1"
PLAN_KEY = "kvfold"


@dataclass(frozen=True)
class RankPorts:
    events: int  # kvfold's rank binds its SUB here; the replica's engine connects
    replay: int  # the engine's replay ROUTER binds here
    numbers: int  # the replica's numbers page (/metrics, /v1/models)


@dataclass(frozen=True)
class ServeLLMRanks:
    """Where each Serve replica rank's kvfold rank reads its engine, on loopback."""

    ports: tuple[RankPorts, ...]

    @classmethod
    def on_loopback(cls, num_replicas: int) -> ServeLLMRanks:
        from kvfold.engines.vllm_settings import free_loopback_port

        if type(num_replicas) is not int or num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas!r}: allowed: an int >= 1")
        return cls(
            tuple(
                RankPorts(free_loopback_port(), free_loopback_port(), free_loopback_port())
                for _ in range(num_replicas)
            )
        )

    @property
    def endpoints(self) -> list[EngineEndpoints]:
        return [
            EngineEndpoints(
                events=f"tcp://{LOOPBACK}:{p.events}",
                metrics=f"http://{LOOPBACK}:{p.numbers}/metrics",
                replay=f"tcp://{LOOPBACK}:{p.replay}",
            )
            for p in self.ports
        ]

    @property
    def urls(self) -> list[str]:
        """Each replica's numbers page: what the door asks for its max_model_len."""
        return [f"http://{LOOPBACK}:{p.numbers}" for p in self.ports]

    def to_dict(self) -> dict[str, Any]:
        return {"ports": [asdict(p) for p in self.ports]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeLLMRanks:
        try:
            return cls(tuple(RankPorts(**p) for p in data["ports"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"experimental_configs[{PLAN_KEY!r}]: not a kvfold plan: {e}") from e

    def kv_events_config(self, rank: int) -> dict[str, Any]:
        """The engine's KV events for Serve replica `rank`: to its kvfold rank, on loopback."""
        p = self.of(rank)
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{LOOPBACK}:{p.events}",  # connects: kvfold's rank binds
            "replay_endpoint": f"tcp://{LOOPBACK}:{p.replay}",
            "topic": "",
        }

    def of(self, rank: int) -> RankPorts:
        if not 0 <= rank < len(self.ports):
            raise ValueError(
                f"Serve replica rank {rank}: the kvfold plan has ranks 0..{len(self.ports) - 1}; "
                "allowed: as many replicas as the plan (min_replicas = max_replicas = ranks)"
            )
        return self.ports[rank]


__all__ = ["LOOPBACK", "PLAN_KEY", "RankPorts", "ServeLLMRanks"]
