"""How onboarded blocks travel: one contiguous buffer plus each block's length.

One buffer is one object in Ray's object store (one copy on each side), however many
blocks a prompt onboards; the rank splits it back into views without copying.
"""

from __future__ import annotations

import numpy as np


def unpack_blocks(packed: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """Split a packed buffer back into per-block views (no copy)."""
    out, start = [], 0
    for n in lengths:
        out.append(packed[start : start + n])
        start += n
    return out
