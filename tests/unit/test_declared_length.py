"""A placement made under an admission decision must declare how far it may grow.

Under GUARANTEED_NO_EVICT a ticketed placement promises prompt + max_new_tokens; an
omitted max_new_tokens used to mean 0, silently promising nothing past the prompt.
It is now a ValueError naming the argument, and nothing changes. Direct uses of a
cache (no ticket) keep working with it omitted: they declare the prompt alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfold.worker import PagedKVCache
from kvfold.worker.commitments import Policy, declared_new_tokens
from kvfold.worker.engine import as_engine_request
from kvfold.worker.rank_actor import RankWorker
from kvfold.workload.engine import SimEngine
from tests.unit.builders import make_cache, make_config, toks

MISSING = "max_new_tokens is required with policy 'guaranteed_no_evict' and a ticket"


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[RankWorker]:
    """A rank actor's class in process, bound to a 16-block cache. Its reporter never
    ticks (an hour apart) and `info` (which asks Ray for the node id) is stubbed: no Ray
    runs here."""
    monkeypatch.setattr(RankWorker, "info", lambda self: {})
    w = RankWorker(
        0, [0], None, namespace="unit", report_interval_s=3600.0, engine_factory=SimEngine
    )
    w.bind(make_config(num_blocks=16))
    yield w
    w.stop()


def test_the_rule_names_the_argument_what_was_given_and_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=f"{MISSING}.*got None; pass an int >= 0"):
        declared_new_tokens(None, Policy.GUARANTEED_NO_EVICT, ticketed=True)
    assert declared_new_tokens(0, Policy.GUARANTEED_NO_EVICT, ticketed=True) == 0
    assert declared_new_tokens(None, Policy.GUARANTEED_NO_EVICT, ticketed=False) == 0
    assert declared_new_tokens(None, Policy.MAX_UTILIZATION, ticketed=True) == 0
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
        declared_new_tokens(-1, Policy.MAX_UTILIZATION, ticketed=False)


def test_a_ticketed_placement_without_max_new_tokens_raises_and_changes_nothing(
    worker: RankWorker,
) -> None:
    cache = worker.cache
    assert cache is not None
    before = (cache.stats(), cache.cumulative(), worker.tickets.snapshot())
    with pytest.raises(ValueError, match=MISSING):
        worker.add_sequence("r1", toks(0, 12), ticket=("ctl-a", 1))  # the old code placed it
    assert not cache.has_sequence("r1")
    assert (cache.stats(), cache.cumulative(), worker.tickets.snapshot()) == before
    assert cache.num_refused == 0
    # declared, the same placement goes through and its ticket is taken in
    assert worker.add_sequence("r1", toks(0, 12), max_new_tokens=4, ticket=("ctl-a", 1))
    assert worker.tickets.snapshot() == {"ctl-a": 1}
    # its promise: ceil((12 + 4) / 4) = 4 blocks committed, 3 used
    g = cache.stats().total
    assert (g.num_blocks_committed, g.num_blocks_used) == (4, 3)


def test_without_a_ticket_or_under_max_utilization_it_may_be_omitted(worker: RankWorker) -> None:
    assert worker.add_sequence("plain", toks(0, 12))  # no ticket: the prompt alone
    assert worker.add_sequence(
        "mu", toks(100, 8), policy="max_utilization", ticket=("ctl-a", 2)
    )  # MAX_UTILIZATION promises one block of growth at most: nothing to declare
    assert worker.tickets.snapshot() == {"ctl-a": 2}


def test_a_ticketed_engine_admit_without_max_new_tokens_raises_and_changes_nothing(
    worker: RankWorker,
) -> None:
    cache = worker.cache
    assert cache is not None
    admit = ("r2", toks(0, 8), None, None, "guaranteed_no_evict", ("ctl-b", 7))
    with pytest.raises(ValueError, match=MISSING):
        as_engine_request(admit)
    with pytest.raises(ValueError, match=MISSING):  # the old code: a TypeError mid-step
        worker.engine_step([admit], report=False)
    assert not cache.has_sequence("r2") and worker.tickets.snapshot() == {}
    assert as_engine_request(("r3", toks(0, 8), 5, None)).max_new_tokens == 5


def test_the_readme_snippet_still_works() -> None:
    cache: PagedKVCache = make_cache()
    assert cache.add_sequence("a", list(range(12)))
    # declared end = the prompt: 12 tokens -> 3 blocks committed, 3 used
    g = cache.stats().total
    assert (g.num_blocks_committed, g.num_blocks_used) == (3, 3)
    cache.check_integrity()
