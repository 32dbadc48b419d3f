"""One engine's KV events to two readers: kvfold's rank and a router that reads them too
(vllm-router's kv_aware, in `kvfold bench-serve`).

vLLM's publisher *connects* its PUB to a `tcp://127.0.0.1:P` endpoint, and vllm-router's
subscriber connects too, so nothing would listen between them. The relay binds what each
side expects, on loopback only:

    engine PUB  --connect-->  SUB  bind   inlet      (the engine's events_endpoint)
                              PUB  connect to_kvfold (kvfold's rank binds its SUB there)
                              PUB  bind   outlet     (the router's SUB connects)

Every message (topic, seq, payload) is passed on whole, in order, to both. The relay is
started before the engines (a SUB must be bound and polled before a PUB connecting to it
gets the subscription: kvfold.engines.vllm_server). Batches kvfold misses while its SUB is
not yet connected are recovered from the engine's replay, as always.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvfold.engines.vllm_settings import LOOPBACK, free_loopback_port


@dataclass(frozen=True, slots=True)
class RelayPorts:
    inlet: str  # the engine's events_endpoint
    to_kvfold: str  # kvfold's EngineEndpoints.events
    outlet: str  # the router's event source


class EventRelay:
    def __init__(self, inlets: Sequence[str]) -> None:
        self.ports = [
            RelayPorts(
                inlet,
                f"tcp://{LOOPBACK}:{free_loopback_port()}",
                f"tcp://{LOOPBACK}:{free_loopback_port()}",
            )
            for inlet in inlets
        ]
        self.relayed = [0] * len(self.ports)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvfold-event-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        import zmq

        ctx: Any = zmq.Context.instance()
        socks = []
        try:
            for p in self.ports:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.bind(p.inlet)
                fwd = ctx.socket(zmq.PUB)
                fwd.connect(p.to_kvfold)
                out = ctx.socket(zmq.PUB)
                out.bind(p.outlet)
                socks.append((sub, fwd, out))
        except BaseException as e:  # a port taken: start() raises it
            self._error = e
            self._ready.set()
            for trio in socks:
                for s in trio:
                    s.close(0)
            return
        self._ready.set()
        poller = zmq.Poller()
        for sub, _, _ in socks:
            poller.register(sub, zmq.POLLIN)
        index = {id(sub): i for i, (sub, _, _) in enumerate(socks)}
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    i = index[id(sock)]
                    sub, fwd, out = socks[i]
                    while True:
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        fwd.send_multipart(frames)
                        out.send_multipart(frames)
                        self.relayed[i] += 1
        finally:
            for trio in socks:
                for s in trio:
                    s.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


__all__ = ["EventRelay", "RelayPorts"]
