"""Hit rates a trace allows without any cluster: the references `kvfold compare` prints
beside what each router achieved.

    infinite   the share of prompt blocks computed before by any earlier request (an
               unbounded cache that every request could reach)
    lru        the hit rate of one LRU cache holding the whole cluster's GPU capacity
               (every rank's blocks pooled: what a perfectly shared cache of that size
               would reuse)

Blocks are a prompt's full blocks, keyed as the caches key them (prefix-chained, so a
hit on block i means blocks 0..i were held too); at most all but the last token's
block is reused, as in the caches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvfold.worker.hashing import block_keys
from kvfold.workload.requests import TraceRequest


def reference_hit_rates(
    workload: Sequence[TraceRequest], tokens_per_block: int, lru_blocks: int
) -> dict[str, float]:
    seen: set[bytes] = set()
    lru: OrderedDict[bytes, None] = OrderedDict()
    total = inf_hits = lru_hits = 0
    for req in sorted(workload, key=lambda r: r.arrival_s):
        keys = block_keys(req.prompt, tokens_per_block)
        limit = min(len(keys), (req.prompt_tokens - 1) // tokens_per_block)
        total += len(keys)
        inf_hits += next((i for i, k in enumerate(keys[:limit]) if k not in seen), limit)
        run = next((i for i, k in enumerate(keys[:limit]) if k not in lru), limit)
        lru_hits += run
        seen.update(keys)
        for k in keys:  # the prompt's blocks become the most recently used
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > lru_blocks:
            lru.popitem(last=False)
    return {
        "infinite": inf_hits / max(1, total),
        "lru": lru_hits / max(1, total),
    }
