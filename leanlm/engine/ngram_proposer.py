"""NgramProposer: prompt-lookup drafts (Saxena 2023, vLLM's `ngram` method). The tail n-gram of a request's
tokens is searched for earlier in its prompt and output; the tokens that followed the match are the draft.
No model runs, so drafts are free; they pay off on extractive, repetitive and code-editing text."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Longest tail n-gram first (max_n down to min_n); among its earlier occurrences the latest one that still
    has `k` tokens after it, else the latest one."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `token_ids`; [] when the tail occurs nowhere earlier."""
        num_tokens = len(token_ids)
        if k < 1 or num_tokens < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. num_tokens - 1 - n: every earlier occurrence, never the tail itself.
            windows = sliding_window_view(ids[: num_tokens - 1], n)  # [num_tokens - n, n]
            starts = np.flatnonzero((windows == ids[num_tokens - n :]).all(axis=1))
            if starts.size == 0:
                continue
            full = starts[starts + n + k <= num_tokens]
            begin = int(full[-1] if full.size else starts[-1]) + n
            return ids[begin : begin + k].tolist()
        return []
