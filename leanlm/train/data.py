"""Training text as fixed windows of token ids, in an order that depends only on (seed, step): a resumed run
reads exactly the batches the interrupted one would have, with no data-loader state to save."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenWindows:
    """Non-overlapping windows [N, seq_len] of a token stream, split into training and held-out windows."""

    train: torch.Tensor  # [N_train, seq_len] long
    held_out: torch.Tensor  # [N_held, seq_len] long: the last windows of the text, never trained on

    @classmethod
    def from_ids(cls, token_ids: Sequence[int], seq_len: int, held_out: int = 4) -> TokenWindows:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        count = len(ids) // seq_len
        if count < held_out + 1:
            raise ValueError(
                f"the training text has {len(ids)} tokens: {count} windows of {seq_len}, need more than "
                f"{held_out} (the held-out ones); use a longer text or a shorter --seq-len"
            )
        windows = ids[: count * seq_len].view(count, seq_len)
        return cls(windows[: count - held_out], windows[count - held_out :])

    def rows(self, index: int, batch_size: int, seed: int) -> list[int]:
        """Which training windows micro-batch number `index` of the run reads: epochs of the training windows,
        each in its own seeded order."""
        n = self.train.shape[0]
        rows, orders = [], {}
        for i in range(index * batch_size, (index + 1) * batch_size):
            epoch, pos = divmod(i, n)
            if epoch not in orders:
                orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
            rows.append(int(orders[epoch][pos]))
        return rows

    def batch(self, index: int, batch_size: int, seed: int) -> torch.Tensor:
        """Micro-batch number `index` of the run [batch_size, seq_len] (the windows `rows` names)."""
        return self.train[self.rows(index, batch_size, seed)]
