"""Random add / append / status / free / commit on two ranks sharing a host tier.

The model an engine would keep is the oracle:
- K/V of token p is a pure function of (salt, tokens[0..p], layer): what a model
  computes. After every operation the engine writes only what the cache left it to
  compute; every held block must then gather to exactly the model's values. A block
  reused from the prefix cache or onboarded from the host tier with the wrong bytes
  shows at once.
- The host tier copies what it is given when it is given it (as a tier in another
  process sees it), and fails at random: an add then completes as a miss or returns
  False, never half-way.
- Counters are checked per operation against their definitions (DESIGN 3.3), and
  committed deltas summed must equal the cumulative counts. alloc_new is checked
  against an oracle of its own: per pool, the blocks that have ever held a token
  (every block a table has held); TensorRT-LLM counts a taken block as new only
  when it never did (and every take as new when prefix reuse is off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfold.stats import VALID_STATUSES, BlockDeltas, SequenceStatus
from kvfold.worker import PagedKVCache
from tests.unit.builders import make_config

WINDOW_SETS = [(None,), (None, 8), (6,), (None, 5, 12)]
HOST_FAILS = st.integers(0, 5).map(lambda x: x == 0)  # the tier fails one call in six


class CopyingHostTier:
    """A host tier that copies every payload when it is offered (LRU, bounded) and can be
    told to fail; records what it served so the test can compare it with the model."""

    def __init__(self, num_blocks: int, expected: Callable[[object, bytes], bytes]) -> None:
        self.num_blocks = num_blocks
        self.blocks: dict[tuple[object, bytes], bytes] = {}
        self.failing = False
        self.expected = expected  # the model's bytes of a block, by (window, key)
        self.wrong: list[str] = []  # keys offloaded with bytes other than the model's

    def fetch(self, window: object, keys: list[bytes]) -> list[np.ndarray]:
        if self.failing:
            raise ConnectionError("host tier down")
        out = []
        for k in keys:
            data = self.blocks.get((window, k))
            if data is None:
                break
            self.blocks[(window, k)] = self.blocks.pop((window, k))  # LRU touch
            out.append(np.frombuffer(data, dtype=np.uint8).copy())
        return out

    def offload_many(self, items: list[tuple[object, bytes, np.ndarray]]) -> list[bool]:
        if self.failing:
            raise TimeoutError("host tier timed out")
        stored = []
        for w, k, payload in items:
            if (w, k) in self.blocks:
                stored.append(False)
                continue
            if len(self.blocks) >= self.num_blocks:
                self.blocks.pop(next(iter(self.blocks)))
            self.blocks[(w, k)] = payload.tobytes()  # a copy, taken now
            if self.blocks[(w, k)] != self.expected(w, k):
                self.wrong.append(k.hex()[:8])  # checked by an invariant (raising here is a
                # tier failure, which the cache is right to absorb)
            stored.append(True)
        return stored


def kv_value(salt: str | None, tokens: tuple[int, ...], layer: int) -> float:
    """The model's K for the last token of `tokens` (V is its negation); exact in float32."""
    return float(hash((salt, tokens, layer)) % 1_000_003)


class CacheMachine(RuleBasedStateMachine):
    DEVICE = "cpu"  # tests/gpu runs the same machine on CUDA storage

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[PagedKVCache] = []
        self.host: CopyingHostTier | None = None
        self.next_id = 0
        self.seqs: dict[int, tuple[int, str | None, list[int]]] = {}  # id -> (cache, salt, tokens)
        self.committed: list[dict[object, BlockDeltas]] = []
        self.key_to_prefix: dict[bytes, tuple[str | None, tuple[int, ...]]] = {}
        # per cache, per window: every block some sequence's table has held (the oracle
        # of "has held tokens"; blocks are only ever taken into a table)
        self.ever_held: list[dict[object, set[int]]] = []

    def _learn_keys(self, sid: int) -> None:
        """Remember which (salt, tokens) each of the sequence's full-block keys names."""
        cache_i, salt, tokens = self.seqs[sid]
        B = self.caches[cache_i].block_size
        for i, key in enumerate(self.caches[cache_i].block_keys(sid)):
            self.key_to_prefix[key] = (salt, tuple(tokens[: (i + 1) * B]))

    def _block_bytes(self, window: object, key: bytes) -> bytes:
        """What a block with `key` must hold in `window`'s pool: the model's K/V of its
        tokens for every layer of the group, in the storage layout [layers, 2, B, 1, 2]."""
        cfg = self.caches[0].config
        salt, prefix = self.key_to_prefix[key]
        B = cfg.tokens_per_block
        rows = []
        for layer in cfg.layers_of(window):  # type: ignore[arg-type]
            k = torch.tensor(
                [
                    kv_value(salt, prefix[: p + 1], layer)
                    for p in range(len(prefix) - B, len(prefix))
                ]
            )
            k = k.reshape(B, 1, 1).expand(B, 1, 2)
            rows.append(torch.stack([k, -k]))
        return torch.stack(rows).to(torch.float32).contiguous().numpy().tobytes()

    # ------------------------------------------------------------------ set-up

    @precondition(lambda self: not self.caches)
    @rule(
        windows=st.sampled_from(WINDOW_SETS),
        num_blocks=st.integers(3, 10),
        reuse=st.booleans(),
        block=st.sampled_from([1, 2, 4]),
        host_blocks=st.sampled_from([0, 4, 64]),
    )
    def build(self, windows, num_blocks, reuse, block, host_blocks) -> None:  # type: ignore[no-untyped-def]
        cfg = make_config(
            num_blocks,
            windows=windows,
            tokens_per_block=block,
            reuse=reuse,
            num_layers=len(windows),
            head_dim=2,
            num_kv_heads=1,
            device=self.DEVICE,
        )
        self.host = CopyingHostTier(host_blocks, self._block_bytes) if host_blocks else None
        self.caches = [PagedKVCache(cfg, host_tier=self.host) for _ in range(2)]
        self.committed = [{w: BlockDeltas() for w in windows} for _ in self.caches]
        self.ever_held = [{w: set() for w in windows} for _ in self.caches]

    def _check_new_blocks(self, sid: int, w: object, d: BlockDeltas) -> None:
        """The blocks this operation took that had never held a token are exactly the
        ones the table holds now that the oracle never saw; learn them."""
        cache_i = self.seqs[sid][0]
        cache, seen = self.caches[cache_i], self.ever_held[cache_i][w]
        table = set(cache.block_table(sid, w))  # type: ignore[arg-type]
        never = table - seen
        if cache.config.enable_prefix_reuse:
            assert d.alloc_new_blocks == len(never), (w, d, sorted(never))
        else:  # blocks record no tokens: every take is new
            assert d.alloc_new_blocks == d.alloc_total_blocks
        if d.alloc_total_blocks > d.alloc_new_blocks + d.evicted_blocks:
            event("a free block that had held tokens was taken again")
        seen |= table

    # ------------------------------------------------------------------ the engine's side

    def _write(self, sid: int, positions: range) -> None:
        """Write the model's K/V for `positions` (those the sequence still holds)."""
        cache_i, salt, tokens = self.seqs[sid]
        cache = self.caches[cache_i]
        for layer in range(cache.config.num_layers):
            w = cache.config.window_of_layer(layer)
            lo = max(positions.start, cache.first_block_index(sid, w) * cache.block_size)
            pos = list(range(lo, positions.stop))
            if not pos:
                continue
            k = torch.tensor([kv_value(salt, tuple(tokens[: p + 1]), layer) for p in pos])
            k = k.reshape(-1, 1, 1).expand(-1, 1, 2).contiguous()
            cache.write_kv(sid, layer, pos, k, -k)

    def _check_bytes(self, sid: int) -> None:
        cache_i, salt, tokens = self.seqs[sid]
        cache = self.caches[cache_i]
        L = len(tokens)
        for layer in range(cache.config.num_layers):
            w = cache.config.window_of_layer(layer)
            start = 0 if w is None else max(0, L - w)
            k, v = (t.cpu() for t in cache.gather_kv(sid, layer))
            want = torch.tensor(
                [kv_value(salt, tuple(tokens[: p + 1]), layer) for p in range(start, L)]
            )
            assert torch.equal(k[:, 0, 0], want), (sid, layer, k[:, 0, 0].tolist(), want.tolist())
            assert torch.equal(v[:, 0, 1], -want)

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: bool(self.caches))
    @rule(
        which=st.integers(0, 1),
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4]]),
        extra=st.lists(st.integers(0, 1), max_size=5),
        salt=st.sampled_from([None, "s"]),
        host_fails=HOST_FAILS,
    )
    def add(self, which, prefix, extra, salt, host_fails) -> None:  # type: ignore[no-untyped-def]
        tokens = prefix + extra
        if not tokens:
            return
        cache = self.caches[which]
        if self.host is not None:
            self.host.failing = host_fails
        sid = self.next_id
        self.next_id += 1
        before_stats, before = cache.stats(), cache.cumulative()
        ok = cache.add_sequence(sid, tokens, salt=salt)
        if self.host is not None:
            self.host.failing = False
        if ok:
            d = cache.cumulative().total
            event(
                "onboarded" if d.onboarded_blocks > before.total.onboarded_blocks else "no onboard"
            )
            if (
                d.onboarded_blocks > before.total.onboarded_blocks
                and d.evicted_blocks > before.total.evicted_blocks
            ):
                event("evicted and onboarded in one add")
        if not ok:
            assert cache.stats() == before_stats and cache.cumulative() == before
            return
        self.seqs[sid] = (which, salt, tokens)
        self._learn_keys(sid)
        after = cache.cumulative()
        B, L = cache.block_size, len(tokens)
        for w in cache.windows:
            d = self._diff(after.windows[w], before.windows[w])
            first = 0 if w is None else max(0, L - w) // B
            prompt_blocks = -(-L // B) - first
            # every prompt block in the window is reused, onboarded or computed, once
            assert d.reused_blocks + d.onboarded_blocks + d.missed_blocks == prompt_blocks
            # TensorRT-LLM: reused blocks are not taken; taken = new + evicted + free
            # blocks that held tokens before
            assert d.alloc_total_blocks == prompt_blocks - d.reused_blocks
            assert d.alloc_new_blocks + d.evicted_blocks <= d.alloc_total_blocks
            self._check_new_blocks(sid, w, d)
            assert d.gen_alloc_blocks == 0
            assert d.reused_blocks + d.onboarded_blocks <= max(0, (L - 1) // B - first)
            computed_from = (first + d.reused_blocks + d.onboarded_blocks) * B
            self._write_window(sid, w, range(computed_from, L))
        self._check_bytes(sid)

    def _write_window(self, sid: int, window: object, positions: range) -> None:
        cache_i, salt, tokens = self.seqs[sid]
        cache = self.caches[cache_i]
        for layer in cache.config.layers_of(window):  # type: ignore[arg-type]
            pos = list(positions)
            if not pos:
                continue
            k = torch.tensor([kv_value(salt, tuple(tokens[: p + 1]), layer) for p in pos])
            k = k.reshape(-1, 1, 1).expand(-1, 1, 2).contiguous()
            cache.write_kv(sid, layer, pos, k, -k)

    @staticmethod
    def _diff(a: BlockDeltas, b: BlockDeltas) -> BlockDeltas:
        return BlockDeltas(*(x - y for x, y in zip(a.as_tuple(), b.as_tuple(), strict=True)))

    @precondition(lambda self: bool(self._running()))
    @rule(data=st.data(), n=st.integers(1, 6), host_fails=HOST_FAILS)
    def append(self, data, n, host_fails) -> None:  # type: ignore[no-untyped-def]
        sid = data.draw(st.sampled_from(self._running()))
        cache_i, _, tokens = self.seqs[sid]
        cache = self.caches[cache_i]
        if self.host is not None:
            self.host.failing = host_fails
        before_stats, before = cache.stats(), cache.cumulative()
        new = [(sid + j) % 5 for j in range(n)]
        ok = cache.append_tokens(sid, new)
        if self.host is not None:
            self.host.failing = False
        if not ok:
            assert cache.stats() == before_stats and cache.cumulative() == before
            return
        after = cache.cumulative()
        for w in cache.windows:
            d = self._diff(after.windows[w], before.windows[w])
            assert d.alloc_total_blocks == d.gen_alloc_blocks
            assert d.alloc_new_blocks + d.evicted_blocks <= d.alloc_total_blocks
            self._check_new_blocks(sid, w, d)
            assert d.reused_blocks == d.missed_blocks == d.onboarded_blocks == 0
        L0 = len(tokens)
        tokens.extend(new)
        self._learn_keys(sid)
        self._write(sid, range(L0, len(tokens)))
        self._check_bytes(sid)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), status=st.sampled_from(list(SequenceStatus)))
    def status(self, data, status) -> None:  # type: ignore[no-untyped-def]
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        cache = self.caches[self.seqs[sid][0]]
        # a running status on a sequence without blocks is refused and changes nothing
        with contextlib.suppress(ValueError):
            cache.set_status(sid, status)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data) -> None:  # type: ignore[no-untyped-def]
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.caches[self.seqs.pop(sid)[0]].free_sequence(sid)

    @precondition(lambda self: bool(self.caches))
    @rule(which=st.integers(0, 1))
    def commit(self, which) -> None:
        cache = self.caches[which]
        it = cache.commit_iteration()
        for w, d in it.windows.items():
            self.committed[which][w] = self.committed[which][w] + d
        assert self.committed[which] == dict(cache.cumulative().windows)

    # ------------------------------------------------------------------ invariants

    def _running(self) -> list[int]:
        return [
            s
            for s, (c, _, _) in sorted(self.seqs.items())
            if self.caches[c].status_of(s) in VALID_STATUSES
        ]

    @invariant()
    def integrity(self) -> None:
        for cache in self.caches:
            cache.check_integrity()  # reads only: deltas accumulate across rules
            for g in cache.stats().windows.values():
                assert g.num_blocks_used + g.num_blocks_cached <= g.num_blocks_total

    @invariant()
    def alloc_new_counts_each_block_once_on_its_first_take(self) -> None:
        for cache, seen in zip(self.caches, self.ever_held, strict=True):
            cum = cache.cumulative().windows
            for w, blocks in seen.items():
                if cache.config.enable_prefix_reuse:
                    assert cum[w].alloc_new_blocks == len(blocks), (w, cum[w], sorted(blocks))
                else:
                    assert cum[w].alloc_new_blocks == cum[w].alloc_total_blocks

    @invariant()
    def the_host_got_exactly_the_evicted_blocks_bytes(self) -> None:
        assert self.host is None or not self.host.wrong, self.host.wrong

    @invariant()
    def every_held_block_holds_the_models_bytes(self) -> None:
        for sid in self._running():
            self._check_bytes(sid)

    def teardown(self) -> None:
        for cache in self.caches:
            for sid in cache.sequence_ids():
                cache.free_sequence(sid)
            assert cache.stats().total.num_blocks_used == 0
            cache.check_integrity()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
