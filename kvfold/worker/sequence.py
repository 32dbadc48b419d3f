"""One sequence as the cache keeps it: tokens, prefix keys and a block table per window."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfold.checks import is_int
from kvfold.stats import VALID_STATUSES, SequenceStatus, Window
from kvfold.worker.hashing import Hasher

SeqId = str | int


@dataclass(slots=True)
class SeqState:
    """One sequence's tokens, keys and block tables (owned by the cache)."""

    seq_id: SeqId
    hasher: Hasher  # running prefix hash, advanced past every full block
    status: SequenceStatus
    num_tokens: int = 0
    keys: list[bytes] = field(default_factory=list)  # keys of full blocks, in order
    tail: list[int] = field(default_factory=list)  # tokens of the partial last block
    tables: dict[Window, list[int]] = field(default_factory=dict)  # held blocks per window
    first: dict[Window, int] = field(default_factory=dict)  # logical index of tables[w][0]
    end: int = 0  # the length it is promised to reach (kvfold.worker.commitments)
    commit: dict[Window, int] = field(default_factory=dict)  # its commitment per window
    # of its prompt, the leading tokens every window found cached on this rank's GPU, and
    # those plus what the host tier onboarded (the rest was computed)
    prompt_reused_tokens: int = 0
    prompt_covered_tokens: int = 0

    @property
    def holds_blocks(self) -> bool:
        return self.status in VALID_STATUSES


def check_seq_id(seq_id: object) -> SeqId:
    if not isinstance(seq_id, str) and not is_int(seq_id):
        raise TypeError(f"seq_id must be a str or int, got {seq_id!r} ({type(seq_id).__name__})")
    return seq_id
