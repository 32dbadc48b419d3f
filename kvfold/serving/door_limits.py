"""Each engine's max_model_len, as the door learns it: asked of the engine (its /v1/models)
once kvfold's view shows the engine live, in a thread, never on a request's path; forgotten
when the engine stops being live, so that an engine restarted with another limit is asked
again. An engine down when the door starts is taken once it is up.

    EngineLimits(ask)        ask(url) -> the engine's max_model_len (raises ValueError)
      .learn(live_urls, on_learned)   ask every live engine not known yet (in the loop)
      .known(rank) / .least()         what is known; the least of them
    max_model_len_of(url)    the default ask: GET url/v1/models

vLLM, SGLang and trtllm-serve all serve /v1/models; vLLM's model card carries max_model_len.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import Callable, Mapping

log = logging.getLogger("kvfold")

ASK_TIMEOUT_S = 5.0  # an engine's /v1/models, asked for its max_model_len
ASK_RETRY_S = 1.0  # after a failed ask, the engine is not asked again for this long
WARN_EVERY = 30  # a failing engine's warning: its first failure, then every this many


def max_model_len_of(url: str, timeout_s: float = ASK_TIMEOUT_S) -> int:
    """The engine's max_model_len, from its /v1/models. Raises ValueError naming the
    engine when it does not answer one (a positive int)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout_s) as r:
            cards = json.loads(r.read())["data"]
        limit = int(cards[0]["max_model_len"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        # OSError: no answer (URLError, HTTPError, a timeout); the rest: not the card asked
        raise ValueError(
            f"engine {url}: /v1/models did not give a max_model_len ({e!r}); allowed: a "
            "running engine's OpenAI server"
        ) from e
    if limit <= 0:
        raise ValueError(f"engine {url}: /v1/models gave max_model_len={limit}; allowed: > 0")
    return limit


class EngineLimits:
    """Per engine rank, its max_model_len once known. One event loop owns it."""

    def __init__(self, ask: Callable[[str], int] = max_model_len_of) -> None:
        self._ask = ask
        self._known: dict[int, int] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}  # rank -> its ask, running or resting
        self.failures: dict[int, int] = {}  # per rank, asks that failed
        self.last_error: dict[int, str] = {}

    def known(self, rank: int) -> int | None:
        return self._known.get(rank)

    def least(self) -> int | None:
        """The least limit known (the door counts every request with it), or None."""
        return min(self._known.values(), default=None)

    def learn(self, live_urls: Mapping[int, str], on_learned: Callable[[], None]) -> None:
        """Forget every engine not in `live_urls` (rank -> URL of the engines live now);
        ask each live one not known yet, in a thread; `on_learned()` after each answer.
        Call it in the owning event loop."""
        for rank in [r for r in self._known if r not in live_urls]:
            del self._known[rank]
        for rank, url in live_urls.items():
            if rank not in self._known and rank not in self._tasks:
                task = asyncio.get_running_loop().create_task(self._learn(rank, url, on_learned))
                self._tasks[rank] = task  # held until done: a task is weakly referenced

    async def _learn(self, rank: int, url: str, on_learned: Callable[[], None]) -> None:
        try:
            try:
                limit = await asyncio.to_thread(self._ask, url)
            except ValueError as e:
                self.failures[rank] = self.failures.get(rank, 0) + 1
                self.last_error[rank] = str(e)
                if self.failures[rank] % WARN_EVERY == 1:
                    log.warning("kvfold door: engine %d: %s (%d failed asks)", rank, e,
                                self.failures[rank])  # fmt: skip
                await asyncio.sleep(ASK_RETRY_S)
                return
            others = {r: v for r, v in self._known.items() if v != limit}
            if others:
                log.warning("kvfold door: engine %d's max_model_len is %d, others' %s: the "
                            "door counts with the least", rank, limit, others)  # fmt: skip
            self._known[rank] = limit
            self.last_error.pop(rank, None)
            on_learned()
        finally:
            self._tasks.pop(rank, None)


__all__ = ["ASK_RETRY_S", "ASK_TIMEOUT_S", "EngineLimits", "max_model_len_of"]
