"""PromptMatch: what an index says the cluster holds of one prompt, by rank and by node.
Pure; no Ray.

    match_prompt(index, token_ids, salt) -> PromptMatch

The prompt's keys are kvfold's prefix keys (kvfold.worker.hashing) at the index's block
size, so anyone can ask the index what a rank or a node would reuse of a prompt and
hold it against what the rank then reuses (`reused_blocks`) and onboards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfold.blockindex.index import BlockIndex
from kvfold.worker.hashing import as_token_array, block_keys


@dataclass(frozen=True, slots=True)
class PromptMatch:
    """In blocks from the prompt's first, at most `num_blocks` (the full blocks before
    its last token, which is always computed: floor((L - 1) / B)); ranks and nodes that
    hold none of it are left out.

    gpu[rank]        on the rank's own GPU (every window group covered)
    with_host[rank]  that run, then what its node's host tier could onboard after it
    host[node]       the node's host tier alone, from the first block (full attention)
    """

    num_blocks: int
    tokens_per_block: int
    gpu: Mapping[int, int]
    with_host: Mapping[int, int]
    host: Mapping[int, int]

    @property
    def longest(self) -> int:
        """The longest run any rank could reuse, its node's host tier included."""
        return max(self.with_host.values(), default=0)


def match_prompt(
    index: BlockIndex, token_ids: object, salt: str | bytes | None = None
) -> PromptMatch:
    """What `index` holds of a prompt (token ids; `salt`: the tenant's, as the ranks were
    given). An index that has seen no block yet (block size unknown) holds nothing."""
    tokens = as_token_array(token_ids, "token_ids")
    size = index.block_size
    if not size or len(tokens) == 0:
        return PromptMatch(0, size, {}, {}, {})
    keys = block_keys(tokens, size, salt)
    limit = min(len(keys), (len(tokens) - 1) // size)
    m = index.match(keys, len(tokens))
    gpu, total = m.gpu, m.total
    full = next((g for g, window in index.windows.items() if window is None), None)
    host: dict[int, int] = {}
    if full is not None:
        for node in sorted(set(index.rank_to_node)):
            run = index.node_run(node, keys[:limit], full)
            if run:
                host[node] = run
    return PromptMatch(
        num_blocks=limit,
        tokens_per_block=size,
        gpu={r: int(g) for r, g in enumerate(gpu) if g},
        with_host={r: int(t) for r, t in enumerate(total) if t},
        host=host,
    )


__all__ = ["PromptMatch", "match_prompt"]
