"""A few real vLLM engines started together on this machine, each publishing its KV events
to kvfold: for the front door's tests, `kvfold bench-serve` and the serving example. No
Ray. (A real fleet starts its engines its own way and gives kvfold their endpoints.)

    EngineFleet(settings, n)   start n engines at once, wait until each serves, stop them
      .endpoints               one EngineEndpoints per engine, in rank order, for launch()
      .urls                    their OpenAI base URLs, in the same order

Each engine's worker threads go to a core of their own, round robin over the machine's
cores (vLLM binds every engine to core 0 by default, where several starve each other).
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from kvfold.engines.endpoints import EngineEndpoints
from kvfold.engines.vllm_server import VLLMServer, VLLMServerSettings, free_loopback_port

TOPIC = "kv-events"


class EngineFleet:
    def __init__(self, settings: VLLMServerSettings, num_engines: int, topic: str = TOPIC) -> None:
        if type(num_engines) is not int or num_engines <= 0:
            raise ValueError(f"num_engines={num_engines!r}: allowed: an int > 0")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.servers: list[VLLMServer] = []
        self.endpoints: list[EngineEndpoints] = []
        for i in range(num_engines):
            events = f"tcp://127.0.0.1:{free_loopback_port()}"
            replay = f"tcp://127.0.0.1:{free_loopback_port()}"
            s = dataclasses.replace(
                settings,
                port=free_loopback_port(),
                events_endpoint=events,
                replay_endpoint=replay,
                topic=topic,
                omp_threads_bind=settings.omp_threads_bind or str(i % cores),
                log_path=None,
            )
            server = VLLMServer(s)
            self.servers.append(server)
            self.endpoints.append(
                EngineEndpoints(
                    events=events, replay=replay, metrics=server.base_url + "/metrics", topic=topic
                )
            )

    @property
    def urls(self) -> list[str]:
        return [s.base_url for s in self.servers]

    def start(self, timeout_s: float = 300.0) -> float:
        """Start every engine and wait until each serves; the seconds that took. On a
        failure every engine is stopped and the first error raised (with its log tail)."""
        for s in self.servers:
            if s.settings.port == 0 or s.port == 0:
                s.port = free_loopback_port()
            s.start()
        try:
            with ThreadPoolExecutor(len(self.servers)) as pool:
                waits: list[float] = list(pool.map(lambda s: s.wait_ready(timeout_s), self.servers))
        except BaseException:
            self.stop()
            raise
        return max(waits)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> EngineFleet:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ = ["EngineFleet"]
