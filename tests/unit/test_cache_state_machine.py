"""Random add / append / status / free / commit with check_integrity() after every step."""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfold.stats import BlockDeltas, SequenceStatus
from kvfold.worker import PagedKVCache
from tests.unit.builders import make_config

WINDOW_SETS = [(None,), (None, 8), (6,), (None, 5, 12)]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PagedKVCache | None = None
        self.next_id = 0
        self.committed: dict[object, BlockDeltas] = {}

    @precondition(lambda self: self.cache is None)
    @rule(
        windows=st.sampled_from(WINDOW_SETS),
        num_blocks=st.integers(3, 12),
        reuse=st.booleans(),
        block=st.sampled_from([1, 2, 4]),
    )
    def build(self, windows, num_blocks, reuse, block) -> None:  # type: ignore[no-untyped-def]
        cfg = make_config(
            num_blocks,
            windows=windows,
            tokens_per_block=block,
            reuse=reuse,
            num_layers=len(windows),
            head_dim=2,
            num_kv_heads=1,
        )
        self.cache = PagedKVCache(cfg)
        self.committed = {w: BlockDeltas() for w in windows}

    @precondition(lambda self: self.cache is not None)
    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        extra=st.lists(st.integers(0, 3), max_size=10),
        salt=st.sampled_from([None, "s"]),
    )
    def add(self, prefix, extra, salt) -> None:  # type: ignore[no-untyped-def]
        tokens = prefix + extra
        if not tokens:
            return
        sid = self.next_id
        self.next_id += 1
        before = self.cache.stats()  # type: ignore[union-attr]
        ok = self.cache.add_sequence(sid, tokens, salt=salt)  # type: ignore[union-attr]
        if not ok:
            assert self.cache.stats() == before  # type: ignore[union-attr]

    @precondition(lambda self: self.cache is not None and self._running())
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n) -> None:  # type: ignore[no-untyped-def]
        sid = data.draw(st.sampled_from(self._running()))
        before = self.cache.stats()  # type: ignore[union-attr]
        ok = self.cache.append_tokens(sid, [7] * n)  # type: ignore[union-attr]
        if not ok:
            assert self.cache.stats() == before  # type: ignore[union-attr]

    @precondition(lambda self: self.cache is not None and self._all())
    @rule(data=st.data(), status=st.sampled_from(list(SequenceStatus)))
    def status(self, data, status) -> None:  # type: ignore[no-untyped-def]
        sid = data.draw(st.sampled_from(self._all()))
        # a running status on a sequence without blocks is refused and changes nothing
        with contextlib.suppress(ValueError):
            self.cache.set_status(sid, status)  # type: ignore[union-attr]

    @precondition(lambda self: self.cache is not None and self._all())
    @rule(data=st.data())
    def free(self, data) -> None:  # type: ignore[no-untyped-def]
        self.cache.free_sequence(data.draw(st.sampled_from(self._all())))  # type: ignore[union-attr]

    @precondition(lambda self: self.cache is not None)
    @rule()
    def commit(self) -> None:
        it = self.cache.commit_iteration()  # type: ignore[union-attr]
        for w, d in it.windows.items():
            self.committed[w] = self.committed[w] + d

    def _running(self) -> list[object]:
        c = self.cache
        return [s for s in c.sequence_ids() if c.status_of(s).value in (1, 2, 3, 4)]  # type: ignore[union-attr]

    def _all(self) -> list[object]:
        return self.cache.sequence_ids()  # type: ignore[union-attr]

    @invariant()
    def integrity(self) -> None:
        if self.cache is None:
            return
        self.cache.check_integrity()
        cum = self.cache.cumulative()
        pending = self.cache.commit_iteration()
        for w in self.committed:
            self.committed[w] = self.committed[w] + pending.windows[w]
            assert self.committed[w] == cum.windows[w]  # sum of committed deltas
        for g in self.cache.stats().windows.values():
            assert g.num_blocks_used + g.num_blocks_cached <= g.num_blocks_total

    def teardown(self) -> None:
        if self.cache is None:
            return
        for sid in self.cache.sequence_ids():
            self.cache.free_sequence(sid)
        assert self.cache.stats().total.num_blocks_used == 0
        self.cache.check_integrity()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
