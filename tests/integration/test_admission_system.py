"""Model-based, through the running system: controllers in their own processes admit
into real rank actors whose reports reach them through the node and cluster actors.

A seeded random sequence of operations per run: decisions by a random controller,
placements on the chosen rank (now, or later in that controller's order), growth in
random steps up to the declared length, releases, and pauses from milliseconds to
several times `dead_after_s`. Runs: 1 and 4 controllers, both policies, a full
attention pool and a sliding window, prompts that share prefixes. What must hold:

- GUARANTEED_NO_EVICT: every placed request reaches its full declared length; with
  one controller every admitted request is placed (the ranks' refusal counters stay 0);
- MAX_UTILIZATION: every placed request gets its first block of growth;
- always: the ranks' reported committed blocks equal an independent recount of what
  the live requests hold and may still need, and never exceed total; what the test saw
  refused is what the ranks counted and reported.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import pytest

from kvfold.admission import AdmissionRequest, Outcome, Policy, new_controller_id
from tests.integration.conftest import running
from tests.unit.builders import make_config

pytestmark = pytest.mark.integration

B, W = 16, 64
CACHE = make_config(
    {None: 64, W: 40},
    windows=(None, W),
    tokens_per_block=B,
    num_kv_heads=1,
    head_dim=4,
    dtype="float16",
    device="auto",
)
REPORT_S, STALE_S, DEAD_S = 0.05, 0.15, 0.4
PAUSES_S = (0.001, 0.01, 0.1, 0.3, 2.5 * DEAD_S)  # up to several times dead_after_s


@pytest.fixture(scope="module")
def kv():  # type: ignore[no-untyped-def]
    with running(
        2,
        2,
        3,
        cache=CACHE,
        report_interval_s=REPORT_S,
        stale_after_s=STALE_S,
        dead_after_s=DEAD_S,
    ) as (_, deployment):
        deployment.wait_until_fresh()
        yield deployment


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def window_blocks(length: int) -> int:
    """Blocks a W-token window holds at `length` tokens (written again, independently)."""
    return ceil_div(length, B) - max(0, length - W) // B


@dataclass
class Live:
    rank: int
    tokens: int
    end: int  # prompt + max new tokens: how far the test grows it
    promised: int  # the declared length: the end, or the prompt plus one block


def expected_committed(live: list[Live]) -> tuple[int, int]:
    """(full-attention blocks still to take, sliding-window peak blocks), summed: what a
    sequence holds and may still need to reach its declared length (or its length, past it)."""
    future = sum(ceil_div(max(s.promised, s.tokens), B) - ceil_div(s.tokens, B) for s in live)
    peak = sum(
        max(window_blocks(n) for n in range(s.tokens, max(s.promised, s.tokens) + 1)) for s in live
    )
    return future, peak


class Run:
    def __init__(self, kv: Any, controllers: list[Any], policy: Policy, seed: int) -> None:
        self.kv, self.ctls, self.policy = kv, controllers, policy
        self.rnd = random.Random(seed)
        self.pending: list[deque[tuple[str, list[int], int, Any]]] = [deque() for _ in controllers]
        self.live: dict[str, Live] = {}
        self.next_id = 0
        self.placed = self.refused = self.admitted = 0
        self.refused_before = self.rank_refusals()

    def rank_refusals(self) -> int:
        return sum(self.kv.rank(r).info()["refused"] for r in range(3))

    def decide(self) -> None:
        import ray

        k = self.rnd.randrange(len(self.ctls))
        self.next_id += 1
        rid = f"s{self.next_id}-{self.rnd.getrandbits(20)}"
        prompt_len, max_new = self.rnd.randint(1, 300), self.rnd.randint(0, 300)
        family = self.rnd.randrange(3)
        tokens = [family * 10_000 + i for i in range(min(prompt_len, 40))]
        tokens += [self.next_id * 1000 + i for i in range(prompt_len - len(tokens))]
        d = ray.get(self.ctls[k].decide.remote(AdmissionRequest(rid, prompt_len, max_new)))
        if d.outcome is Outcome.ADMIT:
            self.admitted += 1
            self.pending[k].append((rid, tokens, max_new, d))
            if self.rnd.random() < 0.7:
                self.deliver(k)

    def deliver(self, k: int) -> None:
        if not self.pending[k]:
            return
        rid, tokens, max_new, d = self.pending[k].popleft()
        ok = self.kv.rank(d.rank).add_sequence(
            rid,
            tokens,
            report=self.rnd.random() < 0.3,
            max_new_tokens=max_new,
            policy=d.policy,
            ticket=d.ticket,
        )
        if len(self.ctls) == 1 and self.policy is Policy.GUARANTEED_NO_EVICT:
            assert ok, f"rank {d.rank} refused {rid}: one controller over-committed it"
        if not ok:
            self.refused += 1
            return
        self.placed += 1
        end = len(tokens) + max_new
        promised = (
            end if self.policy is Policy.GUARANTEED_NO_EVICT else len(tokens) + min(B, max_new)
        )
        self.live[rid] = Live(d.rank, len(tokens), end, promised)

    def grow(self) -> None:
        if not self.live:
            return
        rid = self.rnd.choice(sorted(self.live))
        s = self.live[rid]
        n = min(self.rnd.randint(1, 60), s.end - s.tokens)
        if n <= 0:
            return
        ok = self.kv.rank(s.rank).append_tokens(rid, list(range(n)), report=self.rnd.random() < 0.2)
        if s.tokens + n <= s.promised:
            assert ok, f"{rid} refused growth {s.tokens} -> {s.tokens + n} (promised {s.promised})"
        if ok:
            s.tokens += n

    def release(self) -> None:
        if self.live:
            rid = self.rnd.choice(sorted(self.live))
            self.kv.rank(self.live.pop(rid).rank).free_sequence(rid)

    def pause(self) -> None:
        time.sleep(self.rnd.choice(PAUSES_S))  # a scheduler that looks away: the operation itself

    def check(self) -> None:
        """The ranks' reported committed blocks against an independent recount."""
        view = settled_view(self.kv)
        for r in range(3):
            summary, _ = view.rank_summary(r)
            full, window = summary.gpu[None], summary.gpu[W]
            future, peak = expected_committed([s for s in self.live.values() if s.rank == r])
            assert full.num_blocks_committed - full.num_blocks_used == future, (r, full)
            assert window.num_blocks_committed == peak, (r, window)
            for g in (full, window):
                assert g.num_blocks_used <= g.num_blocks_committed <= g.num_blocks_total
            self.kv.rank(r).check_integrity()

    def play(self, steps: int) -> None:
        ops = [self.decide] * 5 + [self.grow] * 5 + [self.release] * 2 + [self.pause]
        for i in range(steps):
            if self.rnd.random() < 0.15:
                self.deliver(self.rnd.randrange(len(self.ctls)))
            self.rnd.choice(ops)()
            if i % 40 == 39:
                self.check()
        for k in range(len(self.ctls)):
            while self.pending[k]:
                self.deliver(k)
        for rid in sorted(self.live):  # every placed request runs to what it was promised
            s = self.live[rid]
            while s.tokens < s.promised:
                n = min(60, s.promised - s.tokens)
                assert self.kv.rank(s.rank).append_tokens(rid, list(range(n))), rid
                s.tokens += n
        self.check()
        for rid in sorted(self.live):
            self.kv.rank(self.live.pop(rid).rank).free_sequence(rid)


def settled_view(kv: Any) -> Any:
    """The first view holding every rank's report sent after this call began."""
    sent = {r: (kv.rank(r).report_now(), kv.rank(r).info()["seq"])[1] for r in range(3)}
    deadline = time.monotonic() + 30
    view = kv.view()
    while time.monotonic() < deadline:
        seen = [view.rank_summary(r) for r in range(3)]
        if all(s is not None and s[0].report_seq >= sent[r] for r, s in enumerate(seen)):
            return view
        view = kv.wait_for_version(view.version, timeout_s=1.0) or view
    raise AssertionError(f"no view with the reports {sent} within 30 s")


@pytest.mark.parametrize("num_controllers", [1, 4])
@pytest.mark.parametrize("policy", [Policy.GUARANTEED_NO_EVICT, Policy.MAX_UTILIZATION])
def test_admissions_keep_their_promises_through_the_running_system(
    kv, num_controllers: int, policy: Policy
) -> None:  # type: ignore[no-untyped-def]
    import ray

    from kvfold.replay.scheduler_actor import start_controllers

    ids = [new_controller_id(f"model-{i}") for i in range(num_controllers)]  # new each run
    ctls = start_controllers(
        kv.settings.namespace,
        num_controllers,
        policy,
        router="precise_prefix",
        sent_ttl_s=0.5,
        controller_ids=ids,
        refresh_interval_s=0.01,
    )
    try:
        assert ray.get([c.controller_id.remote() for c in ctls]) == ids
        counts = ray.get([c.counts.remote() for c in ctls])
        assert {(c["router"], c["sent_ttl_s"]) for c in counts} == {("precise_prefix", 0.5)}
        run = Run(kv, ctls, policy, seed=1000 * num_controllers + len(policy.value))
        run.play(steps=120)
    finally:
        for c in ctls:
            ray.kill(c)
    assert run.placed >= 10, f"too few placements to mean anything: {run.placed}"
    # what the test saw refused is what the ranks counted (and reported in their gauges)
    assert run.rank_refusals() - run.refused_before == run.refused
    if num_controllers == 1 and policy is Policy.GUARANTEED_NO_EVICT:
        assert run.refused == 0
        assert sum(r.num_refused for n in settled_view(kv).nodes for r in n.ranks) == 0
