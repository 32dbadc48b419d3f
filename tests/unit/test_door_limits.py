"""How the door learns each engine's max_model_len (kvfold.serving.door_limits): only once
the engine is live, again after a failed ask, forgotten when the engine goes, and the
least of them is what the door counts with. The engines' /v1/models is a seam here; the
engine test starts a front door with a real engine down."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import kvfold.serving.door_limits as door_limits
from kvfold.serving.door_limits import EngineLimits, max_model_len_of


class Engines:
    """What each URL's /v1/models answers: a limit, or a ValueError while it is "down"."""

    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = limits
        self.down: set[str] = set()
        self.asked: list[str] = []

    def ask(self, url: str) -> int:
        self.asked.append(url)
        if url in self.down:
            raise ValueError(f"engine {url}: down")
        return self.limits[url]


async def settle(limits: EngineLimits) -> None:
    """Until no ask is running or resting."""
    while limits._tasks:
        await asyncio.gather(*limits._tasks.values())


def test_engines_are_asked_once_live_again_after_a_failure_and_forgotten_when_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(door_limits, "ASK_RETRY_S", 0.0)
    engines = Engines({"http://e0": 1024, "http://e1": 2048, "http://e2": 512})
    engines.down.add("http://e1")
    limits = EngineLimits(engines.ask)
    learned: list[int | None] = []

    async def run() -> None:
        def on_learned() -> None:
            learned.append(limits.least())

        live = {0: "http://e0", 1: "http://e1"}  # engine 2 is not live yet: not asked
        limits.learn(live, on_learned)
        limits.learn(live, on_learned)  # an ask already running is not asked twice
        await settle(limits)
        assert engines.asked == ["http://e0", "http://e1"]
        assert (limits.known(0), limits.known(1), limits.known(2)) == (1024, None, None)
        assert limits.failures == {1: 1} and "down" in limits.last_error[1]
        engines.down.clear()  # engine 1 comes up: asked again at the next view
        limits.learn(live, on_learned)
        await settle(limits)
        assert limits.known(1) == 2048 and 1 not in limits.last_error
        assert limits.least() == 1024
        limits.learn({1: "http://e1", 2: "http://e2"}, on_learned)  # 0 went, 2 came
        await settle(limits)
        assert (limits.known(0), limits.known(2), limits.least()) == (None, 512, 512)

    asyncio.run(run())
    assert learned == [1024, 1024, 512]  # after each answer, never after a failure


class Cards(BaseHTTPRequestHandler):
    body: bytes = b""

    def do_GET(self) -> None:  # http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("card", "match"),
    [
        ({"data": [{"id": "m", "max_model_len": 4096}]}, None),
        ({"data": [{"id": "m"}]}, r"did not give a max_model_len \(KeyError"),
        ({"data": [{"id": "m", "max_model_len": 0}]}, r"max_model_len=0; allowed: > 0"),
        ({"data": []}, r"did not give a max_model_len \(IndexError"),
    ],
)
def test_a_model_card_without_a_positive_limit_is_named(card: object, match: str | None) -> None:
    handler = type("One", (Cards,), {"body": json.dumps(card).encode()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        if match is None:
            assert max_model_len_of(url) == 4096
        else:
            with pytest.raises(ValueError, match=match) as e:
                max_model_len_of(url)
            assert url in str(e.value)
    finally:
        server.shutdown()
        server.server_close()
