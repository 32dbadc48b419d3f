"""The block index's answer to "what could each rank reuse of this prompt", against an
oracle that walks every rank's own key sets one block at a time.

Random GPU holdings per rank and host holdings per node (any subsets, not only
prefixes: a parent can be evicted before its child), in one full-attention group and
optionally a sliding-window group, over 3 ranks or 70 (masks wider than one machine
word, a partial last node). Every way of reading the answer (arrays, one rank, the
longest run, the weighted sum a router scores with, a rank raised by what was just
sent there) must agree with the oracle.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfold.blockindex.index import BlockIndex
from kvfold.kvevents.events import HOST, RANK
from kvfold.stats import Window

B = 4  # tokens per block
KEYS = [bytes([i]) * 8 for i in range(10)]
GPN = 8  # ranks per node


def oracle(
    gpu: dict[tuple[int, int], set[bytes]],
    host: dict[tuple[int, int], set[bytes]],
    world: int,
    windows: dict[int, Window],
    keys: list[bytes],
    prompt_tokens: int,
) -> tuple[list[int], list[int]]:
    """Per rank (gpu, total): in each group from the block its window first sees, the
    blocks on the rank's GPU, then those its node's host tier holds right after; a
    sliding group covers the prompt up to where its run ends, if it has one; the prompt
    is covered as far as every group covers it."""
    limit = min(len(keys), (prompt_tokens - 1) // B)
    out_gpu, out_total = [], []
    for r in range(world):
        covers = []
        for g, window in windows.items():
            # a window of W tokens first reads token max(0, L - W): the block holding it
            start = max(0, prompt_tokens - window) // B if window else 0
            run = start
            while run < limit and keys[run] in gpu.get((r, g), set()):
                run += 1
            total = run
            while total < limit and keys[total] in host.get((r // GPN, g), set()):
                total += 1
            if start:  # a sliding window: nothing covered unless its run has something
                run = run if run > start else 0
                total = total if total > start else 0
            covers.append((run, total))
        out_gpu.append(min(c[0] for c in covers))
        out_total.append(min(c[1] for c in covers))
    return out_gpu, out_total


holdings = st.lists(st.integers(0, len(KEYS) - 1), max_size=len(KEYS)).map(
    lambda ix: {KEYS[i] for i in ix}
)


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    world = draw(st.sampled_from([3, 70]))
    groups: dict[int, Window] = {0: None}
    if draw(st.booleans()):
        groups[1] = draw(st.sampled_from([2 * B, 3 * B + 1]))
    gpu, host = {}, {}
    holders = draw(st.lists(st.integers(0, world - 1), max_size=12, unique=True))
    for r in holders:
        for g in groups:
            gpu[(r, g)] = draw(holdings)
    for node in range(-(-world // GPN)):
        for g in groups:
            if draw(st.booleans()):
                host[(node, g)] = draw(holdings)
    order = draw(st.permutations(KEYS))
    keys = list(order[: draw(st.integers(0, len(KEYS)))])
    if draw(st.booleans()):  # mostly a prompt whose prefix is widely held
        keys = sorted(keys)
    prompt_tokens = max(1, len(keys) * B + draw(st.integers(-B, B)))
    return world, groups, gpu, host, keys, prompt_tokens


@settings(max_examples=400, deadline=None)
@given(cases(), st.integers(0, 69), st.integers(0, 12), st.integers(0, 12))
def test_match_equals_a_walk_of_every_ranks_keys(
    case: tuple, sent_rank: int, sent_gpu: int, sent_total: int
) -> None:
    world, groups, gpu, host, keys, prompt_tokens = case
    idx = BlockIndex([r // GPN for r in range(world)])
    for (r, g), ks in gpu.items():
        idx.store((RANK, r), g, ks)
    for (node, g), ks in host.items():
        idx.store((HOST, node), g, ks)
    idx.windows.update(groups)
    idx.block_size = B
    want_gpu, want_total = oracle(gpu, host, world, groups, keys, prompt_tokens)

    m = idx.match(keys, prompt_tokens)
    assert m.gpu.tolist() == want_gpu
    assert m.total.tolist() == want_total
    assert [m.of(r) for r in range(world)] == list(zip(want_gpu, want_total, strict=True))
    assert m.longest == max(want_total, default=0)
    weighted = np.arange(world, dtype=np.float64)
    m.add_weighted(weighted, 2.5, 0.75)
    host = np.array(want_total) - np.array(want_gpu)  # what the host tier adds
    assert np.allclose(weighted, np.arange(world) + 2.5 * np.array(want_gpu) + 0.75 * host)

    # a rank raised to at least (gpu, total), never lowered; total never below gpu
    r = sent_rank % world
    raised = idx.match(keys, prompt_tokens).with_held(r, sent_gpu, sent_total)
    want_gpu[r] = max(want_gpu[r], sent_gpu)
    want_total[r] = max(want_total[r], sent_total, sent_gpu)
    assert raised.of(r) == (want_gpu[r], want_total[r])
    assert raised.longest == max(want_total)
    weighted = np.ones(world)
    raised.add_weighted(weighted, 2.5, 0.75)
    host = np.array(want_total) - np.array(want_gpu)
    assert np.allclose(weighted, 1 + 2.5 * np.array(want_gpu) + 0.75 * host)
    assert raised.gpu.tolist() == want_gpu and raised.total.tolist() == want_total
