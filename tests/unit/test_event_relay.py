"""The KV-event relay of `kvfold bench-serve`: a publisher that connects (as vLLM's does)
reaches both readers, kvfold's bound SUB and a router's connecting SUB, every message
whole and in order. Real ZMQ sockets on loopback."""

from __future__ import annotations

import time

import zmq

from kvfold.bench.event_relay import EventRelay
from kvfold.engines.vllm_settings import free_loopback_port


def test_every_batch_reaches_kvfold_and_the_router_whole_and_in_order() -> None:
    ctx = zmq.Context.instance()
    inlet = f"tcp://127.0.0.1:{free_loopback_port()}"
    relay = EventRelay([inlet])
    relay.start()
    ports = relay.ports[0]
    kvfold = ctx.socket(zmq.SUB)  # kvfold's rank binds its SUB
    kvfold.setsockopt(zmq.SUBSCRIBE, b"")
    kvfold.bind(ports.to_kvfold)
    router = ctx.socket(zmq.SUB)  # the router connects
    router.setsockopt(zmq.SUBSCRIBE, b"")
    router.connect(ports.outlet)
    engine = ctx.socket(zmq.PUB)  # the engine connects its PUB
    engine.connect(inlet)
    try:
        got: dict[str, list[list[bytes]]] = {"kvfold": [], "router": []}
        # a PUB drops what it sends before a subscription reaches it: ping until both hear
        deadline = time.monotonic() + 30
        while not (got["kvfold"] and got["router"]):
            assert time.monotonic() < deadline, got
            engine.send_multipart([b"kv-events", b"ping", b""])
            for name, sock in (("kvfold", kvfold), ("router", router)):
                if sock.poll(50):
                    got[name].append(sock.recv_multipart())
        for sock in (kvfold, router):
            while sock.poll(200):
                sock.recv_multipart()
        batches = [[b"kv-events", i.to_bytes(8, "big"), bytes([i]) * i] for i in range(50)]
        for b in batches:
            engine.send_multipart(b)
        for sock in (kvfold, router):
            seen = []
            while len(seen) < len(batches):
                assert sock.poll(10_000), seen
                seen.append(sock.recv_multipart())
            assert seen == batches
    finally:
        relay.stop()
        for s in (kvfold, router, engine):
            s.close(0)


def test_an_inlet_that_is_taken_is_refused_at_start() -> None:
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.SUB)
    port = free_loopback_port()
    taken.bind(f"tcp://127.0.0.1:{port}")
    try:
        relay = EventRelay([f"tcp://127.0.0.1:{port}"])
        try:
            relay.start()
        except zmq.ZMQError as e:
            assert "in use" in str(e).lower()
        else:
            raise AssertionError("a taken inlet was bound")
        finally:
            relay.stop()
    finally:
        taken.close(0)
