"""TraceRequest, and the generated workload with shared prefixes (the default demo's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay. arrival_s: seconds from the trace's start."""

    request_id: str
    arrival_s: float
    prompt: np.ndarray  # int64 token ids
    max_new_tokens: int
    prefix_group: int = -1  # which shared prefix it starts with (-1: none known)

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt.size)


def shared_prefix_workload(
    num_requests: int = 400,
    duration_s: float = 40.0,
    num_prefixes: int = 6,
    prefix_tokens: tuple[int, int] = (256, 1024),
    suffix_tokens: tuple[int, int] = (16, 384),
    output_tokens: tuple[int, int] = (16, 192),
    seed: int = 0,
) -> list[TraceRequest]:
    """Requests arriving as a Poisson process; most start with one of a few shared
    system prompts (Zipf-popular), then a unique user part.

    Deterministic for a seed, so runs compare.
    """
    if num_requests < 1 or duration_s <= 0:
        raise ValueError(
            f"need num_requests >= 1 and duration_s > 0, got {num_requests}, {duration_s}"
        )
    rng = np.random.default_rng(seed)
    prefixes = [
        np.arange(p * 1_000_000, p * 1_000_000 + int(rng.integers(*prefix_tokens)), dtype=np.int64)
        for p in range(num_prefixes)
    ]
    weights = 1.0 / np.arange(1, num_prefixes + 1)
    weights /= weights.sum()
    gaps = rng.exponential(duration_s / num_requests, size=num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    out = []
    for i in range(num_requests):
        group = int(rng.choice(num_prefixes, p=weights)) if rng.random() < 0.85 else -1
        suffix = rng.integers(100_000_000, 200_000_000, size=int(rng.integers(*suffix_tokens)))
        prompt = np.concatenate([prefixes[group], suffix]) if group >= 0 else suffix
        out.append(
            TraceRequest(
                request_id=f"req-{i:06d}",
                arrival_s=float(arrivals[i]),
                prompt=prompt.astype(np.int64),
                max_new_tokens=int(rng.integers(*output_tokens)),
                prefix_group=group,
            )
        )
    return out
