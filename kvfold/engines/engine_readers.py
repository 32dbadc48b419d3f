"""The threads that read an engine's KV events into its EngineIntake: ZMQ for vLLM and
SGLang, HTTP polling for TensorRT-LLM. No Ray; each reader owns its thread and sockets
from construction until stop().

    ZmqReader          a SUB socket bound on loopback (the engine's PUB connects); on a
                       gap, a DEALER asks the engine's replay ROUTER from the first
                       missing seq, and takes every answer up to the end marker; when
                       the stream has been quiet TAIL_PROBE_S, it asks from the next seq
                       expected, so a lost last batch (nothing after it shows a gap: the
                       first ones, sent before the subscription took) is found
    HttpEventsPoller   POST {events}/kv_cache_events every interval (each answer drains
                       the engine's event queue), once the intake can read pages

The SUB is polled from the moment it is bound: libzmq hands a newly connected PUB the
subscription only when the SUB's owner thread next calls into the socket, and the PUB
drops every message until then (kvfold.engines.vllm_server).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import zmq

from kvfold.engines.endpoints import EngineEndpoints
from kvfold.engines.engine_intake import EngineIntake
from kvfold.engines.vllm_wire import END_SEQ, replay_request

REPLAY_TIMEOUT_S = 2.0
TAIL_PROBE_S = 2.0  # of quiet on the live stream, between probes of the replay's tail
EVENTS_TIMEOUT_S = 2.0
POLL_MS = 50
MAX_PAGE_BYTES = 16 * 1024 * 1024
_END = END_SEQ.to_bytes(8, "big")


class ZmqReader:
    def __init__(self, endpoints: EngineEndpoints, intake: EngineIntake, name: str) -> None:
        self.endpoints = endpoints
        self.intake = intake
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, endpoints.topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.bind(endpoints.events)  # loopback (EngineEndpoints checks it)
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                if time.monotonic() - quiet_since >= TAIL_PROBE_S:
                    self._probe_tail()
                    quiet_since = time.monotonic()
                continue
            quiet_since = time.monotonic()
            while True:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                wanted = self.intake.take_live(frames, time.monotonic())
                if wanted is not None:
                    self._replay(wanted)

    def _replay(self, start_seq: int) -> None:
        """Ask the engine's replay socket for what was lost, from `start_seq` on."""
        answer = self._ask_replay(start_seq)
        if answer is None:
            self.intake.replay_failed(time.monotonic())
        else:
            self.intake.take_replay(answer, time.monotonic())

    def _probe_tail(self) -> None:
        """A quiet stream: ask the replay for anything from the next seq expected (no
        answer changes nothing)."""
        start = self.intake.tail_from()
        if start is None or self.endpoints.replay is None:
            return
        answer = self._ask_replay(start)
        if answer is not None:
            self.intake.take_replay(answer, time.monotonic())

    def _ask_replay(self, start_seq: int) -> list[list[bytes]] | None:
        """The replay's whole answer from `start_seq`, up to its end marker; None when
        there is no replay socket or it did not answer in time."""
        now = time.monotonic
        if self.endpoints.replay is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        answer: list[list[bytes]] = []
        try:
            dealer.connect(self.endpoints.replay)
            dealer.send_multipart(replay_request(start_seq))
            deadline = now() + REPLAY_TIMEOUT_S
            while now() < deadline:
                if not dealer.poll(int(max(0.0, deadline - now()) * 1000)):
                    break
                frames = dealer.recv_multipart()
                answer.append(frames)
                if len(frames) >= 3 and frames[-2] == _END:
                    break
        finally:
            dealer.close()
        return answer if answer and answer[-1][-2:-1] == [_END] else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sub.close(linger=0)
        self._ctx.term()


class HttpEventsPoller:
    """Owns its thread; `failures` and `error` say how the engine's endpoint answers."""

    def __init__(
        self, endpoints: EngineEndpoints, intake: EngineIntake, interval_s: float, name: str
    ) -> None:
        self.url = endpoints.events.rstrip("/") + "/kv_cache_events"
        self.intake = intake
        self.interval_s = interval_s
        self.pages = 0
        self.failures = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.intake.can_take_pages:
                self.poll()

    def poll(self) -> None:
        """One POST; its answer into the intake."""
        request = urllib.request.Request(self.url, data=b"", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=EVENTS_TIMEOUT_S) as answer:
                body: bytes = answer.read(MAX_PAGE_BYTES + 1)
        except (OSError, urllib.error.URLError, ValueError) as e:
            self.failures += 1
            self.error = f"{type(e).__name__}: {e}"[:300]
            return
        self.error = None
        if self.intake.take_page(body, time.monotonic()):
            self.pages += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=EVENTS_TIMEOUT_S + 1)


__all__ = ["HttpEventsPoller", "ZmqReader"]
