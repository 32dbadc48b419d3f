"""A request trace as real HTTP requests for small engines: `kvfold bench-serve`'s workload.
Pure; no Ray.

    serve_requests(path, ...) -> list[ServeRequest]

Mooncake's hash ids name 512-token blocks, equal ids equal prefixes. A trace's prompts are
tens of thousands of tokens; the engines here hold a thousand. Each hash id becomes
`tokens_per_hash` token ids (deterministic from the id, within the model's vocabulary), so
equal ids stay equal prefixes at the engines' block size; a prompt is cut to
`max_prompt_tokens` (its first blocks: the shared part is kept) and its output to
`max_output_tokens`. Azure rows carry no prefix information: their prompts are their own.
Arrival times are kept, divided by `time_scale`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfold.workload.traces import MOONCAKE_BLOCK_TOKENS, load_trace


@dataclass(frozen=True, slots=True)
class ServeRequest:
    request_id: str
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    text: str = ""  # the prompt as text that tokenizes to `prompt` (kvfold.bench.prompt_text)


def serve_requests(
    path: str | Path,
    limit: int | None = None,
    *,
    tokens_per_hash: int = 32,
    vocab_size: int = 1024,
    max_prompt_tokens: int = 768,
    max_output_tokens: int = 64,
    time_scale: float = 1.0,
    vocab: Sequence[int] | None = None,
    first_token: int | None = None,
) -> list[ServeRequest]:
    """`vocab`: the token ids a prompt is drawn from (default: 3 .. vocab_size - 1);
    `first_token`: one that starts every prompt (a tokenizer's BOS, so that the prompt's
    text tokenizes to the same ids)."""
    if tokens_per_hash <= 0 or MOONCAKE_BLOCK_TOKENS % tokens_per_hash:
        raise ValueError(
            f"tokens_per_hash={tokens_per_hash}: allowed: a divisor of {MOONCAKE_BLOCK_TOKENS}"
        )
    if vocab is not None and len(set(vocab)) < 16:
        raise ValueError(f"vocab: {len(set(vocab))} distinct ids: allowed: >= 16")
    if vocab_size < 16 or max_prompt_tokens < 2 or max_output_tokens < 1 or not time_scale > 0:
        raise ValueError(
            f"vocab_size={vocab_size}, max_prompt_tokens={max_prompt_tokens}, "
            f"max_output_tokens={max_output_tokens}, time_scale={time_scale}: allowed: "
            ">= 16, >= 2, >= 1, > 0"
        )
    scale = MOONCAKE_BLOCK_TOKENS // tokens_per_hash
    out = []
    for r in load_trace(path, limit):
        # a hash id's first token stands for its 512: one id per MOONCAKE block
        ids = [int(t) // MOONCAKE_BLOCK_TOKENS for t in r.prompt[::MOONCAKE_BLOCK_TOKENS]]
        tokens: list[int] = [] if first_token is None else [first_token]
        for h in ids:
            tokens += _tokens_of(h, tokens_per_hash, vocab_size, vocab)
        n = max(2, min(-(-r.prompt_tokens // scale), max_prompt_tokens, len(tokens)))
        out.append(
            ServeRequest(
                r.request_id,
                r.arrival_s / time_scale,
                tuple(tokens[:n]),
                max(1, min(r.max_new_tokens, max_output_tokens)),
            )
        )
    return out


def _tokens_of(hash_id: int, n: int, vocab_size: int, vocab: Sequence[int] | None) -> list[int]:
    rng = random.Random(hash_id * 7919 + 17)
    if vocab is not None:
        return [vocab[rng.randrange(len(vocab))] for _ in range(n)]
    return [rng.randrange(3, vocab_size) for _ in range(n)]  # 0-2: the special tokens


__all__ = ["ServeRequest", "serve_requests"]
