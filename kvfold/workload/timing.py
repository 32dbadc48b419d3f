"""EngineTiming: what the simulated engine charges for its work, so time to first token
reflects prefix reuse (kvfold.workload.engine).

Each rank runs one engine with a clock of its own (`busy_until`, trace seconds). In
a step at trace time `now`, starting at max(now, busy_until):

    decode      decode_step_s per iteration, when any sequence runs
    prefill     computed tokens / prefill_tokens_per_s, per admitted prompt
    onboard     onboarded tokens x kv_bytes_per_token / host_to_gpu_bytes_per_s

and a prompt's first token is out when its prefill (and onboarding) is done: TTFT =
that moment less its arrival. A recomputed (preempted) sequence is charged again.

The defaults describe one reference deployment, Llama-3.1-8B in BF16 on one H100 with
PCIe Gen4 to the host, derived from published figures rather than measured here:
- kv_bytes_per_token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 131,072;
- prefill_tokens_per_s: 12,000 (2 x 8e9 FLOP a token; 989 TFLOP/s dense BF16 at about
  20% utilisation for long prompts);
- host_to_gpu_bytes_per_s: 25 GB/s (pinned copies over PCIe Gen4 x16, of 32 GB/s peak);
- decode_step_s: 10 ms an iteration (an 8B model's inter-token latency at moderate
  batch on an H100).
So an onboarded block costs 6% of computing it (kvfold.admission.routing's default).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfold.checks import check_positive


@dataclass(frozen=True, slots=True)
class EngineTiming:
    prefill_tokens_per_s: float = 12_000.0
    host_to_gpu_bytes_per_s: float = 25e9
    kv_bytes_per_token: int = 131_072
    decode_step_s: float = 0.010

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "host_to_gpu_bytes_per_s", "kv_bytes_per_token"):
            check_positive(name, getattr(self, name))
        if self.decode_step_s < 0:
            raise ValueError(f"decode_step_s must be >= 0, got {self.decode_step_s!r}")

    def prefill_s(self, computed_tokens: int, onboarded_tokens: int) -> float:
        return (
            computed_tokens / self.prefill_tokens_per_s
            + onboarded_tokens * self.kv_bytes_per_token / self.host_to_gpu_bytes_per_s
        )

    @property
    def onboard_cost(self) -> float:
        """An onboarded token's time relative to computing it."""
        return self.kv_bytes_per_token * self.prefill_tokens_per_s / self.host_to_gpu_bytes_per_s
