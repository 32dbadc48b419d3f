"""BlockPool: the blocks of one window group, with prefix keys and LRU eviction.

Every block is in exactly one of three states:

    used       ref_count > 0            (held by one or more block tables)
    cached     ref_count == 0, keyed    (evictable; in `evictable`, LRU first)
    free       ref_count == 0, no key   (in `free_unkeyed`)

`take(n)` hands out free blocks before cached ones, and cached ones least
recently released first, dropping their keys. All operations are O(1) per
block. The pool counts nothing about prompts; `PagedKVCache` does.

A block taken is *new* (TensorRT-LLM's allocNewBlocks) when it has never held a
token since the pool was built. `free_unkeyed` is a stack: released blocks go on
top and are taken first, so the blocks never used are always its bottom
`num_never_used` entries:

    free_unkeyed = [ never used ... | released unkeyed (partial tails) ... ]  <- take
                     num_never_used

A block keeps having held tokens when it is freed, when its key is dropped to
evict it, and when it is taken again: only a new pool has new blocks. With
`records_tokens=False` (prefix reuse off) blocks record nothing, as TensorRT-LLM
keys no block without block reuse, so every block taken is new.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import repeat, takewhile
from operator import countOf

from kvfold.errors import IntegrityError
from kvfold.kvevents.journal import EventJournal
from kvfold.stats import Window

EvictListener = Callable[[int, bytes], None]
"""Called as (block_id, key) just before a cached block's key is dropped."""


class BlockPool:
    def __init__(self, num_blocks: int, records_tokens: bool = True) -> None:
        self.num_blocks = num_blocks
        self.records_tokens = records_tokens  # False: every block taken counts as new
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.key_to_block: dict[bytes, int] = {}
        # pop() from the end: block 0 is handed out first on a fresh pool.
        self.free_unkeyed: list[int] = list(range(num_blocks - 1, -1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.num_used = 0
        self.evicted_total = 0  # cumulative: cached blocks whose key was dropped
        self.num_never_used = num_blocks  # the bottom of free_unkeyed: never held a token
        self.new_total = 0  # cumulative: blocks taken that had held no token (alloc_new)
        self.evict_listener: EvictListener | None = None
        self.journal: EventJournal | None = None  # block events: keys stored and dropped
        self.window: Window = None  # which window group this pool is (for its events)

    @property
    def num_free(self) -> int:
        """Blocks available to `take`: free plus cached."""
        return len(self.free_unkeyed) + len(self.evictable)

    @property
    def num_cached(self) -> int:
        """Blocks with no reference that keep their key (evictable)."""
        return len(self.evictable)

    def cached_run(self, keys: Iterable[bytes]) -> list[int]:
        """The blocks holding `keys`, from the first, up to the first key not held
        (one C-level pass: block ids are never negative)."""
        return list(takewhile((-1).__lt__, map(self.key_to_block.get, keys, repeat(-1))))

    def num_unheld(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` no table holds (cached: attaching them makes them used)."""
        return countOf(map(self.ref_counts.__getitem__, blocks), 0)

    def can_take(
        self, n: int, attaching: Iterable[int] = (), releasing: Iterable[int] = ()
    ) -> bool:
        """Whether `take(n)` would succeed after attaching `attaching` (cached blocks
        leave the free count) and releasing `releasing` once (blocks held once return)."""
        refs = self.ref_counts.__getitem__
        revived = countOf(map(refs, attaching), 0)
        freed = countOf(map(refs, releasing), 1)
        return n + revived <= self.num_free + freed

    def attach_all(self, blocks: Iterable[int]) -> None:
        """`attach` each block (a run of prefix hits), in one pass."""
        refs = self.ref_counts
        evictable = self.evictable
        revived = 0
        try:
            for b in blocks:
                r = refs[b]
                if r == 0:
                    del evictable[b]
                    revived += 1
                refs[b] = r + 1
        finally:  # counted once, off the per-block path (and right if a block id was bad)
            self.num_used += revived

    def take(self, n: int) -> list[int] | None:
        """Give out `n` blocks with ref_count 1, or None (nothing changed) if short.
        Counts in `new_total` those that had never held a token, in `evicted_total`
        the cached ones whose key it dropped."""
        if n > len(self.free_unkeyed) + len(self.evictable):
            return None
        if n == 0:
            return []
        free = self.free_unkeyed
        k = min(n, len(free))
        # the top len(free) - num_never_used blocks held tokens before; the rest never did
        never_used = max(0, k - (len(free) - self.num_never_used))
        self.num_never_used -= never_used
        self.new_total += never_used if self.records_tokens else n
        out = free[-k:]
        del free[-k:]
        out.reverse()
        refs = self.ref_counts
        for b in out:
            refs[b] = 1
        if n > k:
            popitem = self.evictable.popitem
            keys = self.block_keys
            key_to_block = self.key_to_block
            listener = self.evict_listener
            for _ in range(n - k):
                b = popitem(last=False)[0]
                key = keys[b]
                if listener is not None:
                    listener(b, key)  # type: ignore[arg-type]
                if self.journal is not None:
                    self.journal.removed(self.window, key)  # type: ignore[arg-type]
                del key_to_block[key]  # type: ignore[arg-type]
                keys[b] = None
                refs[b] = 1
                out.append(b)
            self.evicted_total += n - k
        self.num_used += n
        return out

    def attach(self, block: int) -> None:
        """Add one reference to a used or cached block (a prefix hit)."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
            self.num_used += 1
        self.ref_counts[block] += 1

    def set_key(self, block: int, key: bytes, parent: bytes | None = None) -> bool:
        """Key a full block so later prompts can reuse it (`parent`: the key of the block
        before it, for its block event). False if the key is taken."""
        if key in self.key_to_block:
            return False
        self.key_to_block[key] = block
        self.block_keys[block] = key
        if self.journal is not None:
            self.journal.stored(self.window, (key,), parent)
        return True

    def set_keys(self, blocks: list[int], keys: list[bytes], parent: bytes | None = None) -> None:
        """`set_key` for pairs of blocks and keys, a run after `parent`. A key another
        block already holds is skipped: that block keeps it (and its block event)."""
        key_to_block = self.key_to_block
        block_keys = self.block_keys
        journal = self.journal
        piece: list[bytes] = []
        before = parent
        for b, key in zip(blocks, keys, strict=False):
            if key not in key_to_block:
                key_to_block[key] = b
                block_keys[b] = key
                if journal is not None:
                    if not piece:
                        piece_parent = before
                    piece.append(key)
            elif piece:  # the run breaks here: what was set so far is one event
                journal.stored(self.window, piece, piece_parent)  # type: ignore[union-attr]
                piece = []
            before = key
        if piece:
            journal.stored(self.window, piece, piece_parent)  # type: ignore[union-attr]

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        A block reaching 0 becomes cached (most recently released) when keyed,
        else free. Callers pass a sequence's blocks tail first, so a shared
        prefix outlives its suffixes.
        """
        refs = self.ref_counts
        keys = self.block_keys
        free, evictable = self.free_unkeyed, self.evictable
        freed = 0
        try:
            for b in blocks:
                r = refs[b] - 1
                refs[b] = r
                if r == 0:
                    freed += 1
                    if keys[b] is None:
                        free.append(b)
                    else:
                        evictable[b] = None
        finally:
            self.num_used -= freed

    def check_integrity(self, expected_refs: list[int] | None = None) -> None:
        """Raise IntegrityError with the numbers when a state breaks."""
        n = self.num_blocks
        used = sum(1 for r in self.ref_counts if r > 0)
        if any(r < 0 for r in self.ref_counts):
            raise IntegrityError(f"negative ref count: {[r for r in self.ref_counts if r < 0]}")
        if used != self.num_used:
            raise IntegrityError(f"num_used {self.num_used} != recount {used}")
        cached = len(self.evictable)
        free = len(self.free_unkeyed)
        if used + cached + free != n:
            raise IntegrityError(f"used {used} + cached {cached} + free {free} != total {n}")
        if not 0 <= self.num_never_used <= free:
            raise IntegrityError(
                f"never used {self.num_never_used} outside [0, free unkeyed {free}]"
            )
        for b in self.free_unkeyed:
            if self.ref_counts[b] != 0 or self.block_keys[b] is not None:
                raise IntegrityError(
                    f"free block {b} has ref {self.ref_counts[b]} key {self.block_keys[b]!r}"
                )
        for b in self.evictable:
            if self.ref_counts[b] != 0 or self.block_keys[b] is None:
                raise IntegrityError(f"cached block {b} has ref {self.ref_counts[b]} or no key")
        if len(set(self.free_unkeyed)) != free or set(self.free_unkeyed) & set(self.evictable):
            raise IntegrityError("a block is listed twice among free and cached blocks")
        keyed = {b: k for b, k in enumerate(self.block_keys) if k is not None}
        if len(keyed) != len(self.key_to_block) or any(
            self.key_to_block.get(k) != b for b, k in keyed.items()
        ):
            raise IntegrityError(
                f"key map has {len(self.key_to_block)} entries, {len(keyed)} blocks are keyed, "
                "or they disagree"
            )
        if expected_refs is not None and expected_refs != self.ref_counts:
            diff = [
                (b, r, e)
                for b, (r, e) in enumerate(zip(self.ref_counts, expected_refs, strict=True))
                if r != e
            ]
            raise IntegrityError(
                f"ref counts differ from block tables (block, ref, tables): {diff}"
            )
